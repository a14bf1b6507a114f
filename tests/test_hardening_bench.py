"""Hardening of ``mmspec bench`` (issue 13): a full disk, two writers of one results file, Ctrl-C, the
default profile's Eq. (1) column, and plurals.

Runs use the tiny float64 LLaVA models of ``conftest.py`` on CPU; the summary tests use hand-made records.
"""

from __future__ import annotations

import errno
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mmspec_cli.bench import latency
from mmspec_cli.bench import records as records_mod
from mmspec_cli.bench.report import check_line, counted, failure_line
from mmspec_cli.bench.summary import summarize
from mmspec_cli.cli.app import app
from mmspec_cli.models.loading import resolve_device
from mmspec_cli.models.profiles import load_profile

from tests.helpers import assert_one_line_error, tiny_files

runner = CliRunner()
CLI = [sys.executable, "-c", "from mmspec_cli.cli.app import main; main()"]
QUESTIONS = ["what is in the image?", "and then?"]
# one thread per process: two processes on a 2-core machine, and steady timings
SUBPROCESS_ENV = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")


def write_manifest(root: Path, n: int, turns: int) -> str:
    """``n`` one-image samples of ``turns`` turns each."""
    path = root / f"manifest-{n}x{turns}.jsonl"
    path.write_text("".join(json.dumps({"id": f"s{i}", "images": [f"img{i % 2}.png"], "turns": QUESTIONS[:turns],
                                        "category": "c"}) + "\n" for i in range(n)))
    return str(path)


@pytest.fixture(scope="module")
def files(tiny_dirs, tmp_path_factory) -> dict:
    files = tiny_files(tmp_path_factory.mktemp("hardening-bench"), tiny_dirs, max_new_tokens=6, gamma=3)
    root = files["root"]
    return {**files,
            "small": write_manifest(root, 2, 2),  # 2 samples x 2 turns: 8 records with ar,m
            "medium": write_manifest(root, 12, 1)}  # 24 records with ar,m: time enough for a signal to land


def bench(files: dict, *args: str):
    return runner.invoke(app, ["bench", *args, "--profile", files["profile"]])


def keys(path: Path) -> list[tuple]:
    return [(r["id"], r["turn"], r["drafter"]) for r in records_mod.read_records([path])]


def no_traceback(result) -> None:
    """The error was mapped to its exit code, not raised (under CliRunner an unmapped one lands in ``exception``)."""
    assert "Traceback" not in result.stderr and isinstance(result.exception, SystemExit), result.exception


# --------------------------------------------------------------------------- 1. a full disk


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_out_dev_full_is_one_line_saying_the_disk_is_full(files):
    result = bench(files, files["small"], "--drafters", "ar", "--out", "/dev/full", "--no-warmup")
    assert_one_line_error(result, "--out /dev/full: the disk is full, so the run stopped with 0 records saved; "
                                  "free some space and run the same command with --resume to continue")
    no_traceback(result)


