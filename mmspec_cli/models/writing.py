"""Files written so that a failed write leaves nothing a later run would trust.

- :func:`write_atomically`: each whole file goes to ``NAME.tmp``, is flushed and synced, then
  renamed over ``NAME``. A failure (a full disk, an I/O error) removes the temporary files, so
  each ``NAME`` is either the old file or the new one, never half of one.
- :func:`append_durably`: bytes appended in one write; a failure cuts the file back to the size it
  had, so its last line stays a whole record (and a file this call created is removed again).

Both raise :class:`WriteFailed`, a one-line user error naming the file and the reason, which
the caller completes with what was kept and how to go on. :func:`check_can_make` refuses, before any work, a file
or folder that could not be made where a command was told to write it.
"""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import BinaryIO

from mmspec_cli.errors import InputError, MmspecError


class WriteFailed(MmspecError):
    """A file could not be written (``reason``: "the disk is full", or the system's words)."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"writing {path} failed: {reason}")
        self.path = path
        self.reason = reason


#: :func:`reason`'s words for a full disk (or quota)
DISK_FULL = "the disk is full"


def reason(exc: BaseException) -> str:
    """What went wrong, in words: the disk being full is said as such."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return DISK_FULL
    if isinstance(exc, OSError) and exc.errno == errno.EFBIG:
        return "the file is larger than this process may write (ulimit -f) or the file system allows"
    return (exc.strerror if isinstance(exc, OSError) else None) or type(exc).__name__


def os_error(exc: BaseException | None) -> OSError | None:
    """The ``OSError`` behind ``exc``: itself, or one in its chain. torch's zip writer turns a failed write of a
    large checkpoint into ``RuntimeError: ... unexpected pos ...``, raised while the ``OSError`` is handled."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def open_for_writing(path: Path) -> BinaryIO:
    """The one place this module opens a file to write (tests stand a full disk in here)."""
    return open(path, "wb")


def write_atomically(files: Mapping[Path, Callable[[BinaryIO], None]]) -> None:
    """Write each ``path`` through its ``write(handle)`` into ``path.tmp``, then rename them all (module doc).

    Every temporary file is written before the first rename, so a failure leaves each file as it
    was. ``write`` writes to the handle only (``torch.save(state, handle)``, the bytes of
    ``safetensors.torch.save``), so a failure is the handle's ``OSError`` (:func:`os_error` finds it
    behind torch's own error).
    """
    written: list[tuple[Path, Path]] = []
    try:
        for path, write in files.items():
            tmp = path.with_name(path.name + ".tmp")
            written.append((tmp, path))
            with open_for_writing(tmp) as handle:
                write(handle)
                handle.flush()
                os.fsync(handle.fileno())
    except BaseException as exc:  # a full disk, or Ctrl-C while writing: no temporary file stays behind
        for tmp, _ in written:
            tmp.unlink(missing_ok=True)
        cause = os_error(exc)
        if cause is not None:
            raise WriteFailed(written[-1][1], reason(cause)) from None
        raise
    for tmp, path in written:
        os.replace(tmp, path)


def open_for_appending(path: Path) -> BinaryIO:
    """The one place this module opens a file to append to (tests stand a full disk in here)."""
    return open(path, "ab")


def append_durably(path: Path, data: bytes) -> None:
    """Append ``data`` to ``path`` in one write and sync it; on failure cut the file back (module doc)."""
    existed = path.exists()
    size = path.stat().st_size if existed else 0
    try:
        with open_for_appending(path) as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as exc:
        try:
            if existed:
                os.truncate(path, size)
            else:
                path.unlink(missing_ok=True)
        except OSError:
            pass  # the cut-off line is dropped when the file is read again
        raise WriteFailed(path, reason(exc)) from None


def existing_ancestor(path: Path) -> Path:
    """``path``, or the nearest folder above it that exists (which may be a file: :func:`check_can_make` says so)."""
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def check_can_make(folder: Path, what: str) -> None:
    """Refuse in one line naming ``what`` (``--out DIR``) a ``folder`` that can't be made or written into, before any
    work: where its nearest existing ancestor (or itself) is a file, or no file can be created there (a read-only
    file system, ``/proc``, no permission), tried by creating a temporary file there and removing it again."""
    from mmspec_cli.models.prompts import shorten

    found = existing_ancestor(folder)
    if not found.is_dir():
        raise InputError(f"{what} can't be made: {shorten(str(found), 60)} is a file, not a folder; pick another path")
    try:
        with tempfile.TemporaryFile(dir=found):
            pass
    except OSError as exc:
        raise InputError(f"{what} can't be written ({exc.strerror or exc} in {shorten(str(found), 60)}); pick "
                         f"another path") from None
