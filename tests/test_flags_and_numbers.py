"""Issue 19, part 5 ("flags and numbers that mislead") and the bench items of part 3.

- dynamic-tree flags without ``--tree dynamic`` are refused, as conflicting ``--tree``/``--tree-width`` pairs are;
- Eq. (1) of ``ssd`` and ``ssd:plain`` uses ssd's own step (T_s), timed by ``profile-latency``;
- ``bench --summarize`` looks the latency cache up under the thread count of the records;
- ``load_decoder`` / ``ModelSet.load`` apply the CLI's thread choice;
- the progress bars keep their count, elapsed time and ETA at 80 and 60 columns;
- ``--profile <(...)`` (a pipe) is read like a file;
- a failed ``bench --out NEW`` leaves no empty file behind.

Tiny float64 LLaVA models of ``conftest.py`` on CPU; the summary tests use hand-made records.
"""

from __future__ import annotations

import io
import json
import os
import re
import threading
from pathlib import Path

import pytest
import torch
import yaml
from rich.console import Console
from typer.testing import CliRunner

from mmspec_cli.bench import latency
from mmspec_cli.bench import records as records_mod
from mmspec_cli.cli.app import app
from mmspec_cli.errors import InputError, ProfileError
from mmspec_cli.models.loading import resolve_device
from mmspec_cli.models.profiles import apply_overrides, load_profile, profile_from_dict

from tests.helpers import assert_one_line_error, save_images, write_profile

runner = CliRunner()
QUESTION = "what is in the image?"


# --------------------------------------------------------------------------- 1. dynamic-tree flags


BASE = {"target": {"model": "x"}}


@pytest.mark.parametrize("decoding, overrides, fragment", [
    ({}, {"tree_budget": 10}, "--tree-budget shapes dynamic trees only, and this run drafts a chain; add --tree "
                              "dynamic, or drop it"),
    ({}, {"tree_width": 3, "tree_depth": 2}, "--tree-depth shapes dynamic trees only, and this run drafts a width "
                                             "tree; add --tree dynamic, or drop it"),
    ({"tree": "dynamic"}, {"tree": "chain", "tree_topk": 4, "tree_budget": 9},
     "--tree-budget/--tree-topk shape dynamic trees only, and this run drafts a chain; add --tree dynamic, or drop them"),
    ({"tree": "width", "tree_width": 2}, {"tree_topk": 4}, "this run drafts a width tree"),
])
def test_dynamic_tree_flags_without_a_dynamic_tree_are_refused(decoding, overrides, fragment):
    with pytest.raises(InputError) as info:
        apply_overrides(profile_from_dict({**BASE, "decoding": decoding}), **overrides)
    assert fragment in str(info.value)


def test_dynamic_tree_flags_with_a_dynamic_tree_and_a_profiles_own_settings_are_kept():
    dynamic = apply_overrides(profile_from_dict(BASE), tree="dynamic", tree_budget=10, tree_depth=2, tree_topk=3)
    assert (dynamic.decoding.tree, dynamic.decoding.tree_budget, dynamic.decoding.tree_depth,
            dynamic.decoding.tree_topk) == ("dynamic", 10, 2, 3)
    in_profile = profile_from_dict({**BASE, "decoding": {"tree": "dynamic", "tree_budget": 12}})
    assert apply_overrides(in_profile, tree_topk=4).decoding.tree_topk == 4  # the profile's tree is dynamic
    # a profile holding dynamic settings, run with --tree chain: only flags the user gave are refused
    chain = apply_overrides(in_profile, tree="chain")
    assert chain.decoding.tree == "chain" and chain.decoding.tree_budget == 12


@pytest.mark.parametrize("command", ["generate", "compare", "bench"])
def test_the_commands_refuse_them_in_one_line_before_loading(command, tiny_dirs, tmp_path, no_model_loading):
    profile = write_profile(tmp_path / "p.yaml", tiny_dirs["target"], tiny_dirs["perturbed"], max_new_tokens=4)
    [image] = save_images(tmp_path, 1)
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps({"id": "a", "images": [image], "turns": [QUESTION], "category": "c"}) + "\n")
    head = {"generate": ["generate", image, "-q", QUESTION], "compare": ["compare", image, "-q", QUESTION],
            "bench": ["bench", str(manifest), "--out", str(tmp_path / "out.jsonl")]}[command]
    result = runner.invoke(app, [*head, "--profile", profile, "--tree-depth", "2"])
    assert_one_line_error(result, "--tree-depth shapes dynamic trees only, and this run drafts a chain; add --tree "
                                  "dynamic, or drop it")
    assert not (tmp_path / "out.jsonl").exists()