def test_a_disk_that_fills_mid_run_keeps_the_records_before_and_resume_continues(files, tmp_path, monkeypatch):
    out = tmp_path / "full.jsonl"
    args = [files["small"], "--drafters", "ar,m", "--out", str(out), "--no-warmup", "--format", "json"]
    original = records_mod.ResultsFile._append
    calls = []

    def fills_after_three(self, data: bytes) -> None:
        calls.append(data)
        if len(calls) <= 3:
            return original(self, data)
        os.write(self._fd, data[: len(data) // 2])  # the disk takes half the line, then is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(records_mod.ResultsFile, "_append", fills_after_three)
    result = bench(files, *args)
    assert_one_line_error(result, f"--out {out}: the disk is full, so the run stopped with 3 records saved; free "
                                  f"some space and run the same command with --resume to continue")
    no_traceback(result)
    assert len(calls) == 4  # it stopped at the first failed write: no error records written after it
    before = out.read_text()
    assert before.count("\n") == 3 and before.endswith("\n")  # the half line was cut off again
    assert [json.loads(line) for line in before.splitlines()] == [json.loads(c) for c in calls[:3]]
    assert not Path(f"{out}.lock").exists()

    monkeypatch.setattr(records_mod.ResultsFile, "_append", original)  # space again
    again = bench(files, *args, "--resume")
    assert again.exit_code == 0, again.stderr
    assert out.read_text().startswith(before)
    found = keys(out)
    assert len(found) == len(set(found)) == 8


def test_a_failed_write_is_not_recorded_as_a_failed_sample(files, tmp_path, monkeypatch):
    """Any other write error stops the run the same way, in one line, instead of failing every sample after it."""
    def broken(self, data: bytes) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(records_mod.ResultsFile, "_append", broken)
    out = tmp_path / "eio.jsonl"
    result = bench(files, files["small"], "--drafters", "ar", "--out", str(out), "--no-warmup")
    assert_one_line_error(result, f"--out {out} could not be written (Input/output error), so the run stopped with "
                                  f"0 records saved; once it can be written, run the same command with --resume")
    assert not out.exists()  # no record was written: the file this run created is removed again


# --------------------------------------------------------------------------- 2. two writers of one file


def interruptible() -> None:
    """In the child: Ctrl-C's default. A shell starts background jobs with SIGINT ignored, and Python then
    installs no KeyboardInterrupt handler, so a test run from such a job could not interrupt its child."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wait_for_records(process: subprocess.Popen, out: Path, n: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        if out.exists() and out.read_bytes().count(b"\n") >= n:
            return
        time.sleep(0.02)
    raise AssertionError(f"no {n} records from the first run (exit code {process.poll()})")


def test_the_lock_refuses_before_any_model_loads_and_is_released(files, tmp_path, no_model_loading):
    out = tmp_path / "locked.jsonl"
    holder = records_mod.ResultsFile.open(out, False, {})
    try:
        assert Path(f"{out}.lock").read_text() == f"{os.getpid()}\n"
        result = bench(files, files["small"], "--drafters", "ar", "--out", str(out))
        assert_one_line_error(result, f"--out {out} is being written by another process (PID {os.getpid()})")
    finally:
        holder.close()
    assert not Path(f"{out}.lock").exists()
    records_mod.ResultsFile.open(out, False, {}).close()  # free again


def test_a_lock_file_left_by_a_killed_run_is_taken_over(tmp_path):
    out = tmp_path / "r.jsonl"
    Path(f"{out}.lock").write_text("999999999\n")  # nobody holds a lock on it
    with records_mod.ResultsFile.open(out, False, {}) as results:
        results.write({"id": "a", "turn": 0, "drafter": "ar"})
        assert Path(f"{out}.lock").read_text() == f"{os.getpid()}\n"
    assert out.read_text() == '{"id": "a", "turn": 0, "drafter": "ar"}\n'


# --------------------------------------------------------------------------- 3. Ctrl-C


def test_a_running_bench_refuses_a_second_writer_and_ctrl_c_says_what_is_saved_and_how_to_resume(files, tmp_path):
    """One real bench process (Ctrl-C needs one; starting it costs most of this test). While it runs, a second
    writer of its --out (this process) is refused in one line naming its PID (section 2); then Ctrl-C stops it
    with one line saying what is saved and the command that continues, and that command finishes the file
    with every record once."""
    out = tmp_path / "interrupted.jsonl"
    # 48 new tokens a turn (the profile says 6): on a loaded machine the run must not end before the signal lands
    args = ["bench", files["medium"], "--drafters", "ar,m", "--profile", files["profile"], "--out", str(out),
            "--no-warmup", "--gamma", "3", "--max-new-tokens", "48"]
    process = subprocess.Popen(CLI + args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               preexec_fn=interruptible,
                               env=SUBPROCESS_ENV)
    try:
        wait_for_records(process, out, 1)
        second = runner.invoke(app, [*args, "--resume"])
        first_was_running = process.poll() is None
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert first_was_running, "the first run ended before the second was refused"
    assert second.exit_code == 2 and second.stdout == "", (second.exit_code, second.stdout, second.stderr)
    assert second.stderr.splitlines() == [
        f"error: --out {out} is being written by another process (PID {process.pid}); let it finish "
        f"or stop it, then continue the file with --resume, or choose another --out"]

    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr
    [line] = stderr.splitlines()
    found = keys(out)
    saved = len(found)
    assert 1 <= saved < 24, "the run finished before it could be interrupted"
    assert len(set(found)) == saved
    assert not Path(f"{out}.lock").exists()  # the interrupted run removed its lock as it ended
    command = shlex.join(["mmspec", *args, "--resume"])  # the options in --help order, as typed here
    noun = "1 record is" if saved == 1 else f"{saved} records are"
    assert line == f"interrupted: {noun} saved in {out}; to continue, run: {command}"

    resumed = runner.invoke(app, shlex.split(line.split("to continue, run: ")[1])[1:])
    assert resumed.exit_code == 0, resumed.stderr
    found = keys(out)
    assert len(found) == len(set(found)) == 24


# --------------------------------------------------------------------------- 4. Eq. (1) with the default profile


DEMO = load_profile(None)
DEMO_PAIR = (DEMO.target.model, DEMO.draft.model)


def made_with(pair: tuple[str, str], drafters=("ar", "m", "mt")) -> list[dict]:
    """Hand-made turn records of two samples, as if made with the models ``pair``."""
    out = []
    for i, sample in enumerate(("s0", "s1")):
        for drafter in drafters:
            blocks = 6 if drafter == "ar" else 3 + i
            record = {"id": sample, "category": "c", "turn": 0, "drafter": drafter, "token_ids": [5] * 6,
                      "new_tokens": 6, "blocks": blocks, "wall_s": 0.1 * blocks, "drafted": 9, "accepted": 6 - blocks,
                      "prompt_tokens": 32, "gamma": 3, "temperature": 0.0, "target": pair[0], "draft": pair[1]}
            if drafter == "mt":
                record["members"] = ["m", "t"]
            out.append(record)
    return out


def write_records(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path


def cache_demo_ratio() -> None:
    """A cached latency measurement of the demo pair on this device: c = 0.1 for one row, 0.2 for two."""
    device = latency.device_name(resolve_device(DEMO.target.device))
    latency.save(latency.LatencyResult(device, *DEMO_PAIR, target_ms={"32,3": 10.0},
                                       draft_ms={"1,32": 1.0, "2,32": 2.0}))


def summary_of(path: str, *extra: str):
    result = runner.invoke(app, ["bench", "--summarize", path, "--format", "json", *extra])
    assert result.exit_code == 0, result.stderr
    return {(r["category"], r["drafter"]): r for r in json.loads(result.stdout)["rows"]}, result.stderr


def test_summarize_without_profile_uses_the_default_profiles_cached_ratio(cache):
    cache_demo_ratio()
    rows, stderr = summary_of(write_records(cache / "demo.jsonl", made_with(DEMO_PAIR)))
    m, mt = rows[("all", "m")], rows[("all", "mt")]
    assert m["expected_speedup"] == pytest.approx(m["block_efficiency"] / (3 * 0.1 + 1))
    assert mt["expected_speedup"] == pytest.approx(mt["block_efficiency"] / (3 * 0.2 + 1))  # two rows: B = 2
    assert rows[("all", "ar")]["expected_speedup"] is None
    assert "Eq. (1) not shown" not in stderr  # only the line saying which ratio each drafter used
    assert stderr.splitlines()[-1] == ("Eq. (1) latency ratio c = draft step / verification, per drafter: m 0.100 "
                                       "(draft model step T_q, B=1); mt 0.200 (draft model step T_q, B=2)")


def test_records_of_other_models_get_no_eq1_and_a_line_that_says_why(cache, files):
    cache_demo_ratio()
    other = ("llava-hf/llava-1.5-7b-hf", "mjbooo/lvlm68m")
    rows, stderr = summary_of(write_records(cache / "other.jsonl", made_with(other)))
    assert all(r["expected_speedup"] is None for r in rows.values())
    assert stderr.splitlines()[-1] == ("Eq. (1) not shown: the records were made with target "
                                       "llava-hf/llava-1.5-7b-hf and draft mjbooo/lvlm68m, not profile demo's "
                                       "models; pass --profile with theirs")
    table = runner.invoke(app, ["bench", "--summarize", str(cache / "other.jsonl")])
    assert table.exit_code == 0 and table.stdout.splitlines()[-1].startswith("Eq. (1) not shown: the records")
    long_name = "/models/" + "x" * 200 + "/target"
    _, stderr = summary_of(write_records(cache / "long.jsonl", made_with((long_name, "d"))))
    assert f"target {long_name[:29]}...{long_name[-28:]} and draft d," in stderr  # 60 characters


def test_no_cached_ratio_says_which_command_measures_it(cache, files, tiny_dirs):
    path = write_records(cache / "tiny.jsonl", made_with((tiny_dirs["target"], tiny_dirs["perturbed"])))
    rows, stderr = summary_of(path, "--profile", files["profile"])
    assert all(r["expected_speedup"] is None for r in rows.values())
    device = latency.device_name(resolve_device("cpu"))
    assert stderr.splitlines()[-1] == (f"Eq. (1) not shown: no latency ratio is cached for this device ({device}) "
                                       f"and profile {files['profile']}'s models; run `mmspec profile-latency "
                                       f"--profile {files['profile']}`")


def test_a_drafter_with_records_of_other_models_gets_no_ratio(cache):
    cache_demo_ratio()
    other = ("llava-hf/llava-1.5-7b-hf", "mjbooo/lvlm68m")
    mixed = made_with(DEMO_PAIR) + [dict(r, id=f"other-{r['id']}") for r in made_with(other, ("mt",))]
    rows, stderr = summary_of(write_records(cache / "mixed.jsonl", mixed), "--profile", "demo")
    assert rows[("all", "m")]["expected_speedup"] is not None and rows[("all", "mt")]["expected_speedup"] is None
    assert stderr.splitlines()[-1] == ("Eq. (1) not shown for mt: some of their records were made with other models "
                                       "than profile demo's; summarise those with their own --profile")


def test_ar_alone_needs_no_eq1_line(cache):
    rows, stderr = summary_of(write_records(cache / "ar.jsonl", made_with(DEMO_PAIR, ("ar",))))
    assert "Eq. (1)" not in stderr


# --------------------------------------------------------------------------- 5. plurals


def test_counts_have_the_right_plural():
    assert [counted(n, "record") for n in (0, 1, 2)] == ["0 records", "1 record", "2 records"]
    records = made_with(DEMO_PAIR, ("ar", "m"))[:2]  # one sample: ar and m
    records[1] = dict(records[1], token_ids=[6] * 6)
    line = check_line(summarize(records))
    assert "1 turn compared, 1 mismatch (first: s0 turn 0 m)" in line
    failed = summarize([records[0], {"id": "s1", "category": "c", "drafter": "m", "error": "boom"}])
    assert failure_line(failed) == "1 (sample, drafter) pair failed; first: s1 m: boom"


def test_a_changed_history_names_its_turns_in_the_right_number(files, tmp_path, tiny_dirs, no_model_loading):
    out = tmp_path / "history.jsonl"
    record = made_with((tiny_dirs["target"], tiny_dirs["perturbed"]), ("ar",))[0]
    write_records(out, [dict(record, history_turns=1, max_new_tokens=6)])
    result = bench(files, files["small"], "--drafters", "ar", "--out", str(out), "--resume")
    assert_one_line_error(result, "made after 1 given history turn, but this run gives 0")
