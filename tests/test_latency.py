"""profile-latency: timing grid, TABED Remarks 1-3 on synthetic timings, the cache, and the CLI."""

from __future__ import annotations

import json
import os

import pytest
import yaml
from typer.testing import CliRunner

from mmspec_cli.bench import latency
from mmspec_cli.cli.app import app
from mmspec_cli.cli.profile_latency import check_tau
from mmspec_cli.decoding.metrics import expected_speedup
from mmspec_cli.errors import InputError
from tests.helpers import assert_one_line_error


def synthetic(target_ms, draft_ms):
    return latency.LatencyResult("dev", "t", "d", target_ms, draft_ms)


def test_remarks_hold_for_flat_timings_and_fail_for_growing_ones():
    flat = synthetic({"512,1": 10.0, "512,5": 10.3, "1024,1": 10.1, "1024,5": 10.4},
                     {"1,512": 1.0, "1,1024": 1.02, "4,512": 1.03, "4,1024": 1.04})
    assert [r.holds for r in latency.check_remarks(flat)] == [True, True, True]
    growing = synthetic({"512,1": 10.0, "512,5": 12.0, "1024,1": 10.0, "1024,5": 10.2},
                        {"1,512": 1.0, "1,1024": 1.3, "4,512": 1.0, "4,1024": 1.3})
    r1, r2, r3 = latency.check_remarks(growing)
    assert (r1.holds, r2.holds, r3.holds) == (False, False, True)
    assert r1.worst == pytest.approx(0.2) and r2.worst == pytest.approx(0.3)


def test_latency_ratio_uses_the_nearest_grid_point():
    result = synthetic({"512,1": 10.0, "512,5": 20.0, "2048,5": 40.0, "2048,1": 30.0},
                       {"1,512": 1.0, "4,512": 2.0, "1,2048": 3.0, "4,2048": 4.0})
    assert result.ratio(batch=1, seq=500, gamma=5) == pytest.approx(1.0 / 20.0)
    assert result.ratio(batch=3, seq=3000, gamma=1) == pytest.approx(4.0 / 30.0)
    assert expected_speedup(2.29, 5, 0.063) == pytest.approx(1.74, abs=0.005)  # TABED App. G.1's worked example


def test_results_are_cached_per_device_and_model_pair(tmp_path, monkeypatch):
    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path))
    result = synthetic({"8,1": 1.0}, {"1,8": 0.5})
    path = latency.save(result)
    assert path.parent == tmp_path / "latency"
    assert latency.load("dev", "t", "d") == result
    assert latency.load("other-gpu", "t", "d") is None


def test_retrained_weights_under_the_same_name_are_not_given_the_old_ratio(tmp_path, monkeypatch):
    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "my-target"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"first weights")
    result = latency.LatencyResult("dev", str(model), "d", {"8,1": 1.0}, {"1,8": 0.5})
    latency.save(result)
    assert latency.load("dev", str(model), "d") == result
    (model / "model.safetensors").write_bytes(b"other weights")  # retrained: same architecture, same size
    os.utime(model / "model.safetensors", ns=(1, 1))  # a different time even on a coarse clock
    assert latency.load("dev", str(model), "d") is None
    assert latency.weights_fingerprint("mmspec:demo-target")  # the shipped models are told apart too


def test_a_hub_model_is_keyed_by_its_pinned_revision(tmp_path, monkeypatch):
    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path / "cache"))
    assert latency.weights_fingerprint("no-such/model-anywhere") == ""  # not in the local hub cache
    assert latency.weights_fingerprint("no-such/model-anywhere", "v2") == "revision v2"
    result = latency.LatencyResult("dev", "org/target", "org/draft", {"8,1": 1.0}, {"1,8": 0.5}, "v1", None)
    latency.save(result)
    assert latency.load("dev", "org/target", "org/draft", "v1") == result
    assert latency.load("dev", "org/target", "org/draft", "v2") is None
    assert latency.load("dev", "org/target", "org/draft") is None


@pytest.fixture
def profile_file(tmp_path, tiny_dirs):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump({
        "target": {"model": tiny_dirs["target"], "dtype": "float32", "device": "cpu"},
        "draft": {"model": tiny_dirs["perturbed"], "dtype": "float32", "device": "cpu"},
    }))
    return path


