"""Checkpoints of an unfinished training, written atomically, and the checks before a run starts or resumes.

``DIR/checkpoint.pt`` holds everything the next step depends on: the head's weights, the
optimizer's and the scheduler's states, the step, the noise generator's and torch's RNG states,
and the run's identity (kind, num_q, target) and settings. It is written to a temporary file
and renamed over the old one, so a kill while writing leaves the previous checkpoint whole. The
finished head replaces it (the checkpoint is deleted), so ``--resume`` after a kill loses at most
one checkpoint interval.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mmspec_cli.choices import IMITATION
from mmspec_cli.errors import InputError
from mmspec_cli.models.prompts import shorten
from mmspec_cli.models.target_identity import canonical_name
from mmspec_cli.training.out_folder import CHECKPOINT, finished_network
from mmspec_cli.models.writing import write_atomically

NAME = CHECKPOINT
FORMAT = 1


def checkpoint_path(out: Path) -> Path:
    return out / NAME


def save_checkpoint(out: Path, state: dict[str, Any]) -> None:
    """Write ``state`` to ``DIR/checkpoint.pt`` atomically (:func:`mmspec_cli.models.writing.write_atomically`);
    :class:`~mmspec_cli.models.writing.WriteFailed` leaves the previous checkpoint as it was."""
    out.mkdir(parents=True, exist_ok=True)
    write_atomically({checkpoint_path(out): lambda handle: torch.save({"format": FORMAT, **state}, handle)})


def load_checkpoint(out: Path) -> dict[str, Any]:
    path = checkpoint_path(out)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a foreign or damaged file: one line, whatever the reader raised
        raise InputError(f"{shorten(str(path))} can't be read ({type(exc).__name__}); delete it and train "
                         f"without --resume") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise InputError(f"{shorten(str(path))} is not a train-head checkpoint; delete it and train without --resume")
    return state


def check_start(out: Path, resume: bool, kind: str, target: str) -> dict[str, Any] | None:
    """Before anything loads: the checkpoint to resume (None: start afresh), or one line saying why not.

    ``--resume`` refuses a checkpoint, or a finished network, of another kind or target, and a DIR
    with nothing to resume; without ``--resume`` an unfinished training's checkpoint is not silently
    overwritten. (What else DIR may hold is checked first, by :func:`.out_folder.check_out`.)
    """
    shown = shorten(str(out))
    has_checkpoint = checkpoint_path(out).is_file()
    if not resume:
        if has_checkpoint:
            raise InputError(f"{shown} holds the checkpoint of an unfinished training; pass --resume to continue "
                             f"it, or delete {shown}/{NAME} to start again")
        return None
    if has_checkpoint:
        state = load_checkpoint(out)
        check_identity(state.get("kind"), state.get("target"), kind, target, f"{shown}/{NAME}")
        return state
    finished = finished_network(out)
    if finished is not None:
        check_identity(finished.get("kind"), finished.get("target"), kind, target, shown)
        what = "imitation network" if kind == IMITATION else f"{kind} head"
        raise InputError(f"{shown} holds a finished {what} and no checkpoint; there is nothing to resume "
                         f"(drop --resume to train it again)")
    raise InputError(f"--resume: {shown} holds no checkpoint of an unfinished training, so there is nothing to "
                     f"resume; drop --resume to start training")


def check_identity(have_kind: Any, have_target: Any, kind: str, target: str, shown: str) -> None:
    """The checkpoint or network at ``shown`` must be of ``kind`` and for ``target`` (names compared as
    :func:`~mmspec_cli.models.target_identity.canonical_name` writes them: a trailing slash is the same folder)."""
    if have_kind != kind:
        have, want = (network_of(k) for k in (have_kind, kind))
        raise InputError(f"--resume: {shown} is {have}, not {want}; run train-head {have_kind} to resume it, "
                         f"or pick another --out")
    if not isinstance(have_target, str) or canonical_name(have_target) != canonical_name(target):
        raise InputError(f"--resume: {shown} was trained for target {shorten(str(have_target))}, not "
                         f"{shorten(target)}; use that target's profile, or pick another --out")


def network_of(kind: Any) -> str:
    """"an eagle head's", "a vispec head's", "an imitation network's"."""
    if kind == IMITATION:
        return "an imitation network's"
    return f"{'an' if str(kind)[:1] in 'aeiou' else 'a'} {kind} head's"


def check_settings(state: dict[str, Any], settings: dict[str, Any], shown: str) -> None:
    """A resumed run must continue with the settings it started with, its answers' included (else it would not
    be the same run)."""
    saved = {**state.get("settings", {}), "sequences": state.get("sequences"), "answers": state.get("answers"),
             "draft_vocab": state.get("draft_vocab")}  # an eagle3 head's
    diff = [f"{k} {saved.get(k)!r} (now {v!r})" for k, v in settings.items() if saved.get(k) != v]
    if diff:
        raise InputError(f"--resume: {shown} was started with other settings: {', '.join(diff)}; pass the flags "
                         f"of the interrupted run")
