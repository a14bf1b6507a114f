"""Command-line options shared by several commands, declared once.

The decoding flags (``--gamma``, ``--tree-width``, ``--temperature``, ...) are built from the
profile's override table (:data:`mmspec_cli.models.profiles.OVERRIDES`): a command decorated
with :func:`decoding_flags` gets every one of them and receives their values as one
``overrides`` dict, ready for ``apply_overrides``. :func:`check_writable` checks an output
path given by a flag before the command's work starts.
"""

from __future__ import annotations

import functools
import inspect
import os
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from mmspec_cli.cli.errors import shorten
from mmspec_cli.errors import InputError
from mmspec_cli.models.profiles import OVERRIDES

Images = Annotated[list[str] | None, typer.Argument(metavar="IMAGE", help="Image files, in prompt order.",
                                                    show_default=False)]
Questions = Annotated[list[str] | None, typer.Option("-q", "--question", metavar="TEXT",
                                                     help="A question; repeat for a multi-turn conversation.",
                                                     show_default=False)]
ProfileName = Annotated[str | None, typer.Option("--profile", metavar="NAME|PATH",
                                                 help="Built-in profile name or YAML file.")]
Threads = Annotated[int | None, typer.Option("--threads", metavar="N", help=(
    "CPU threads for models on the CPU (also MMSPEC_THREADS), at most twice the cores this process may use "
    "(more only wait for each other); default: 1 for small models like the demo family's, else the cores the load "
    "average leaves idle."))]


TurnImages = Annotated[list[str] | None, typer.Option("--turn-image", metavar="N:IMAGE", help=(
    "An image the N-th question (-q, counted from 1) brings: shown in that turn, after the conversation so far, "
    "whose cache is kept. Repeat for more; IMAGE arguments open the conversation."), show_default=False)]


def parse_turn_images(values: list[str] | None, questions: int) -> dict[int, list[str]]:
    """``--turn-image N:IMAGE`` values as {question index from 0: image paths}, in the order given; one line
    when one is malformed or names a question that is not there."""
    found: dict[int, list[str]] = {}
    for value in values or []:
        number, _, path = value.partition(":")
        if not number.strip().isdigit() or not path:
            raise InputError(f"--turn-image takes N:IMAGE, the question's number (from 1) and an image file, got "
                             f"{shorten(value)}; e.g. --turn-image 2:second.png")
        if not 1 <= int(number) <= questions:
            raise InputError(f"--turn-image {shorten(value)} names question {int(number)}, but there "
                             f"{'is' if questions == 1 else 'are'} {questions} question{'s' * (questions != 1)} (-q); "
                             f"number them from 1 in the order given")
        found.setdefault(int(number) - 1, []).append(path)
    return found


def check_threads(threads: int | None) -> int | None:
    """``--threads`` and ``MMSPEC_THREADS``, checked before any model loads (one line each when wrong)."""
    import os

    from mmspec_cli.models.threads import ENV, check_count

    if os.environ.get(ENV, "").strip():
        check_count(os.environ[ENV], ENV)
    return None if threads is None else check_count(threads, "--threads")


def step_costs(profile: Any, drafters: list[str], device: Any, threads: int | None) -> dict:
    """The step costs ``--gamma-schedule cost`` chooses γ from, per drafter (``bench/latency.run_step_costs``), with
    its one ``note:`` line on stderr when some are not measured; looked up after the thread choice, which the cache is
    keyed by."""
    from mmspec_cli.bench.latency import run_step_costs

    costs, note = run_step_costs(profile, drafters, device, threads)
    if note:
        typer.echo(note, err=True)
    return costs


def flag_type(name: str, help_text: str | None = None) -> Any:
    """The typer annotation of override ``name``'s flag (``--name-with-dashes``), unset by default."""
    spec = OVERRIDES[name]
    flag = "--" + name.replace("_", "-")
    if spec.type is bool:
        flag = f"{flag}/--no-{flag[2:]}"
        return Annotated[bool | None, typer.Option(flag, help=help_text or spec.help, show_default=False)]
    return Annotated[spec.type | None, typer.Option(flag, metavar=spec.metavar, help=help_text or spec.help)]


def decoding_flags(*, drafter: bool = False, help: dict[str, str] | None = None,
                   exclude: tuple[str, ...] = ()) -> Callable:
    """Give a command every decoding flag (and ``--drafter`` if ``drafter``) but ``exclude``; it receives
    ``overrides``. ``help`` replaces a flag's help text for this command. The flags come after the
    command's own parameters in ``--help``.
    """
    names = [name for name in OVERRIDES if (drafter or name != "drafter") and name not in exclude]

    def decorate(command: Callable) -> Callable:
        signature = inspect.signature(command, eval_str=True)
        own = [p for p in signature.parameters.values() if p.name != "overrides"]
        added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None,
                                   annotation=flag_type(name, (help or {}).get(name))) for name in names]

        @functools.wraps(command)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            overrides = {name: kwargs.pop(name, None) for name in names}
            return command(*args, overrides=overrides, **kwargs)

        wrapper.__signature__ = signature.replace(parameters=own + added)
        wrapper.__annotations__ = {p.name: p.annotation for p in own + added}
        return wrapper

    return decorate


def check_writable(path: Path, flag: str) -> None:
    """Refuse an output path now that the command could only fail on at its end, after the work (a calibration,
    a measurement) whose results would then be lost.

    A file that does not exist yet is created and removed again, which tests what permissions alone
    can't (``/proc``, a read-only mount); nothing is left behind. An existing file is not opened.
    """
    shown = shorten(str(path))
    if path.is_dir():
        raise InputError(f"{flag} {shown} is a folder; name a file in it")
    if not path.parent.is_dir():
        raise InputError(f"{flag} {shown}: folder {shorten(str(path.parent))} doesn't exist; "
                         f"create it or pick another path")
    if path.exists():
        if not os.access(path, os.W_OK):
            raise InputError(f"{flag} {shown} can't be written (permission denied); pick another path")
        return
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
    except OSError as exc:
        raise InputError(f"{flag} {shown} can't be written ({exc.strerror or exc}); pick another path") from None
    os.unlink(path)


def command_line(ctx: typer.Context, resume: bool = True) -> str:
    """This command line, with ``--resume`` added when ``resume`` (the command that continues an interrupted run),
    rebuilt from the parameters the user gave (flags in their long form, in ``--help`` order), so it is the same
    whether the command came from a shell or from a test runner."""
    words = ["mmspec", ctx.info_name or "bench"]
    for param in ctx.command.params:
        source = ctx.get_parameter_source(param.name)
        if source is None or source.name != "COMMANDLINE":  # typed by the user, not a default
            continue
        value = ctx.params[param.name]
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        if param.param_type_name == "argument":
            words += [str(v) for v in values]
        elif getattr(param, "is_flag", False):
            words.append(param.opts[0] if value or not param.secondary_opts else param.secondary_opts[0])
        else:
            words += [w for v in values for w in (max(param.opts, key=len), str(v))]
    if resume and not ctx.params.get("resume"):
        words.append("--resume")
    return shlex.join(words)