def test_load_decoder_refuses_the_same_keywords(tiny_dirs, tmp_path, no_model_loading):
    from mmspec_cli.api import load_decoder

    profile = write_profile(tmp_path / "p.yaml", tiny_dirs["target"], tiny_dirs["perturbed"])
    with pytest.raises(InputError, match="--tree-topk shapes dynamic trees only"):
        load_decoder(profile, tree_topk=4)


# --------------------------------------------------------------------------- 2. ssd's own step in Eq. (1)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path


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


# --------------------------------------------------------------------------- 3. --summarize and thread counts


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


# --------------------------------------------------------------------------- 4. the library's threads


def test_load_decoder_applies_the_clis_thread_choice_unless_told_otherwise(tiny_dirs, tmp_path, monkeypatch):
    from mmspec_cli.api import ModelSet, load_decoder

    monkeypatch.delenv("MMSPEC_THREADS", raising=False)
    profile = write_profile(tmp_path / "p.yaml", tiny_dirs["target"], tiny_dirs["perturbed"])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        load_decoder(profile, drafter="ar")
        assert torch.get_num_threads() == 1  # a small target: 1 thread, as the CLI chooses
        torch.set_num_threads(2)
        load_decoder(profile, drafter="ar", threads=None)
        assert torch.get_num_threads() == 2  # left alone
        load_decoder(profile, drafter="ar", threads=3)
        assert torch.get_num_threads() == 3
        monkeypatch.setenv("MMSPEC_THREADS", "2")
        models = ModelSet.load(load_profile(profile), ["ar"])
        assert torch.get_num_threads() == 2 and models.threads.reason == "MMSPEC_THREADS"
        with pytest.raises(InputError, match="threads: expected a number of CPU threads >= 1"):
            load_decoder(profile, drafter="ar", threads=0)
    finally:
        torch.set_num_threads(before)


# --------------------------------------------------------------------------- 5. progress bars at 80 and 60 columns


def rendered(progress, width: int) -> str:
    console = Console(file=io.StringIO(), width=width, color_system=None)
    with console.capture() as capture:
        console.print(progress.make_tasks_table(progress.tasks))
    return capture.get()


TIME = r"\d+:\d\d:\d\d"


@pytest.mark.parametrize("width", [80, 60])
def test_the_bench_bar_keeps_count_elapsed_and_eta_readable(width):
    from mmspec_cli.bench.progress import BenchProgress

    bar = BenchProgress(400, ["ar", "m", "t", "tabed:mtcp"], enabled=True,
                        console=Console(file=io.StringIO(), width=width))
    for drafter, blocks in (("ar", 30), ("m", 10), ("t", 11), ("tabed:mtcp", 9)):
        bar.turn_done({"drafter": drafter, "new_tokens": 30, "blocks": blocks})
    bar.sample("llava-bench-in-the-wild-[042]-a-long-sample-id", "tabed:mtcp")
    [line] = rendered(bar._progress, width).splitlines()
    assert len(line) <= width
    assert re.search(rf" 4/400 {TIME} ETA {TIME} ", line), line  # whole, not cut to "…"
    assert line.startswith("tabed:mt") and "…" in line  # the description (drafter first) and the τ note gave way


@pytest.mark.parametrize("width", [80, 60])
def test_the_train_head_bar_keeps_count_elapsed_and_eta_readable(width):
    from mmspec_cli.training.progress import Phase

    phase = Phase("training vispec head", 12000, done=250, enabled=True)
    phase.note("loss 0.123 top-1 0.456 | pass 3: loss 0.789 top-1 0.321 and more text to make it long")
    phase.advance(3)
    [line] = rendered(phase._progress, width).splitlines()
    assert len(line) <= width
    assert re.search(rf"  253/12000 {TIME} ETA ({TIME}|-:--:--) ", line), line
    assert "…" in line


# --------------------------------------------------------------------------- 6. --profile <(...)


def feed(path: str, text: str) -> threading.Thread:
    """Write ``text`` into the pipe at ``path`` from another thread (opening a FIFO blocks until it is read)."""
    def write() -> None:
        with open(path, "w") as pipe:
            pipe.write(text)

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    return thread


def test_a_profile_from_a_fifo_is_read_like_a_file(tmp_path):
    fifo = tmp_path / "profile.fifo"
    os.mkfifo(fifo)
    writer = feed(str(fifo), "target: {model: some/target}\ndecoding: {gamma: 7}\n")
    profile = load_profile(str(fifo))
    writer.join(timeout=10)
    assert profile.target.model == "some/target" and profile.decoding.gamma == 7


