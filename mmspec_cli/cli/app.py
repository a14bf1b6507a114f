"""The ``mmspec`` typer app and its console-script entry point.

Commands are registered through :func:`_register`, which wraps each one in
:func:`~mmspec_cli.cli.errors.handles_errors`, so every command (also under typer's
``CliRunner``) maps errors the same way. Command modules import the engine inside the
command, so ``--help`` and ``--version`` stay fast.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

import typer

from mmspec_cli import __version__
from mmspec_cli.cli.errors import handles_errors
from mmspec_cli.cli.bench import bench
from mmspec_cli.cli.compare import compare
from mmspec_cli.cli.generate import generate
from mmspec_cli.cli.profile_latency import profile_latency
from mmspec_cli.cli.select_layer import select_layer

app = typer.Typer(
    name="mmspec",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _register(command: Callable) -> None:
    app.command()(handles_errors(command))


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


def main() -> None:
    """Console-script entry point: ``mmspec``."""
    app(prog_name="mmspec")