def test_cli_measures_a_small_grid_and_caches_it(profile_file, tmp_path, monkeypatch):
    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path / "cache"))
    bench = tmp_path / "results.jsonl"
    bench.write_text("\n".join(json.dumps(r) for r in [
        {"drafter": "m", "block_efficiency": 3.0}, {"drafter": "m", "block_efficiency": 2.0},
        {"drafter": "ar", "block_efficiency": 1.0}, {"drafter": "t", "error": "boom"}]) + "\n")
    result = CliRunner().invoke(app, ["profile-latency", "--profile", str(profile_file), "--batch", "1,2",
                                      "--seq", "16,32", "--gamma", "1,3", "--repeat", "2", "--results", str(bench),
                                      "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert set(data["target_ms"]) == {"16,1", "16,3", "32,1", "32,3"}
    assert set(data["draft_ms"]) == {"1,16", "1,32", "2,16", "2,32"}
    assert all(v > 0 for v in [*data["target_ms"].values(), *data["draft_ms"].values()])
    assert [r["remark"] for r in data["remarks"]] == [1, 2, 3]
    assert data["tau"] == {"m": 2.5}
    c = data["latency_ratio"]["5"]
    assert data["expected_speedup"]["m"]["5"] == pytest.approx(2.5 / (5 * c + 1))
    cached = latency.LatencyResult(**json.loads(open(data["cache"]).read()))
    assert cached.target_ms == data["target_ms"]


def test_cli_table_output_names_the_remarks(profile_file, tmp_path, monkeypatch):
    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path))
    result = CliRunner().invoke(app, ["profile-latency", "--profile", str(profile_file), "--batch", "1",
                                      "--seq", "8", "--gamma", "1,2", "--repeat", "1", "--tau", "2.0"])
    assert result.exit_code == 0, result.output
    assert "Remark 1" in result.stdout and "Eq. (1)" in result.stdout and "saved to" in result.stdout


@pytest.mark.parametrize("args, fragment", [
    (["--batch", "1,x"], "--batch: expected a comma-separated list"),
    (["--gamma", "0"], "--gamma: expected a comma-separated list of integers >= 1"),
    (["--seq", "5000"], "takes at most 1024 positions"),
    (["--repeat", "0"], "--repeat: expected an integer >= 1"),
    (["--tau", "0.5"], "--tau: expected a block efficiency between 1 and 65"),
])
def test_bad_input_is_one_line_exit_2(profile_file, args, fragment):
    result = CliRunner().invoke(app, ["profile-latency", "--profile", str(profile_file), "--repeat", "1", *args])
    assert result.exit_code == 2
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and fragment in lines[0]


def test_tau_must_be_a_finite_block_efficiency():
    """--tau nan printed "nanx" for every speedup, --tau inf wrote `Infinity` into --json (not JSON)."""
    for tau in (1.0, 2.5, 65.0):
        check_tau(tau)
    for tau in (float("nan"), float("inf"), float("-inf"), 0.5, 65.5):
        with pytest.raises(InputError, match="--tau: expected a block efficiency between 1 and 65"):
            check_tau(tau)


@pytest.mark.parametrize("tau", ["nan", "inf"])
def test_a_non_finite_tau_is_refused_before_loading(profile_file, no_model_loading, tau):
    result = CliRunner().invoke(app, ["profile-latency", "--profile", str(profile_file), "--tau", tau, "--json"])
    assert_one_line_error(result, f"got {tau}", loading_bars=False)


