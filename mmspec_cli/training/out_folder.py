"""``--out DIR``: what train-head may write there, checked before anything loads, and what a failed run leaves.

train-head writes into DIR only :data:`OWN_FILES`: ``config.json`` and ``model.safetensors`` (the
finished head or imitation network), ``checkpoint.pt`` (an unfinished training), and their
``.tmp`` files while it writes them. The target's answers go beside DIR, to
``DIR.answers.jsonl`` (with ``DIR.answers.jsonl.lock`` while a run holds it).

- **Nothing the user owns is overwritten.** A DIR that holds anything else, or a ``config.json``
  train-head did not write (a model's folder: the profile's own target, say), is refused in one
  line, with or without ``--resume``. ``.`` and ``..`` are folders like any other, so a non-empty
  one is refused; ``--out ''`` and the root folder (which has no name to put the answers file
  beside) are refused as such.
- **A failed run leaves nothing that wasn't there.** DIR is created by its first write (the
  first checkpoint); the folders above it are created for the answers file and removed again
  by :func:`clean_up` when the run fails before any answer was kept. What does stay (answers,
  a checkpoint) is what the next run reuses, and the error line says so.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from mmspec_cli.choices import IMITATION
from mmspec_cli.errors import InputError
from mmspec_cli.models.prompts import shorten

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
CHECKPOINT = "checkpoint.pt"
OWN_FILES = frozenset({CONFIG, WEIGHTS, CHECKPOINT, *(f"{name}.tmp" for name in (CONFIG, WEIGHTS, CHECKPOINT))})


def resolve_out(text: str) -> Path:
    """``--out`` as an absolute folder path (``~`` expanded, ``..`` resolved), or one line saying why not."""
    if not text.strip():
        raise InputError("--out is empty; name a folder for the head, e.g. --out heads/my-vispec")
    folder = Path(os.path.abspath(os.path.expanduser(text)))
    if folder.parent == folder:
        raise InputError(f"--out {shorten(text)} is the root folder, which has no name to put the answers file "
                         f"beside; name a folder under it, e.g. --out heads/my-vispec")
    return folder


def finished_network(out: Path) -> dict[str, Any] | None:
    """What train-head's ``config.json`` in ``DIR`` says of the finished network (its ``kind`` and ``target``; an
    imitation network's kind is ``imitation``), or None when DIR holds none."""
    try:
        config = json.loads((out / CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    if isinstance(config.get("mmspec_imitation"), dict):
        return {**config["mmspec_imitation"], "kind": IMITATION}
    block = config.get("mmspec")
    return block if isinstance(block, dict) and "kind" in block else None


def foreign_entries(out: Path) -> list[str]:
    """The names in ``out`` train-head did not write (its own config.json counts as its own only if it is)."""
    names = sorted(p.name for p in out.iterdir())
    return [n for n in names if n not in OWN_FILES or (n == CONFIG and finished_network(out) is None)
            or not (out / n).is_file()]


def check_out(out: Path) -> None:
    """Before anything loads: ``out`` is not a file, holds nothing train-head did not write, and it and the answers
    file beside it can be written."""
    shown = shorten(str(out))
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {shown} is a file; name a folder for the head")
    if out.is_dir():
        foreign = foreign_entries(out)
        if foreign:
            listed = ", ".join(shorten(n, 30) for n in foreign[:3]) + (
                f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
            raise InputError(f"--out {shown} holds files train-head did not write ({listed}); "
                             f"name a new or empty folder (train-head would overwrite {CONFIG} and {WEIGHTS})")
    for folder in {out, out.parent}:
        _check_writable(_existing_ancestor(folder), shown)


def _existing_ancestor(folder: Path) -> Path:
    while not folder.exists() and folder.parent != folder:
        folder = folder.parent
    return folder


def _check_writable(folder: Path, shown: str) -> None:
    try:
        if not folder.is_dir():
            raise NotADirectoryError(20, "Not a directory")
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise InputError(f"--out {shown} can't be written ({exc.strerror or exc} in {shorten(str(folder), 60)}); "
                         f"pick another folder") from None


def make_parents(path: Path) -> list[Path]:
    """Create the missing folders above ``path``; the ones created, deepest first (for :func:`clean_up`)."""
    created = []
    folder = path.parent
    while not folder.exists():
        created.append(folder)
        folder = folder.parent
    path.parent.mkdir(parents=True, exist_ok=True)
    return created


def clean_up(created: list[Path]) -> None:
    """Remove the folders :func:`make_parents` created, deepest first, where they are still empty."""
    for folder in created:
        try:
            folder.rmdir()
        except OSError:
            return  # not empty (something was kept there), so neither are the folders above it
