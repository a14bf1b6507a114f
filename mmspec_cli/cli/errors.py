"""The one place where exceptions become what the user sees, and exit codes.

- :class:`~mmspec_cli.errors.MmspecError`: ``error: <message>`` on stderr, exit 2;
- CUDA out of memory: a one-line hint (quantize, smaller dtype), exit 2;
- Ctrl-C: exit 130, quietly.

With ``MMSPEC_DEBUG=1`` the full traceback is printed instead (same exit codes). Any other
exception is a bug and propagates with its traceback.
"""

from __future__ import annotations

import functools
import os
import sys
import traceback
from collections.abc import Callable

import typer

from mmspec_cli.errors import MmspecError

DEBUG_ENV = "MMSPEC_DEBUG"
EXIT_ERROR = 2
EXIT_INTERRUPTED = 130
OOM_MESSAGE = (
    "CUDA ran out of memory; set target/draft quantization: 4bit or 8bit, or a smaller dtype (float16), "
    "in the profile, or lower --max-new-tokens"
)


def handles_errors(command: Callable) -> Callable:
    """Wrap a command so that user-facing errors exit as described above."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except _handled() as exc:
            raise typer.Exit(report(exc)) from None

    return wrapper


def _handled() -> tuple[type[BaseException], ...]:
    """The exception types mapped here; torch is not imported just to name its OOM error."""
    torch = sys.modules.get("torch")  # a CUDA OOM can only happen once torch is imported
    oom = (torch.cuda.OutOfMemoryError,) if torch is not None else ()
    return (MmspecError, KeyboardInterrupt, *oom)


def report(exc: BaseException) -> int:
    """Tell the user about ``exc`` on stderr and return the exit code."""
    code = EXIT_INTERRUPTED if isinstance(exc, KeyboardInterrupt) else EXIT_ERROR
    if os.environ.get(DEBUG_ENV) == "1":
        typer.echo("".join(traceback.format_exception(exc)), err=True, nl=False)
    elif code == EXIT_ERROR:
        typer.echo(f"error: {message(exc)}", err=True)
    return code


def message(exc: BaseException) -> str:
    """The one-line message for a mapped error."""
    text = str(exc) if isinstance(exc, MmspecError) else OOM_MESSAGE
    return " ".join(text.split())
