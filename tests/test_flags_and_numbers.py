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