def test_process_substitution_dev_fd_works_on_the_command_line(tmp_path):
    """``--profile <(...)`` hands the command /dev/fd/N, the read end of a pipe."""
    records = write_records(tmp_path / "r.jsonl", made_records(("ar", "m")))
    read, write = os.pipe()
    os.set_inheritable(read, True)
    try:
        with os.fdopen(write, "w") as pipe:
            pipe.write(Path(summary_profile(tmp_path)).read_text())
        result = runner.invoke(app, ["bench", "--summarize", str(records), "--profile", f"/dev/fd/{read}",
                                     "--format", "json"])
    finally:
        os.close(read)
    assert result.exit_code == 0, result.stderr
    assert {r["drafter"] for r in json.loads(result.stdout)["rows"]} == {"ar", "m"}


def test_a_device_or_a_folder_is_still_refused(tmp_path):
    with pytest.raises(ProfileError, match="profile /dev/zero is not a file or a pipe; pass a YAML file"):
        load_profile("/dev/zero")
    with pytest.raises(ProfileError, match="is not a file but a folder"):
        load_profile(str(tmp_path) + "/")


# --------------------------------------------------------------------------- 7. bench --out after a failure


@pytest.fixture
def bench_files(tiny_dirs, tmp_path) -> dict:
    [image] = save_images(tmp_path, 1)
    good = {"id": "a", "images": [image], "turns": [QUESTION], "category": "c"}
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(good) + "\n{not json\n")
    ok = tmp_path / "ok.jsonl"
    ok.write_text(json.dumps(good) + "\n")
    return {"root": tmp_path, "bad_manifest": str(bad), "manifest": str(ok),
            "profile": write_profile(tmp_path / "p.yaml", tiny_dirs["target"], tiny_dirs["perturbed"],
                                     max_new_tokens=4),
            "no_model": write_profile(tmp_path / "missing.yaml", str(tmp_path / "no-such-target"),
                                      tiny_dirs["perturbed"])}


def test_a_run_refused_after_opening_its_out_file_leaves_no_file(bench_files, no_model_loading):
    out = bench_files["root"] / "new.jsonl"
    result = runner.invoke(app, ["bench", bench_files["bad_manifest"], "--drafters", "ar", "--out", str(out),
                                 "--profile", bench_files["profile"]])
    assert_one_line_error(result, "line 2")
    assert not out.exists() and not Path(f"{out}.lock").exists()


def test_a_model_that_cant_load_leaves_no_file_and_an_existing_file_is_untouched(bench_files):
    out = bench_files["root"] / "new.jsonl"
    args = [bench_files["manifest"], "--drafters", "ar", "--out", str(out), "--profile", bench_files["no_model"]]
    result = runner.invoke(app, ["bench", *args])
    assert_one_line_error(result, "no-such-target")
    assert not out.exists()
    out.write_text("")  # there before the run: an empty file stays as it was
    os.utime(out, ns=(5, 5))
    result = runner.invoke(app, ["bench", *args])
    assert result.exit_code == 2 and out.exists() and out.read_text() == "" and out.stat().st_mtime_ns == 5


def test_the_results_file_is_removed_only_when_the_run_wrote_nothing(tmp_path):
    new = tmp_path / "new.jsonl"
    with pytest.raises(KeyboardInterrupt):
        with records_mod.ResultsFile.open(new, False, {}) as results:
            raise KeyboardInterrupt  # a Ctrl-C before the first turn ended
    assert results.removed and not new.exists()
    from mmspec_cli.cli.bench import interrupted_line

    assert interrupted_line(results, "mmspec bench S --out F --resume") == (
        f"interrupted: no record was saved, so {new}, which this run created, was removed; to start again, run: "
        f"mmspec bench S --out F --resume")
    with pytest.raises(KeyboardInterrupt):
        with records_mod.ResultsFile.open(new, False, {}) as results:
            results.write({"id": "a", "turn": 0, "drafter": "ar"})
            raise KeyboardInterrupt
    assert not results.removed and new.read_text() == '{"id": "a", "turn": 0, "drafter": "ar"}\n'
    ended = tmp_path / "ended.jsonl"
    with records_mod.ResultsFile.open(ended, False, {}):
        pass  # a run that ends normally (a shard with no samples) keeps its file
    assert ended.exists()


def test_a_run_with_records_keeps_them(bench_files):
    out = bench_files["root"] / "kept.jsonl"
    result = runner.invoke(app, ["bench", bench_files["manifest"], "--drafters", "ar", "--out", str(out), "--profile",
                                 bench_files["profile"], "--no-warmup", "--format", "json"])
    assert result.exit_code == 0, result.stderr
    assert [json.loads(line)["drafter"] for line in out.read_text().splitlines()] == ["ar"]
