"""Issue 13, the CLI layer: closed streams, late failures that cost finished work, flag errors, devices, the hub.

Each test runs the real command (typer's CliRunner, or a subprocess where the process' own
streams matter) on the tiny float64 models of ``conftest.py``.
"""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from functools import partial
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from mmspec_cli import api
from mmspec_cli.cli.app import app
from mmspec_cli.errors import ModelLoadError
from mmspec_cli.models import loading
from mmspec_cli.models.loading import load_model
from mmspec_cli.models.profiles import ModelSpec

from tests import helpers
from tests.helpers import save_images, tiny_files, write_profile

# these commands may print their results before the error line, and nothing here shows loading bars
assert_one_line_error = partial(helpers.assert_one_line_error, stdout_allowed=True, loading_bars=False)

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "what is in the image?"
SMALL_GRID = ["--batch", "1", "--seq", "8", "--repeat", "1"]
runner = CliRunner()


@pytest.fixture(scope="module")
def files(tiny_dirs, tmp_path_factory) -> dict:
    return tiny_files(tmp_path_factory.mktemp("hardening"), tiny_dirs, images=1, max_new_tokens=4)


# --------------------------------------------------------------------------- 1. a closed stdout


def mmspec_with_stdout_closed(*args: str) -> subprocess.CompletedProcess:
    """``mmspec ARGS >&-`` through the console entry point, with this worktree's code."""
    command = " ".join(["exec", sys.executable, "-c", "'from mmspec_cli.cli.app import main; main()'",
                        *(f"'{a}'" for a in args), ">&-"])
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(["sh", "-c", command], capture_output=False, stderr=subprocess.PIPE, text=True, env=env,
                          timeout=300)


def test_generate_with_stdout_closed_runs_to_the_end(files):
    done = mmspec_with_stdout_closed("generate", *files["images"], "-q", QUESTION, "--profile", files["profile"])
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "isatty" not in done.stderr
    assert "new tokens" in done.stderr  # the summary line still reaches stderr


def test_bench_summarize_with_stdout_closed_exits_with_its_own_code(tmp_path):
    records = tmp_path / "r.jsonl"
    records.write_text(json.dumps({"id": "a", "category": "x", "drafter": "m", "error": "boom"}) + "\n")
    done = mmspec_with_stdout_closed("bench", "--summarize", str(records))
    assert done.returncode == 1, done.stderr  # a failed sample, as with stdout open
    assert "Traceback" not in done.stderr and "NoneType" not in done.stderr


def test_is_terminal_is_false_for_missing_or_closed_streams(tmp_path):
    from mmspec_cli.cli.display import is_terminal

    closed = open(tmp_path / "f", "w")
    closed.close()
    assert not is_terminal(None) and not is_terminal(closed) and not is_terminal(object())


# --------------------------------------------------------------------------- 2. an unwritable latency cache


@pytest.mark.parametrize("cache", ["file", "/proc/mmspec-cache"])
def test_results_are_printed_when_the_cache_cannot_be_written(files, tmp_path, monkeypatch, cache):
    if cache == "file":
        cache = tmp_path / "a-file"
        cache.write_text("not a folder")
    monkeypatch.setenv("MMSPEC_CACHE", str(cache))
    result = runner.invoke(app, ["profile-latency", "--profile", files["profile"], *SMALL_GRID, "--gammas", "1"])
    assert_one_line_error(result, "could not be cached for bench")
    assert "set MMSPEC_CACHE to a writable folder" in result.stderr
    assert "Remark 1" in result.stdout and "Latency ratio" in result.stdout and "saved to" not in result.stdout


def test_json_results_are_printed_with_no_cache_when_it_cannot_be_written(files, tmp_path, monkeypatch):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path / "a-file"))
    result = runner.invoke(app, ["profile-latency", "--profile", files["profile"], *SMALL_GRID, "--gammas", "1",
                                 "--json"])
    assert_one_line_error(result, "could not be cached")
    data = json.loads(result.stdout)
    assert data["cache"] is None and set(data["target_ms"]) == {"8,1"}


# --------------------------------------------------------------------------- 3. --plot, checked before measuring


def test_plot_into_a_folder_is_refused_before_measuring(files, tmp_path, no_model_loading):
    result = runner.invoke(app, ["profile-latency", "--profile", files["profile"], "--plot", str(tmp_path)])
    assert_one_line_error(result, "is a folder; name a file in it")
    assert not Path(f"{tmp_path}.png").exists()


@pytest.mark.parametrize("where, fragment", [
    ("missing/c.png", "doesn't exist; create it or pick another path"),
    ("/proc/c.png", "can't be written"),
])
def test_plot_to_an_unwritable_path_is_refused_before_measuring(files, tmp_path, no_model_loading, where, fragment):
    path = tmp_path / where if not where.startswith("/") else Path(where)
    result = runner.invoke(app, ["profile-latency", "--profile", files["profile"], "--plot", str(path)])
    assert_one_line_error(result, fragment)


