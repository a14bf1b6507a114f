"""The ``mmspec`` typer app and its console-script entry point.

Commands are registered through :func:`_register`, which wraps each one in
:func:`~mmspec_cli.cli.errors.handles_errors`, so every command (also under typer's
``CliRunner``) maps errors the same way; click's usage errors become one line in
:class:`MmspecGroup`. Command modules import the engine inside the command, so ``--help``
and ``--version`` stay fast.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Annotated, Any

import typer
from typer.core import TyperCommand, TyperGroup

from mmspec_cli import __version__
from mmspec_cli.cli.errors import handles_errors, usage_errors_in_one_line
from mmspec_cli.cli.bench import bench
from mmspec_cli.cli.compare import compare
from mmspec_cli.cli.generate import generate
from mmspec_cli.cli.profile_latency import profile_latency
from mmspec_cli.cli.select_layer import select_layer
from mmspec_cli.cli.train_head import train_head


class _FlagsShowNoMetavar:
    """``--json`` and ``--help`` take no value, so ``--help`` shows none (typer's rich help prints ``<bool>``)."""

    def get_params(self, ctx: Any) -> list:
        params = super().get_params(ctx)
        for param in params:
            if getattr(param, "is_flag", False) and param.metavar is None:
                param.metavar = ""
        return params


class MmspecCommand(_FlagsShowNoMetavar, TyperCommand):
    """A command of ``mmspec``."""


class MmspecGroup(_FlagsShowNoMetavar, TyperGroup):
    """The ``mmspec`` group: a usage or type error anywhere (parsing the group's flags, or a command's, or a
    value a command's parameter can't take) is one ``error:`` line and exit 2, not typer's boxed panel."""

    def make_context(self, *args: Any, **kwargs: Any) -> Any:
        with usage_errors_in_one_line():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx: Any) -> Any:
        with usage_errors_in_one_line():
            return super().invoke(ctx)


app = typer.Typer(
    name="mmspec",
    cls=MmspecGroup,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _register(command: Callable) -> None:
    app.command(cls=MmspecCommand)(handles_errors(command))


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"mmspec {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_show_version, is_eager=True, help="Show the version and exit.")
    ] = False,
) -> None:
    """Lossless speculative decoding for vision-language models (LLaVA family)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # transformers' "Loading weights" bars are noise on the CLI's stderr


_register(generate)
_register(bench)
_register(compare)
_register(profile_latency)
_register(select_layer)
_register(train_head)


def main() -> None:
    """Console-script entry point: ``mmspec``."""
    _stand_in_for_closed_streams()
    app(prog_name="mmspec")


def _stand_in_for_closed_streams() -> None:
    """Give a closed stdin/stdout/stderr (``mmspec generate ... >&-``) a devnull stand-in, for every command.

    Python sets ``sys.stdout`` to None when file descriptor 1 is closed; click, rich and the
    commands' ``isatty`` checks then fail with "'NoneType' object has no attribute ...". Output
    to a closed stream is discarded, as the user asked.
    """
    for name, mode in (("stdin", "r"), ("stdout", "w"), ("stderr", "w")):
        if getattr(sys, name) is None:
            setattr(sys, name, open(os.devnull, mode, encoding="utf-8"))  # open for the life of the process
