"""The ``mmspec`` typer app and its console-script entry point.

Commands are registered through :func:`_register`, which wraps each one in
:func:`~mmspec_cli.cli.errors.handles_errors`, so every command (also under typer's
``CliRunner``) maps errors the same way; click's usage errors become one line in
:class:`MmspecGroup`. Command modules import the engine inside the command, so ``--help``
and ``--version`` stay fast. Before a command starts, an inductor cache folder that can't be
made is set aside, or refused when the command compiles (:func:`check_inductor_cache`).
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Annotated, Any

import typer
from typer.core import TyperCommand, TyperGroup

from mmspec_cli import __version__
from mmspec_cli.cli.errors import handles_errors, no_room_in_one_line, shorten, usage_errors_in_one_line
from mmspec_cli.cli.bench import bench
from mmspec_cli.cli.compare import compare
from mmspec_cli.cli.export_head import export_head
from mmspec_cli.cli.generate import generate
from mmspec_cli.cli.profile_latency import profile_latency
from mmspec_cli.cli.select_layer import select_layer
from mmspec_cli.cli.train_head import train_head
from mmspec_cli.errors import MmspecError
from mmspec_cli.models.profiles import load_profile


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
    app.command(cls=MmspecCommand)(handles_errors(_with_usable_inductor_cache(command)))


#: Where torch's inductor keeps compiled code. Importing transformers imports ``torch._dynamo``, which creates this
#: folder at import, so a path that can't be made (under a file, in a read-only place) fails every command there.
INDUCTOR_CACHE = "TORCHINDUCTOR_CACHE_DIR"


def _with_usable_inductor_cache(command: Callable) -> Callable:
    """``command`` run after :func:`check_inductor_cache`, told whether it compiles by its parsed parameters."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        check_inductor_cache(lambda: _compiles(kwargs))
        return command(*args, **kwargs)

    return wrapper


def inductor_cache_problem() -> str | None:
    """What is wrong with ``TORCHINDUCTOR_CACHE_DIR`` as inductor's cache folder (it can't be created, or written
    to), in words; None when it is unset or usable. A folder that can be made is made, as torch's import would."""
    value = os.environ.get(INDUCTOR_CACHE)
    if value is None:
        return None
    path = os.path.abspath(value)  # as torch reads it: an empty value is the working folder
    if os.path.exists(path) and not os.path.isdir(path):
        return "is a file, not a folder"
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        return f"can't be created ({exc.strerror or type(exc).__name__})"
    if not os.access(path, os.W_OK | os.X_OK):
        return "is a folder this user can't write to"
    return None


def check_inductor_cache(compiles: Callable[[], bool]) -> None:
    """Refuse an unusable ``TORCHINDUCTOR_CACHE_DIR`` in one line when the command compiles (``compiles()``: asked
    only then); otherwise take it out of this process' environment, so that torch's import makes its default folder
    (in the temporary folder) and the command runs: a command that compiles nothing writes nothing there."""
    problem = inductor_cache_problem()
    if problem is None:
        return
    if compiles():
        raise MmspecError(f"{INDUCTOR_CACHE} {shorten(os.environ[INDUCTOR_CACHE], 200)} {problem}, and compiling "
                          f"(--compile, or decoding.compile in the profile) keeps inductor's code there; set "
                          f"{INDUCTOR_CACHE} to a folder you can write to, or unset it")
    del os.environ[INDUCTOR_CACHE]


def _compiles(kwargs: dict[str, Any]) -> bool:
    """Whether a command given ``kwargs`` compiles: its ``--compile/--no-compile`` flag, else its profile's
    ``decoding.compile``. A command without the flag (train-head) compiles nothing; a profile that can't be read
    is refused by the command itself, in its own words."""
    if "compile" not in kwargs:
        return False
    if kwargs["compile"] is not None:
        return bool(kwargs["compile"])
    try:
        return load_profile(kwargs.get("profile")).decoding.compile
    except MmspecError:
        return False


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
    """Lossless speculative decoding for vision-language models (LLaVA-1.5, LLaVA-NeXT, LLaVA-OneVision, Qwen2-VL,
    Qwen2.5-VL, Qwen3-VL)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # transformers' "Loading weights" bars are noise on the CLI's stderr


_register(generate)
_register(bench)
_register(compare)
_register(profile_latency)
_register(select_layer)
_register(train_head)
_register(export_head)


def main() -> None:
    """Console-script entry point: ``mmspec``."""
    _stand_in_for_closed_streams()
    with no_room_in_one_line():
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
