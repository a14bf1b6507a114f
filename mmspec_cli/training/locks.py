"""Which train-head runs may work at once: one per DIR, and one at a time answering into an answers file.

- **DIR** is locked for the whole run, by ``DIR.train.lock`` beside it
  (:class:`~mmspec_cli.models.file_lock.OutLock`, removed when the run ends; one left by a killed run
  is no lock). A second run into the same DIR is refused in one line naming the first; it is not
  told to ``--resume``, as the first run may have written no checkpoint yet.
- **The answers file** is locked (``FILE.lock``) only while the run answers into it and every
  process has read it back; then the run lets go of it. So runs of other kinds (other DIRs) that
  name the same ``--answers`` file, the one an earlier run answered into, reuse its answers while
  that run still trains. A run that finds the file locked by a run still answering waits for it,
  saying so once (Ctrl-C stops the wait), then reuses what it answered: refusing would only send
  the user back to start it again later.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from mmspec_cli.models.file_lock import LockHeld, OutLock
from mmspec_cli.errors import InputError
from mmspec_cli.models.prompts import shorten

POLL_S = 1.0  # how often a waiting run tries the answers file's lock again


def _training(out: Path) -> Path:
    """``DIR.train``, what DIR's lock is taken on (DIR itself is made by the first checkpoint, so the lock can't be
    in it)."""
    return out.with_name(out.name + ".train")


def out_lock_path(out: Path) -> Path:
    """``DIR.train.lock``, beside ``DIR``."""
    return OutLock.file_for(_training(out))


def lock_out(out: Path) -> OutLock | None:
    """DIR's lock for the whole run, or one line naming the run that trains into DIR now."""
    try:
        return OutLock.acquire(_training(out), what="--out")
    except LockHeld as held:
        raise InputError(f"--out {shorten(str(out))} is being trained into by {_holder(held)}; let it "
                         f"finish, or pick another --out") from None


def lock_answers(path: Path, log: Callable[[str], None],
                 sleep: Callable[[float], None] = time.sleep) -> OutLock | None:
    """The answers file's lock, once no other run answers into it (module doc): until then, wait, said once."""
    said = False
    while True:
        try:
            return OutLock.acquire(path, what="the answers file")
        except LockHeld as held:
            holder = _holder(held)
        if not said:
            log(f"the answers file {shorten(str(path))} is being answered into by "
                f"{holder}; waiting for it to finish answering, then its "
                f"answers are reused (Ctrl-C to stop)")
            said = True
        sleep(POLL_S)


def _holder(held: LockHeld) -> str:
    """"another train-head run (PID n)", from the PID the lock's holder wrote into it."""
    return f"another train-head run (PID {held.holder})" if held.holder else "another train-head run"