@pytest.mark.parametrize("name, fragment", [
    ("c.xyz", "matplotlib can't write '.xyz' files; end the name with one of"),
    ("curves", "matplotlib needs a suffix naming the format"),
])
def test_plot_format_is_checked_before_measuring(files, tmp_path, no_model_loading, name, fragment):
    pytest.importorskip("matplotlib")
    result = runner.invoke(app, ["profile-latency", "--profile", files["profile"], "--plot", str(tmp_path / name)])
    line = assert_one_line_error(result, fragment)
    assert ".png" in line and ".pdf" in line
    assert list(tmp_path.iterdir()) == []  # the writability check left nothing behind


# --------------------------------------------------------------------------- 4. select-layer --write


def test_select_layer_refuses_an_unwritable_write_path_before_calibrating(files, no_model_loading):
    result = runner.invoke(app, ["select-layer", *files["images"], "-q", QUESTION, "--profile", files["profile"],
                                 "--write", "/proc/x.yaml"])
    assert_one_line_error(result, "--write '/proc/x.yaml' can't be written")


def test_the_write_check_leaves_no_file_behind(files, tmp_path, no_model_loading):
    target = tmp_path / "ssd.yaml"
    result = runner.invoke(app, ["select-layer", "--profile", files["profile"], "--write", str(target)])
    assert_one_line_error(result, "pass one calibration SOURCE")  # refused after the --write check
    assert not target.exists()


# --------------------------------------------------------------------------- 5. flags


@pytest.mark.parametrize("args, expected", [
    (["generate", "--gamma", "five"], "error: --gamma: 'five' is not a valid integer; see `mmspec generate --help`"),
    (["compare", "--temperature", "warm"], "error: --temperature: 'warm' is not a valid number"),
    (["profile-latency", "--repeat", "x" * 300], "error: --repeat: 'xxxxxxxx"),
    (["generate", "--no-such-flag"], "error: No such option: --no-such-flag"),
    (["no-such-command"], "error: No such command 'no-such-command'"),
])
def test_type_and_usage_errors_are_one_line(args, expected):
    line = assert_one_line_error(runner.invoke(app, args), "")
    assert line.startswith(expected) and len(line) < 160  # a long bad value is quoted cut short


@pytest.mark.parametrize("command", [[], ["generate"], ["compare"], ["bench"], ["profile-latency"],
                                     ["select-layer"]])
def test_flags_show_no_metavar_in_help(command):
    result = runner.invoke(app, [*command, "--help"])
    assert result.exit_code == 0 and "--help" in result.stdout
    assert "<bool>" not in result.stdout


def without_busy_warning(stderr: str) -> list[str]:
    """stderr's lines but profile-latency's warning that the machine is busy (it is, when tests run in parallel)."""
    return [line for line in stderr.splitlines() if not line.startswith("warning: the load average")]


def test_profile_latency_takes_gammas_and_hides_the_old_name(files, tmp_path, monkeypatch):
    help_text = runner.invoke(app, ["profile-latency", "--help"]).stdout
    assert "--gammas" in help_text and "--gamma " not in help_text
    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path))
    result = runner.invoke(app, ["profile-latency", "--profile", files["profile"], *SMALL_GRID, "--gammas", "1,2",
                                 "--json"])
    assert result.exit_code == 0 and not without_busy_warning(result.stderr), result.stderr
    assert set(json.loads(result.stdout)["target_ms"]) == {"8,1", "8,2"}


def test_profile_latency_gamma_still_works_with_a_note(files, tmp_path, monkeypatch):
    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path))
    result = runner.invoke(app, ["profile-latency", "--profile", files["profile"], *SMALL_GRID, "--gamma", "1,2",
                                 "--json"])
    assert result.exit_code == 0, result.stderr
    assert set(json.loads(result.stdout)["target_ms"]) == {"8,1", "8,2"}
    [note] = without_busy_warning(result.stderr)
    assert note.startswith("note: ") and "--gamma is deprecated" in note and "--gammas" in note


def test_profile_latency_refuses_both_gamma_names(files, no_model_loading):
    result = runner.invoke(app, ["profile-latency", "--profile", files["profile"], "--gammas", "2", "--gamma", "3"])
    assert_one_line_error(result, "pass the γ values once, with --gammas")


