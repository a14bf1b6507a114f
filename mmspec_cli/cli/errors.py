"""The one place where exceptions become what the user sees, and exit codes.

- :class:`~mmspec_cli.errors.MmspecError`: ``error: <message>`` on stderr, exit 2;
- CUDA out of memory: a one-line hint (quantize, smaller dtype), exit 2;
- Ctrl-C: exit 130 (a command that saved something says what, and how to go on);
- a path too long for the file system (``OSError`` ENAMETOOLONG, from any flag or argument): one line, exit 2;
- a write that finds no room (ENOSPC, EDQUOT, EFBIG), on stdout (``> /dev/full``) or on a file no command maps
  itself: one line, exit 2 (:func:`write_failed`);
- a reader gone from a pipe (``| head -c 10``: EPIPE) is left to click, which exits 1 quietly, as a command
  killed by SIGPIPE is quiet, and keeps Python from complaining at exit;
- click's usage and type errors (``--gamma five``, an unknown flag): one ``error:`` line too, exit 2,
  instead of typer's boxed multi-line panel (:func:`usage_errors_in_one_line`).

With ``MMSPEC_DEBUG=1`` the full traceback is printed instead (same exit codes). Any other
exception is a bug and propagates with its traceback.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import re
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import Any

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
            result = command(*args, **kwargs)
            _flush(sys.stdout)  # output still buffered fails now, inside this handler, not in Python's flush at exit
            return result
        except _handled() as exc:
            raise typer.Exit(report(exc)) from None
        except OSError as exc:
            if exc.errno == errno.ENAMETOOLONG:
                raise typer.Exit(report(MmspecError(name_too_long(exc)))) from None
            if exc.errno in NO_ROOM:
                raise typer.Exit(report(MmspecError(write_failed(exc)))) from None
            raise  # EPIPE is click's (see above); any other OSError unmapped here is a bug: its traceback shows

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


def name_too_long(exc: OSError) -> str:
    """The one line for a path the file system can't hold (a file or folder name over its limit, 255 bytes on most),
    wherever it was given: ``--out``, ``--profile``, SOURCE, ..."""
    path = exc.filename if isinstance(exc.filename, str) else str(exc.filename or "")
    longest = max(path.split(os.sep), key=len, default="")
    return (f"the path {shorten(path)} is too long for the file system (its longest name is {len(longest.encode())} "
            f"bytes; most file systems allow 255); use a shorter name")


#: The errors of a write that found no room: a full disk, a used-up quota, a file past its size limit.
NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def write_failed(exc: OSError) -> str:
    """The one line for a write that found no room: naming the file when the error does (opening one), else
    "the output" (a write on an open stream names no file: stdout, above all, as ``> /dev/full``; the files commands
    write themselves, such as results and heads, are mapped where they are written, saying what was kept). A stdout
    that can't be flushed any more is set aside (:func:`_set_aside_stdout`)."""
    from mmspec_cli.models.writing import reason

    if _cannot_flush(sys.stdout):
        _set_aside_stdout()
    fix = "raise the limit (ulimit -f)" if exc.errno == errno.EFBIG else "free some space"
    if isinstance(exc.filename, str):
        return f"writing {shorten(exc.filename, 200)} failed: {reason(exc)}; {fix} and run the command again"
    return f"writing the output failed: {reason(exc)}; {fix}, or send the output to another disk"


@contextlib.contextmanager
def no_room_in_one_line() -> Iterator[None]:
    """Around the whole program: a write that finds no room outside any command (``mmspec --help > /dev/full``,
    ``--version``: click prints them while it parses) is one ``error:`` line and exit 2, as inside a command."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in NO_ROOM:
            raise
        raise SystemExit(report(MmspecError(write_failed(exc)))) from None


def _flush(stream: Any) -> None:
    try:
        stream.flush()
    except (AttributeError, ValueError):  # no stream, or a closed one
        pass


def _cannot_flush(stream: Any) -> bool:
    try:
        _flush(stream)
    except OSError:
        return True
    return False


def _set_aside_stdout() -> None:
    """Send what is left of stdout to the null device: Python flushes ``sys.stdout`` once more at exit, which would
    fail again and print "Exception ignored ..." after the error line."""
    sys.stdout = open(os.devnull, "w", encoding="utf-8")  # open for the life of the process


def message(exc: BaseException) -> str:
    """The one-line message for a mapped error."""
    text = str(exc) if isinstance(exc, MmspecError) else OOM_MESSAGE
    return " ".join(text.split())


#: click's base exception. Recent typers raise the one of the click they vendor (``typer._click``), older typers
#: click's own; the public ``typer.BadParameter`` leads to the right one either way.
CLICK_ERROR = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
#: pydantic error types (recent typers convert values with pydantic) in the words click itself uses.
NOT_A = {"int_parsing": "a valid integer", "int_from_float": "a valid integer", "float_parsing": "a valid number",
         "bool_parsing": "a valid boolean"}
SHOWN_CHARS = 40  # the most of a bad value an error line quotes


@contextlib.contextmanager
def usage_errors_in_one_line() -> Iterator[None]:
    """Turn click's usage errors raised inside into one ``error:`` line and exit 2, like every other user error.

    ``mmspec`` with no arguments shows the help (click's NoArgsIsHelpError); that is left to typer.
    """
    try:
        yield
    except CLICK_ERROR as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":
            raise
        typer.echo(f"error: {usage_message(exc)}", err=True)
        raise typer.Exit(EXIT_ERROR) from None


def usage_message(exc: Exception) -> str:
    """One line for a click error: ``--gamma: 'five' is not a valid integer; see `mmspec generate --help```."""
    param = getattr(exc, "param", None)
    if param is not None and type(exc).__name__ == "BadParameter":  # a value that did not convert
        text = f"{_flag(param)}: {_not_valid(exc)}"
    else:
        text = exc.format_message()
    ctx = getattr(exc, "ctx", None)
    if ctx is not None:
        text = f"{text.rstrip('.')}; see `{ctx.command_path} --help`"
    return " ".join(text.split())


def _flag(param: Any) -> str:
    """``--gamma`` for an option (its long name), ``IMAGE`` for an argument."""
    longs = [opt for opt in param.opts if opt.startswith("--")]
    return longs[0] if longs else (param.metavar or param.name.upper())


def _not_valid(exc: Exception) -> str:
    """``'five' is not a valid integer`` from the conversion error behind ``exc``; else click's own message."""
    errors = getattr(exc.__cause__, "errors", None)  # pydantic's ValidationError, under recent typers
    first = errors()[0] if callable(errors) and errors() else {}
    if first.get("type") in NOT_A and isinstance(first.get("input"), str):
        return f"{shorten(first['input'])} is not {NOT_A[first['type']]}"
    found = CLICK_NOT_VALID.match(str(exc.message))  # older typers: click's own wording, by type name
    if found:
        value, kind = found["value"], found["kind"]
        value = value[1:-1] if len(value) > 1 and value[0] == value[-1] == "'" else value
        return f"{shorten(value)} is not {'a valid integer' if kind.startswith('int') else 'a valid number'}"
    return str(exc.message).rstrip(".")


#: click's "'five' is not a valid int." (or integer, float): read so that every typer version words it alike.
CLICK_NOT_VALID = re.compile(r"^(?P<value>.+?) is not a valid (?P<kind>integer|int|float)\.?$", re.S)


def shorten(value: str, limit: int = SHOWN_CHARS) -> str:
    """``value`` quoted, cut to ``limit`` characters with an ellipsis: error lines stay short."""
    return repr(value if len(value) <= limit else value[: limit - 1] + "…")
