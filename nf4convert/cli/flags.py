"""The command line's options made from their declarations (``options.py``'s fields, and those a sink declares in its
own module): a conversion's (``convert``, ``batch``), verify's, and where a source comes from (``--revision``,
``--token``, ``--cache-dir``, ``--download``). A command takes them as one ``given`` dict, the values as the command
line gave them, parsed where the command runs (a bad value is then one line, as any error of a run)."""

from __future__ import annotations

import sys
from typing import Callable

import click

from ..options import HubOptions, Option, VerifyOptions, conversion_options, declared_fields


def quiet(ctx, param, value) -> bool:
    return value or sys.stderr is None  # no standard error (closed at start): no bars to draw on it


def quiet_option(help: str = "No progress bars (downloads and uploads too); the one-line summary stays."):
    return click.option("-q", "--quiet", is_flag=True, callback=quiet, help=help)


def one_value(ctx, param, values):
    """An option given once at most (--adapter): click would keep the last of several and drop the others unsaid."""
    if len(values) > 1:
        raise click.BadParameter(
            f"given {len(values)} times; one adapter per conversion (merge several into one with peft first)"
        )
    return values[0] if values else None


def click_option(spec: Option, command: str) -> click.Option:
    """``command``'s option of one declaration."""
    settings: dict = dict(help=spec.help_of(command))
    if spec.switch:
        settings["is_flag"] = True
    elif spec.choices is not None:
        settings["type"] = click.Choice(spec.choices, case_sensitive=False)
    elif spec.folder:
        settings["type"] = click.Path(file_okay=False)
    elif spec.file:
        settings["type"] = click.Path(dir_okay=False)
    if spec.default is not None and not spec.switch:
        settings["default"] = spec.default
    if spec.show_default:
        settings["show_default"] = True
    if spec.once:
        settings.update(multiple=True, callback=one_value)
    if spec.envvar is not None:
        settings["envvar"] = spec.envvar
    if spec.metavar is not None:
        settings["metavar"] = spec.metavar
    return click.Option([*spec.spellings, spec.name], **settings)


def flagged(specs: list[Option], command: str) -> list[click.Option]:
    return [click_option(spec, command) for spec in specs if spec.flag is not None]


def conversion_flags(command: str) -> list[click.Option]:
    """A conversion's options (the sinks' among them), the source's first."""
    from ..sinks import base  # noqa: F401  (its registry's modules declare their own options: options.DISCOVERIES)

    return flagged(conversion_options(), command)


def verify_flags(command: str) -> list[click.Option]:
    """verify's own options (the source's follow -q)."""
    return flagged(declared_fields(VerifyOptions, nested=False), command)


def hub_flags(command: str) -> list[click.Option]:
    return flagged(declared_fields(HubOptions), command)


class DeclaredCommand(click.Command):
    """A command whose declared options are made as it is asked for its parameters (parsing, ``--help``): each group
    (``declared``: (the parameter it follows, or None for the first place; the options)) in its place among the
    command's own. A command's callback takes them together as ``given`` (a dict)."""

    def __init__(self, *args, declared: list[tuple[str | None, Callable[[str], list[click.Option]]]], **kwargs):
        super().__init__(*args, **kwargs)
        self.declared = declared

    def get_params(self, ctx) -> list[click.Parameter]:
        params = list(self.params)
        for after, made in self.declared:
            names = [param.name for param in params]
            at = names.index(after) + 1 if after is not None else 0
            params[at:at] = made(self.name)
        help_option = self.get_help_option(ctx)
        return [*params, help_option] if help_option is not None else params

    def invoke(self, ctx):
        own = {param.name for param in self.params}
        given = {name: ctx.params.pop(name) for name in list(ctx.params) if name not in own}
        ctx.params["given"] = given
        return super().invoke(ctx)
