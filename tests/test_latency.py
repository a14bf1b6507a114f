"""profile-latency: timing grid, TABED Remarks 1-3 on synthetic timings, the cache, and the CLI."""

from __future__ import annotations

import json
import os
from pathlib import Path
from functools import partial

import pytest
import torch
import yaml
from typer.testing import CliRunner

from mmspec_cli.bench import latency
from mmspec_cli.cli.app import app
from mmspec_cli.cli.profile_latency import check_tau
from mmspec_cli.decoding.metrics import expected_speedup
from mmspec_cli.errors import InputError
from mmspec_cli.models.loading import resolve_device
from mmspec_cli.models.profiles import load_profile
from tests import helpers
from tests.helpers import tiny_files, write_profile

# these commands may print their results before the error line, and nothing here shows loading bars
assert_one_line_error = partial(helpers.assert_one_line_error, stdout_allowed=True, loading_bars=False)


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


def test_sizes_are_timed_side_by_side_so_a_slowing_machine_reaches_them_alike(monkeypatch):
    """Each size is warmed up, then every repeat times each once, in turn, the order reversed every other round (a
    reset before every call). On a machine that slows down as it goes, sizes timed one after the other would carry
    the slowdown into their ratio; side by side their ratio holds."""
    clock = {"now": 0.0, "calls": []}

    def run(size: str):
        def call():
            clock["calls"].append(size)
            clock["now"] += {"small": 1.0, "large": 2.0}[size] * (1 + 0.1 * len(clock["calls"]))  # slower and slower
        return call

    timer = latency.Timer("cpu", warmup=1, repeat=4)
    monkeypatch.setattr(timer, "_time", lambda call: -clock["now"] + (call() or clock["now"]))
    resets = []
    medians = timer.medians_ms({"small": run("small"), "large": run("large")}, reset=lambda: resets.append(1))
    assert clock["calls"] == ["small", "large"] + ["small", "large", "large", "small"] * 2
    assert len(resets) == len(clock["calls"])
    assert abs(medians["large"] / medians["small"] - 2.0) < 0.05
    clock["calls"].clear()
    apart = {size: timer.median_ms(run(size)) for size in ("small", "large")}  # one size after the other
    assert clock["calls"] == ["small"] * 5 + ["large"] * 5
    assert apart["large"] / apart["small"] > 2.5  # the slowdown is read as the larger size's cost


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
    # each table's title on a line of its own, whole however narrow the table (rich wraps a title to its table)
    assert "Latency ratio c = one draft step / T_p(1, S=8, γ) (c: T_q(B=1, S=8, 1)) and Eq. (1) τ/(γc+1)" in \
        result.stdout.splitlines()


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
    one = tmp_path / "eagle.yaml"  # compiled: one head (vispec's chain is the same class's)
    one.write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()), "head": heads[:1]}))
    compiled = CliRunner().invoke(app, ["profile-latency", "--profile", str(one), "--seq", "16", "--gammas", "3",
                                        "--repeat", "1", "--compile"])
    assert compiled.exit_code == 0, compiled.output
    assert "eagle head γ=2" in compiled.stdout  # the head's greedy chain of γ = 3 − 1, one compiled graph
    cached = json.loads(next((tmp_path / "cache" / "latency").glob("*__compiled.json")).read_text())
    assert cached["head_chain_ms"].keys() == {"eagle"} and cached["head_chain_ms"]["eagle"].keys() == {"16,2"}


SMALL_GRID = ["--batch", "1", "--seq", "8", "--repeat", "1"]
runner = CliRunner()


@pytest.fixture(scope="module")
def files(tiny_dirs, tmp_path_factory) -> dict:
    return tiny_files(tmp_path_factory.mktemp("latency"), tiny_dirs, images=1, max_new_tokens=4)


# --------------------------------------------------------------------------- an unwritable latency cache


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


# --------------------------------------------------------------------------- --plot, checked before measuring


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


# --------------------------------------------------------------------------- the γ flag


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


# --------------------------------------------------------------------------- ssd's own step in Eq. (1)


