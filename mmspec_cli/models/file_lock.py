"""One writer per file: an exclusive ``flock`` on ``FILE.lock`` beside it, holding the writer's PID.

Two processes writing one file (bench's results, train-head's folder or its answers) would both do the work
neither had recorded yet and write it twice; the second is refused in one line naming the first. A sidecar is used
rather than the file itself because a resume replaces the file (``os.replace``), which would leave a lock on the
old inode. The lock file is removed when the writer ends; one left by a killed writer is no lock (the kernel
released it) and the next writer takes it over. ``flock`` is advisory and local: it does not guard a file on a
network file system written from two machines. Without ``fcntl`` (Windows) there is no lock.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from mmspec_cli.errors import InputError

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; the results file is then unguarded
    fcntl = None


def unwritable(path: Path, exc: OSError, what: str = "--out") -> InputError:
    """The refusal of ``path`` (named as ``what``, ``--out``), which can't be written: ``exc`` says why."""
    return InputError(f"{what} {path} can't be written ({exc.strerror or type(exc).__name__}); "
                      f"choose a writable file path")


class LockHeld(InputError):
    """:meth:`OutLock.acquire`'s refusal when another process holds the lock; ``holder``: its PID, where it wrote
    one. The message gives bench's advice; a command with other advice (train-head) catches it and says its own."""

    def __init__(self, message: str, holder: int | None):
        super().__init__(message)
        self.holder = holder


class OutLock:
    """An exclusive ``flock`` on ``FILE.lock`` next to a results file, holding the owner's PID (module docstring)."""

    def __init__(self, path: Path, fd: int):
        self.path = path
        self._fd = fd

    @classmethod
    def acquire(cls, out: Path, what: str = "--out") -> "OutLock | None":
        """The lock of ``out``, or an :class:`InputError` naming the process that holds it (``what``: how the
        error line names ``out``, bench's ``--out`` or train-head's answers file).

        None where there is nothing to lock: no ``fcntl``, or ``out`` is not a regular file (``/dev/null``)."""
        if fcntl is None or (out.exists() and not out.is_file()):
            return None
        path = cls.file_for(out)
        while True:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                raise unwritable(out, exc, what) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    break  # a file system without locks (ENOLCK): go on unguarded, as without fcntl
                holder = _read_pid(fd)
                os.close(fd)
                who = f"another process (PID {holder})" if holder else "another process"
                raise LockHeld(f"{what} {out} is being written by {who}; let it finish or stop it, "
                               f"then continue the file with --resume, or choose another --out", holder) from None
            # the lock's owner removes the file as it releases it: then we hold a lock on a removed file, try again
            try:
                if os.path.samestat(os.fstat(fd), os.stat(path)):
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        except OSError:
            pass  # a full disk: the lock holds all the same, only a refused writer can't name us
        return cls(path, fd)

    @staticmethod
    def file_for(out: Path) -> Path:
        """``FILE.lock``, the lock file of ``out``."""
        return out.with_name(out.name + ".lock")

    def release(self) -> None:
        """Remove the lock file, then let go (in this order, see :meth:`acquire`)."""
        try:
            self.path.unlink()
        except OSError:
            pass
        os.close(self._fd)


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None
