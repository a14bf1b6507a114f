"""``--out DIR``: what train-head may write there, checked before anything loads, and what a failed run leaves.

train-head writes into DIR only :data:`OWN_FILES`: ``config.json`` and ``model.safetensors`` (the
finished head or imitation network), ``checkpoint.pt`` (an unfinished training), and their
``.tmp`` files while it writes them. The target's answers go beside DIR, to
``DIR.answers.jsonl`` (with ``DIR.answers.jsonl.lock`` while a run answers into it), and
``DIR.train.lock`` lies beside DIR while a run trains into it (:mod:`.locks`).

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

import errno
import json
import os
from pathlib import Path
from typing import Any

from mmspec_cli.choices import IMITATION
from mmspec_cli.errors import InputError
from mmspec_cli.models.profiles import PACKAGE_DIR
from mmspec_cli.models.prompts import shorten
from mmspec_cli.models.writing import check_can_make, existing_ancestor
from mmspec_cli.models.file_lock import OutLock
from mmspec_cli.training.locks import out_lock_path

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
CHECKPOINT = "checkpoint.pt"
OWN_FILES = frozenset({CONFIG, WEIGHTS, CHECKPOINT, *(f"{name}.tmp" for name in (CONFIG, WEIGHTS, CHECKPOINT))})


def resolve_out(text: str) -> Path:
    """``--out`` as an absolute folder path (``~`` expanded, ``..`` resolved), or one line saying why not. A folder
    inside mmspec's package is refused: the shipped heads there were written by train-head, so a run would take one
    for its own output and replace what every user of the installation loads (``scripts/train_demo_heads.py``
    writes them through the training API, not through this check)."""
    if not text.strip():
        raise InputError("--out is empty; name a folder for the head, e.g. --out heads/my-vispec")
    folder = Path(os.path.abspath(os.path.expanduser(text)))
    if folder.parent == folder:
        raise InputError(f"--out {shorten(text)} is the root folder, which has no name to put the answers file "
                         f"beside; name a folder under it, e.g. --out heads/my-vispec")
    if folder.resolve().is_relative_to(PACKAGE_DIR):
        raise InputError(f"--out {shorten(text)} is inside mmspec's package ({PACKAGE_DIR}), whose shipped models every "
                         f"run of this installation loads; name a folder elsewhere, e.g. --out heads/my-vispec")
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
    """The names in ``out`` train-head did not write. Its ``config.json`` is its own only when it is train-head's
    (:func:`finished_network`), and ``model.safetensors`` only beside such a config or a checkpoint: alone it may
    be anyone's weights."""
    names = sorted(p.name for p in out.iterdir())
    own_config = CONFIG in names and finished_network(out) is not None
    vouched = own_config or CHECKPOINT in names
    return [n for n in names if n not in OWN_FILES or not (out / n).is_file() or (n == CONFIG and not own_config)
            or (n == WEIGHTS and not vouched)]


def check_out(out: Path, answers: Path) -> None:
    """Before anything loads: ``out`` is not a file, holds nothing train-head did not write, and it and the
    ``answers`` file can be written."""
    shown = shorten(str(out))
    try:
        if out.exists() and not out.is_dir():
            raise InputError(f"--out {shown} is a file; name a folder for the head")
        foreign = foreign_entries(out) if out.is_dir() else []
    except OSError as exc:  # a folder that can't be read or searched (a name too long is said by cli/errors.py)
        if exc.errno == errno.ENAMETOOLONG:
            raise
        raise InputError(f"--out {shown} can't be read ({exc.strerror or type(exc).__name__}); pick another "
                         f"folder") from None
    if foreign:
        listed = ", ".join(shorten(n, 30) for n in foreign[:3]) + (
            f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise InputError(f"--out {shown} holds files train-head did not write ({listed}); "
                         f"name a new or empty folder (train-head would overwrite {CONFIG} and {WEIGHTS})")
    if answers.is_dir():
        raise InputError(f"the answers file {shorten(str(answers))} is a folder; name a JSONL file with --answers")
    for path, what in ((out / f"{CHECKPOINT}.tmp", f"--out {shown}"), (out_lock_path(out), f"--out {shown}"),
                       (OutLock.file_for(answers), f"--out {shown}: the answers file beside it")):
        _check_name_length(path, what)
    check_can_make(out, f"--out {shown}")
    check_can_make(answers.parent, f"the answers file {shorten(str(answers))}")


def _check_name_length(path: Path, what: str) -> None:
    """Every name in ``path`` (the longest file train-head makes there) fits the file system's limit."""
    try:
        limit = os.pathconf(existing_ancestor(path.parent), "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    longest = max(path.parts, key=lambda part: len(os.fsencode(part)))
    if len(os.fsencode(longest)) > limit:
        raise InputError(f"{what} needs a name of {len(os.fsencode(longest))} bytes ({shorten(longest, 40)}), more "
                         f"than the file system allows ({limit}); use a shorter name")


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