# --------------------------------------------------------------------------- 6. devices this machine lacks


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_a_cuda_device_without_cuda_is_one_line_naming_the_entry(files, tiny_dirs, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    profile = tmp_path / "gpu.yaml"
    profile.write_text(yaml.safe_dump({"target": {"model": tiny_dirs["target"], "dtype": "float64", "device": "cpu"},
                                       "draft": {"model": tiny_dirs["perturbed"], "dtype": "float64",
                                                 "device": "cuda:7"}}))
    result = runner.invoke(app, ["generate", *files["images"], "-q", QUESTION, "--profile", str(profile)])
    assert_one_line_error(result, "draft.device: cuda:7 does not exist on this machine (devices here: cpu)")


def test_a_gpu_beyond_the_count_names_the_devices_there_are(tiny_dirs, two_gpus):
    with pytest.raises(ModelLoadError, match=r"captioner.device: cuda:7 .*devices here: cpu, cuda:0, cuda:1\)"):
        load_model(ModelSpec(model=tiny_dirs["target"], dtype="float64", device="cuda:7"), "captioner")
    loading.check_device("cuda:1", "target")  # exists here
    loading.check_device("cuda", "target")


def test_cuda_without_any_gpu_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ModelLoadError, match="target.device: cuda does not exist"):
        loading.check_device("cuda", "target")


# --------------------------------------------------------------------------- 7. the hub without network


@pytest.fixture
def online_mode(monkeypatch):
    """Neither HF_HUB_OFFLINE nor TRANSFORMERS_OFFLINE: the hub is tried (and, on this machine, unreachable)."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)


def hub_answers() -> bool:
    """Whether huggingface.co answers here at all (not on the machine this project is developed on)."""
    try:
        urllib.request.urlopen(urllib.request.Request("https://huggingface.co", method="HEAD"), timeout=3).close()
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False
    return True


def test_an_unreachable_hub_id_is_refused_at_once_in_one_line(files, tiny_dirs, tmp_path, online_mode, monkeypatch):
    if hub_answers():
        pytest.skip("the hub answers here")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    profile = write_profile(tmp_path / "hub.yaml", "nobody-here/no-such-model", tiny_dirs["perturbed"])
    start = time.monotonic()
    result = runner.invoke(app, ["generate", *files["images"], "-q", QUESTION, "--profile", profile])
    assert time.monotonic() - start < 5
    line = assert_one_line_error(result, "target.model: 'nobody-here/no-such-model' is not in the local Hugging Face")
    assert "can't be reached" in line and "hf download" in line and "pass a local path" in line


def test_offline_mode_refuses_an_uncached_hub_id_saying_so(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(loading, "hub_reachable", lambda: pytest.fail("probed the hub in offline mode"))
    with pytest.raises(ModelLoadError, match=r"HF_HUB_OFFLINE \(or TRANSFORMERS_OFFLINE\) is set"):
        load_model(ModelSpec(model="nobody-here/no-such-model", device="cpu"), "draft")


def hub_cache_with(model_dir: str, repo: str, root: Path) -> Path:
    """A Hugging Face cache holding ``model_dir``'s files as the snapshot of ``repo`` at main."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    entry = root / f"models--{repo.replace('/', '--')}"
    snapshot = entry / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for file in Path(model_dir).iterdir():
        (snapshot / file.name).write_bytes(file.read_bytes())
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text(commit)
    return root


@pytest.mark.parametrize("offline", [False, True])
def test_a_cached_hub_model_loads_without_network(tiny_dirs, tmp_path, online_mode, monkeypatch, capfd, offline):
    import huggingface_hub.constants

    cache = hub_cache_with(tiny_dirs["target"], "mmspec-test/tiny-target", tmp_path / "hub")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    loaded = load_model(ModelSpec(model="mmspec-test/tiny-target", dtype="float64", device="cpu"), "target")
    assert time.monotonic() - start < 5
    assert type(loaded.model).__name__ == "LlavaForConditionalGeneration" and loaded.image_token_id == 4
    assert "Retrying" not in capfd.readouterr().err


class _NotFound(http.server.BaseHTTPRequestHandler):
    def do_HEAD(self):  # noqa: N802 (the http.server name)
        self.send_response(404)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_the_probe_counts_any_answer_and_fails_fast_without_one(monkeypatch):
    import huggingface_hub.constants

    server = http.server.HTTPServer(("127.0.0.1", 0), _NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{server.server_port}")
        assert loading.hub_reachable()
    finally:
        server.shutdown()
        server.server_close()
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    start = time.monotonic()
    assert not loading.hub_reachable()  # nothing listens there now: refused
    assert time.monotonic() - start < 2


def test_compare_counts_one_drafter_in_the_singular(tiny_dirs, tmp_path):
    profile = write_profile(tmp_path / "p.yaml", tiny_dirs["target"], tiny_dirs["perturbed"], max_new_tokens=3)
    [image] = save_images(tmp_path, 1)
    result = runner.invoke(app, ["compare", image, "-q", "what?", "--drafters", "ar", "--profile", profile])
    assert result.exit_code == 0, result.stderr
    assert result.stdout.splitlines()[0].endswith(", 1 drafter")
