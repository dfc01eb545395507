"""``python -m nf4convert ...`` is the ``nf4convert`` command."""

from .entry import main

main(prog_name="nf4convert")