def saved_imitation(tiny_models, folder: Path) -> str:
    from mmspec_cli.models.imitation import save_imitation
    from tests.test_imitation import hidden_size, random_imitation

    target = tiny_models["target"]
    save_imitation(random_imitation(hidden_size(target)), folder, layer=1, target=target, target_name="tiny",
                   dtype=torch.float32)
    return str(folder)


def test_profile_latency_times_ssd_with_and_without_its_imitation_network(cache, tiny_dirs, tiny_models, monkeypatch):
    """T_s is timed through the ssd drafter's own code: the early exit with the network for ssd, without for
    ssd:plain; the ratio and Eq. (1) of each use it, not the draft model's T_q."""
    from mmspec_cli.drafters import ssd as ssd_module

    imitation = saved_imitation(tiny_models, cache / "in1")
    spec = {"dtype": "float32", "device": "cpu"}
    path = cache / "p.yaml"
    path.write_text(yaml.safe_dump({"target": {"model": tiny_dirs["target"], **spec},
                                    "draft": {"model": tiny_dirs["perturbed"], **spec},
                                    "ssd": {"layer": 1, "imitation": imitation}}))
    results = cache / "results.jsonl"
    results.write_text("".join(json.dumps({"drafter": d, "block_efficiency": t}) + "\n"
                               for d, t in (("m", 2.0), ("ssd", 3.0), ("ssd:plain", 2.5))))
    built, steps = [], []
    original_decoder, original_logits = ssd_module.early_exit_decoder, ssd_module.early_exit_logits
    monkeypatch.setattr(ssd_module, "early_exit_decoder",
                        lambda model, layers, imitation=None: built.append((layers, imitation)) or
                        original_decoder(model, layers, imitation))
    monkeypatch.setattr(ssd_module, "early_exit_logits",
                        lambda *args, **kwargs: steps.append(1) or original_logits(*args, **kwargs))
    result = runner.invoke(app, ["profile-latency", "--profile", str(path), "--batch", "1", "--seq", "16,32",
                                 "--gammas", "1,5", "--repeat", "2", "--results", str(results), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert set(data["ssd_ms"]) == {"ssd", "ssd:plain"} and set(data["ssd_ms"]["ssd"]) == {"16", "32"}
    assert [layers for layers, _ in built] == [1] * 4  # plain at S=16, 32, then with the network at S=16, 32
    assert [n is None for _, n in built] == [True, True, False, False]
    assert len(steps) == 4 * (2 + 2)  # warm-up + repeats at each point, all through early_exit_logits
    assert data["ssd"]["layer"] == 1 and data["ssd"]["imitation"] == imitation
    assert data["ssd"]["imitation_weights"] == latency.weights_fingerprint(imitation)
    for name in ("ssd", "ssd:plain"):
        c = data["ssd_latency_ratio"][name]["5"]
        assert c == pytest.approx(data["ssd_ms"][name]["16"] / data["target_ms"]["16,5"])
        tau = {"ssd": 3.0, "ssd:plain": 2.5}[name]
        assert data["expected_speedup"][name]["5"] == pytest.approx(tau / (5 * c + 1))
    c_draft = data["latency_ratio"]["5"]
    assert data["expected_speedup"]["m"]["5"] == pytest.approx(2.0 / (5 * c_draft + 1))
    cached = latency.LatencyResult(**json.loads(Path(data["cache"]).read_text()))
    assert cached.ssd_ms == data["ssd_ms"] and cached.ssd == data["ssd"]
    table = runner.invoke(app, ["profile-latency", "--profile", str(path), "--batch", "1", "--seq", "16",
                                "--gammas", "1", "--repeat", "1"])
    assert table.exit_code == 0, table.output
    assert "T_s(S) ms" in table.stdout and "c ssd:plain" in table.stdout


def test_profile_latency_takes_a_profile_with_only_an_ssd_layer(cache, tiny_dirs):
    path = cache / "ssd.yaml"
    path.write_text(yaml.safe_dump({"target": {"model": tiny_dirs["target"], "dtype": "float32", "device": "cpu"},
                                    "ssd": {"layer": 1}}))
    result = runner.invoke(app, ["profile-latency", "--profile", str(path), "--seq", "16", "--gammas", "1",
                                 "--repeat", "1", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["draft_ms"] == {} and data["ssd_ms"]["ssd"] == data["ssd_ms"]["ssd:plain"]  # one step: no network
    assert data["ssd"] == {"layer": 1, "imitation": None, "imitation_weights": None}
    wrong = runner.invoke(app, ["profile-latency", "--profile", str(path), "--ssd-layer", "2", "--seq", "16",
                                "--repeat", "1"])
    assert_one_line_error(wrong, "ssd.layer 2 is outside [1, 1]")


PAIR = ("org/target", "org/draft")


def summary_profile(root: Path, **ssd) -> str:
    path = root / "pair.yaml"
    path.write_text(yaml.safe_dump({"target": {"model": PAIR[0], "device": "cpu"},
                                    "draft": {"model": PAIR[1], "device": "cpu"},
                                    "ssd": ssd or {"layer": 1}}))
    return str(path)


def made_records(drafters=("ar", "m", "ssd", "ssd:plain"), threads: int | None = 1, layer: int = 1,
                 imitation: str | None = None) -> list[dict]:
    """Hand-made turn records of two samples, made with ``PAIR``, as ``bench`` writes them."""
    ensemble = json.dumps({"ssd": {"layer": layer, "imitation": imitation}}, sort_keys=True)
    out = []
    for i, sample in enumerate(("s0", "s1")):
        for drafter in drafters:
            blocks = 6 if drafter == "ar" else 2 + i
            out.append({"id": sample, "category": "c", "turn": 0, "drafter": drafter, "token_ids": [5] * 6,
                        "new_tokens": 6, "blocks": blocks, "wall_s": 0.1 * blocks, "drafted": 9,
                        "accepted": 6 - blocks, "prompt_tokens": 32, "gamma": 3, "temperature": 0.0,
                        "target": PAIR[0], "draft": PAIR[1], "ensemble": ensemble, "threads": threads})
    return out


def cache_pair(threads: int = 1, ssd: dict | None = None, imitation: str | None = None) -> None:
    """T_p = 10 ms, T_q = 1 ms (c 0.1); ssd 3 ms (c 0.3), ssd:plain 2 ms (c 0.2) at layer 1, under ``threads``."""
    setting = {"layer": 1, "imitation": imitation,
               "imitation_weights": latency.weights_fingerprint(imitation) if imitation else None}
    latency.save(latency.LatencyResult(latency.device_name(resolve_device("cpu"), threads), *PAIR,
                                       target_ms={"32,3": 10.0}, draft_ms={"1,32": 1.0},
                                       ssd_ms={"ssd": {"32": 3.0}, "ssd:plain": {"32": 2.0}} if ssd is None else ssd,
                                       ssd=setting))


def summarize(path: Path, profile: str, *extra: str) -> tuple[dict, dict, str]:
    result = runner.invoke(app, ["bench", "--summarize", str(path), "--profile", profile, "--format", "json", *extra])
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    return {r["drafter"]: r for r in data["rows"] if r["category"] == "all"}, data, result.stderr


def write_records(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_bench_eq1_of_ssd_uses_ssds_own_step_and_says_which(cache):
    cache_pair()
    rows, data, stderr = summarize(write_records(cache / "r.jsonl", made_records()), summary_profile(cache))
    for name, c in (("m", 0.1), ("ssd", 0.3), ("ssd:plain", 0.2)):
        assert rows[name]["latency_ratio"] == pytest.approx(c)
        assert rows[name]["expected_speedup"] == pytest.approx(rows[name]["block_efficiency"] / (3 * c + 1))
    assert rows["ar"]["expected_speedup"] is None and rows["ar"]["latency_ratio"] is None
    assert data["latency_ratios"]["ssd:plain"]["step"] == "ssd's own step T_s: the target's first 1 layer"
    assert data["latency_ratios"]["m"]["step"] == "draft model step T_q, B=1"
    assert ("Eq. (1) latency ratio c = draft step / verification, per drafter: m 0.100 (draft model step T_q, B=1); "
            "ssd 0.300 (ssd's own step T_s: the target's first 1 layer); ssd:plain 0.200") in stderr


def test_a_cache_without_ssds_step_gives_ssd_no_eq1_and_says_what_to_run(cache):
    cache_pair(ssd={})  # measured before ssd's step was timed: only T_p and T_q
    profile = summary_profile(cache)
    rows, _, stderr = summarize(write_records(cache / "r.jsonl", made_records()), profile)
    assert rows["m"]["expected_speedup"] is not None
    assert rows["ssd"]["expected_speedup"] is None and rows["ssd:plain"]["expected_speedup"] is None
    assert stderr.splitlines()[-1] == (f"Eq. (1) not shown for ssd (at ssd.layer 1), ssd:plain (at ssd.layer 1): the "
                                       f"cached latencies have no draft step of theirs; run `mmspec profile-latency "
                                       f"--profile {profile} --threads 1`")


def test_ssd_records_of_another_layer_or_imitation_network_get_no_ratio(cache, tiny_models):
    imitation = saved_imitation(tiny_models, cache / "in1")
    cache_pair(imitation=imitation)
    profile = summary_profile(cache, layer=1, imitation=imitation)
    rows, _, stderr = summarize(write_records(cache / "l2.jsonl", made_records(layer=2, imitation=imitation)), profile)
    assert rows["ssd"]["expected_speedup"] is None and rows["ssd:plain"]["expected_speedup"] is None
    assert stderr.splitlines()[-1].endswith(f"run `mmspec profile-latency --profile {profile} --threads 1 "
                                            f"--ssd-layer 2`")
    same = write_records(cache / "l1.jsonl", made_records(imitation=imitation))
    rows, _, _ = summarize(same, profile)
    assert rows["ssd"]["latency_ratio"] == pytest.approx(0.3)
    weights = Path(imitation) / "model.safetensors"
    weights.write_bytes(weights.read_bytes())  # the network rewritten (retrained) since it was timed
    os.utime(weights, ns=(1, 1))
    rows, _, stderr = summarize(same, profile)
    assert rows["ssd"]["expected_speedup"] is None and rows["ssd:plain"]["latency_ratio"] == pytest.approx(0.2)
    assert "Eq. (1) not shown for ssd (at ssd.layer 1 and imitation network" in stderr


# --------------------------------------------------------------------------- --summarize and thread counts


def test_summarize_looks_the_cache_up_under_the_records_thread_count(cache):
    cache_pair(threads=1)
    profile = summary_profile(cache)
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the summarising process uses another count than the records were made with
    try:
        rows, _, stderr = summarize(write_records(cache / "r.jsonl", made_records(threads=1)), profile)
        assert rows["m"]["latency_ratio"] == pytest.approx(0.1) and "Eq. (1) not shown" not in stderr
        _, _, stderr = summarize(write_records(cache / "r3.jsonl", made_records(threads=3)), profile)
    finally:
        torch.set_num_threads(before)
    device = latency.device_name(resolve_device("cpu"), 3)
    assert device.endswith("-3threads")
    assert stderr.splitlines()[-1] == (f"Eq. (1) not shown: no latency ratio is cached for this device ({device}) and "
                                       f"profile {profile}'s models; run `mmspec profile-latency --profile {profile} "
                                       f"--threads 3`")


def test_records_of_several_thread_counts_are_not_given_one_ratio(cache):
    cache_pair(threads=1)
    mixed = made_records(("ar", "m"), threads=1)
    mixed[-1] = dict(mixed[-1], threads=2)  # one sample of m made with 2 threads
    rows, _, stderr = summarize(write_records(cache / "r.jsonl", mixed), summary_profile(cache))
    assert rows["m"]["expected_speedup"] is None
    assert "Eq. (1) not shown for m: their records were made with different CPU thread counts" in stderr
