"""Checkpoints of an unfinished training, written atomically, and the checks before a run starts or resumes.

``DIR/checkpoint.pt`` holds everything the next step depends on: the head's weights, the
optimizer's and the scheduler's states, the step, the noise generator's and torch's RNG states,
and the run's identity (kind, num_q, target) and settings. It is written to a temporary file
and renamed over the old one, so a kill while writing leaves the previous checkpoint whole. The
finished head replaces it (the checkpoint is deleted), so ``--resume`` after a kill loses at most
one checkpoint interval.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from mmspec_cli.errors import InputError
from mmspec_cli.models.prompts import shorten

NAME = "checkpoint.pt"
FORMAT = 1


def checkpoint_path(out: Path) -> Path:
    return out / NAME


def save_checkpoint(out: Path, state: dict[str, Any]) -> None:
    """Write ``state`` to ``DIR/checkpoint.pt`` atomically (temporary file, fsync, rename)."""
    out.mkdir(parents=True, exist_ok=True)
    path = checkpoint_path(out)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as handle:
        torch.save({"format": FORMAT, **state}, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


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


def finished_head(out: Path) -> dict[str, Any] | None:
    """The ``mmspec`` block of a head already written to ``DIR`` (None if there is none)."""
    try:
        config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    block = config.get("mmspec") if isinstance(config, dict) else None
    return block if isinstance(block, dict) else {}


def check_start(out: Path, resume: bool, kind: str, target: str) -> dict[str, Any] | None:
    """Before anything loads: the checkpoint to resume (None: start afresh), or one line saying why not.

    ``--resume`` refuses a checkpoint, or a finished head, of another kind or target; without
    ``--resume`` an unfinished training's checkpoint is not silently overwritten.
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
    block = finished_head(out)
    if block is not None:
        check_identity(block.get("kind"), block.get("target"), kind, target, shown)
        raise InputError(f"{shown} holds a finished {kind} head and no checkpoint; there is nothing to resume "
                         f"(drop --resume to train it again)")
    return None


def check_identity(have_kind: Any, have_target: Any, kind: str, target: str, shown: str) -> None:
    if have_kind != kind:
        raise InputError(f"--resume: {shown} is a {have_kind} head's, not a {kind} head's; train {have_kind} "
                         f"to resume it, or pick another --out")
    if have_target != target:
        raise InputError(f"--resume: {shown} was trained for target {shorten(str(have_target))}, not "
                         f"{shorten(target)}; use that target's profile, or pick another --out")


def check_settings(state: dict[str, Any], settings: dict[str, Any], shown: str) -> None:
    """A resumed run must continue with the settings it started with (else it would not be the same run)."""
    saved = {**state.get("settings", {}), "sequences": state.get("sequences")}
    diff = [f"{k} {saved.get(k)!r} (now {v!r})" for k, v in settings.items() if saved.get(k) != v]
    if diff:
        raise InputError(f"--resume: {shown} was started with other settings: {', '.join(diff)}; pass the flags "
                         f"of the interrupted run")
