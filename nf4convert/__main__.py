"""``python -m nf4convert ...`` is the ``nf4convert`` command."""

from .cli.entry import main

main(prog_name="nf4convert")
