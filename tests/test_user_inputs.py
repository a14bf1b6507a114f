"""What a new user's odd inputs get: one line and exit 2, before any work, and nothing of theirs overwritten.

Each folder a command writes into, where it can't be made (a file above it, ``/proc``, ``/sys``, a read-only file
system); each file mmspec reads back, made by hand or damaged (a results file to summarise or resume, the latency
cache, a head folder).
"""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from tests.helpers import assert_one_line_error, cli

#: Where a folder or file can't be made, each as (the path under tmp_path or absolute, the words of its refusal).
UNMAKEABLE = {
    "under a file": ("userfile/sub", "userfile is a file, not a folder"),
    "two levels under a file": ("userfile/a/b", "userfile is a file, not a folder"),
    "under /proc": ("/proc/mmspec-out", "can't be written (No such file or directory in /proc)"),
    "under /sys": ("/sys/mmspec-out", "in /sys"),
}


def unmakeable(tmp_path: Path, case: str) -> tuple[str, str]:
    path, words = UNMAKEABLE[case]
    (tmp_path / "userfile").write_text("the user's own file")
    return (path if path.startswith("/") else str(tmp_path / path)), words


@pytest.mark.parametrize("case", UNMAKEABLE)
def test_export_head_into_a_folder_that_cant_be_made_is_one_line(tmp_path, case):
    out, words = unmakeable(tmp_path, case)
    result = cli("export-head", "mmspec:demo-eagle3", "--to", "vllm", "--out", out)
    assert_one_line_error(result, words)
    assert (tmp_path / "userfile").read_text() == "the user's own file"


def test_export_head_on_a_read_only_file_system_is_one_line(tmp_path, monkeypatch):
    """A read-only mount (root writes through permissions, so it is stood in): refused before the export when the
    folder can't be written, and a write that fails anyway leaves nothing and says what to do (not "free space")."""
    from mmspec_cli.models import writing

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    out = tmp_path / "mounted"
    out.mkdir()
    with monkeypatch.context() as patched:
        patched.setattr(writing.tempfile, "TemporaryFile", read_only)
        result = cli("export-head", "mmspec:demo-eagle3", "--to", "vllm", "--out", str(out))
    assert_one_line_error(result, f"--out {out} can't be written (Read-only file system in ")
    monkeypatch.setattr(writing, "open_for_writing", read_only)  # the probe passed, the write fails
    result = cli("export-head", "mmspec:demo-eagle3", "--to", "vllm", "--out", str(out / "new"))
    line = assert_one_line_error(result, "Read-only file system; nothing was written to")
    assert line.endswith("pick a folder you can write") and "free some space" not in line
    assert list(out.iterdir()) == []  # the folder it made is gone again


#: Every other command's output path, as (its arguments before the path, its flag, what the path names).
WRITERS = {
    "train-head --out": (["train-head", "eagle3", "demo-single", "--steps", "1"], "--out", "sub"),
    "bench --out FILE": (["bench", "demo-single", "--limit", "1", "--drafters", "ar"], "--out", "r.jsonl"),
    "bench --format mmspec --out DIR": (["bench", "demo-single", "--limit", "1", "--drafters", "ar", "--format",
                                         "mmspec"], "--out", "sub"),
    "select-layer --write": (["select-layer"], "--write", "p.yaml"),
    "profile-latency --plot": (["profile-latency"], "--plot", "latency.png"),
}


@pytest.mark.parametrize("case", ["under a file", "under /proc"])
@pytest.mark.parametrize("writer", WRITERS)
def test_every_output_path_that_cant_be_made_is_one_line_before_loading(tmp_path, no_model_loading, writer, case):
    folder, _ = unmakeable(tmp_path, case)
    arguments, flag, name = WRITERS[writer]
    result = cli(*arguments, flag, f"{folder}/{name}")
    line = assert_one_line_error(result, flag)
    assert "can't be" in line or "doesn't exist" in line
    assert (tmp_path / "userfile").read_text() == "the user's own file"