def test_the_default_seq_fits_the_models_context():
    """The default grid (TABED's 512..3072) did not fit the demo's 2048 positions, so `mmspec profile-latency`
    failed at its defaults: it now keeps the lengths that fit and adds the longest one that does."""
    assert latency.default_seqs(None, 7) == [512, 1024, 2048, 3072]
    assert latency.default_seqs(4096, 7) == [512, 1024, 2048, 3072]
    assert latency.default_seqs(2048, 7) == [512, 1024, 2041]
    assert latency.default_seqs(1024, 1) == [512, 1023]
    assert latency.default_seqs(64, 7) == [57]
    assert latency.default_seqs(1031, 7) == [512, 1024]  # the longest that fits is a standard length: timed once
    with pytest.raises(InputError, match="--gammas: γ = 8 leaves no room"):
        latency.default_seqs(8, 8)
    from transformers import AutoConfig

    from mmspec_cli.models.loading import model_location
    from mmspec_cli.models.profiles import load_profile

    demo = load_profile(None)  # the default profile, which bench's summary tells users to profile
    context = min(AutoConfig.from_pretrained(model_location(spec.model)).get_text_config().max_position_embeddings
                  for spec in (demo.target, demo.draft))
    assert max(latency.default_seqs(context, 7)) + 7 <= context


def test_cli_default_seq_fits_a_tiny_target(profile_file, tmp_path, monkeypatch):
    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path))
    result = CliRunner().invoke(app, ["profile-latency", "--profile", str(profile_file), "--batch", "1",
                                      "--gammas", "1", "--repeat", "1", "--json"])
    assert result.exit_code == 0, result.output
    assert set(json.loads(result.stdout)["target_ms"]) == {"512,1", "1023,1"}  # the tiny models take 1024 positions


def test_plot_needs_matplotlib_or_draws_a_png(profile_file, tmp_path, monkeypatch):
    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path))
    png = tmp_path / "curves.png"
    result = CliRunner().invoke(app, ["profile-latency", "--profile", str(profile_file), "--batch", "1",
                                      "--seq", "8", "--gamma", "1", "--repeat", "1", "--plot", str(png), "--json"])
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert result.exit_code == 2 and "--plot needs matplotlib" in result.stderr
        assert not png.exists()
    else:
        assert result.exit_code == 0 and png.read_bytes()[:4] == b"\x89PNG"


def test_tables_off_a_terminal_ignore_a_narrow_columns(profile_file, tmp_path, monkeypatch):
    """A GPU machine's $COLUMNS of ~15 broke every line of the tables; off a terminal they are 140 wide."""
    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path))
    result = CliRunner().invoke(app, ["profile-latency", "--profile", str(profile_file), "--batch", "1",
                                      "--seq", "8", "--gammas", "1", "--repeat", "1"], env={"COLUMNS": "15"})
    assert result.exit_code == 0, result.output
    assert "Remark 2 (draft: T_q(B, S, 1) does not depend on S)" in result.stdout


def test_cli_times_draft_heads_beside_the_target(tmp_path, tiny_dirs, tiny_models, monkeypatch):
    """A profile with heads (and no draft model) gets a T_h row per head and its ratio to one verification."""
    import torch

    from mmspec_cli.models.head_files import save_head
    from tests.test_heads import random_head

    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path / "cache"))
    target = tiny_models["target"]
    heads = []
    for kind in ("eagle", "vispec"):
        save_head(random_head(target, kind), tmp_path / kind, target="tiny", dtype=torch.float32)
        heads.append({"model": str(tmp_path / kind), "kind": kind})
    path = tmp_path / "heads.yaml"
    path.write_text(yaml.safe_dump({"target": {"model": tiny_dirs["target"], "dtype": "float32", "device": "cpu"},
                                    "head": heads}))
    result = CliRunner().invoke(app, ["profile-latency", "--profile", str(path), "--seq", "16,32", "--gammas", "1,5",
                                      "--repeat", "2", "--tau", "2.0", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["draft"] == "none" and data["draft_ms"] == {} and [r["remark"] for r in data["remarks"]] == [1]
    assert set(data["head_ms"]) == {"eagle", "vispec"} and set(data["head_ms"]["vispec"]) == {"16", "32"}
    c = data["head_latency_ratio"]["vispec"]["5"]
    assert c == pytest.approx(data["head_ms"]["vispec"]["16"] / data["target_ms"]["16,5"])
    table = CliRunner().invoke(app, ["profile-latency", "--profile", str(path), "--seq", "16", "--gammas", "1",
                                     "--repeat", "1"])
    assert table.exit_code == 0, table.output
    assert "T_h(S) ms" in table.stdout and "c vispec head" in table.stdout and "T_q(B, S, 1)" not in table.stdout
