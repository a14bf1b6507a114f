"""Tests for ``mmspec bench``: records, summary maths, resume after a kill, failures, shards, bad inputs.

Tiny float64 LLaVA models of ``conftest.py`` on CPU; a manifest of 2 samples x 2 turns.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import yaml
from PIL import Image
from typer.testing import CliRunner

from mmspec_cli.bench import latency
from tests import tiny
from mmspec_cli.bench import records as records_mod
from mmspec_cli.inputs import hub
from mmspec_cli.inputs.prompts import continue_prompt, paper_prompt, prompt_key_for
from mmspec_cli.bench.report import check_line, counted, failure_line, table
from mmspec_cli.inputs.samples import Sample, parse_shard, select
from mmspec_cli.inputs.sources import resolve
from mmspec_cli.decoding.schedules import OPENING_BLOCKS
from mmspec_cli.bench.summary import ranks, summarize, token_check
from mmspec_cli.cli.app import app
from mmspec_cli.drafters import build_drafter
from mmspec_cli.decoding.engine import SpeculativeDecoder
from mmspec_cli.errors import InputError
from mmspec_cli.bench.hf_assisted import assisted_generate
from mmspec_cli.models.loading import resolve_device
from mmspec_cli.models.profiles import load_profile
from mmspec_cli.models.prompts import render_prompt

from tests.helpers import assert_one_line_error, save_images, tiny_files, write_profile

MAX_NEW = 6
DRAFTERS = "ar,m,t"
RECORD_KEYS = {"id", "category", "turn", "drafter", "token_ids", "text", "new_tokens", "blocks", "block_efficiency",
               "acceptance_rate", "wall_s", "tokens_per_s", "drafted", "accepted", "prompt_tokens", "gamma",
               "temperature", "max_new_tokens", "prompt_style", "target", "draft", "top_p", "top_k", "seed", "ensemble",
               "threads", "int8_threshold", "accepted_per_block"}
SAMPLES = [
    {"id": "s0", "images": ["img0.png"], "turns": ["what is in the image?", "and then?"], "category": "llava-w"},
    {"id": "s1", "images": ["img1.png", "img0.png"], "turns": ["what changed between the two images?", "why?"],
     "category": "spot"},
]

QUESTION = "what is in the image?"
QUESTIONS = ["what is in the image?", "and then?"]

runner = CliRunner()


def write_jsonl(path: Path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def write_manifest(root: Path, n: int, turns: int) -> str:
    """``n`` one-image samples of ``turns`` turns each."""
    path = root / f"manifest-{n}x{turns}.jsonl"
    path.write_text("".join(json.dumps({"id": f"s{i}", "images": [f"img{i % 2}.png"], "turns": QUESTIONS[:turns],
                                        "category": "c"}) + "\n" for i in range(n)))
    return str(path)


@pytest.fixture(scope="module")
def files(tiny_dirs, tmp_path_factory) -> dict:
    files = tiny_files(tmp_path_factory.mktemp("bench"), tiny_dirs, max_new_tokens=MAX_NEW, gamma=3)
    root = files["root"]
    (root / "corrupt.png").write_bytes(b"\x00not a png\xff" * 8)
    return {
        **files,
        "manifest": write_jsonl(root / "manifest.jsonl", SAMPLES),
        "with_corrupt": write_jsonl(root / "corrupt.jsonl", [
            {"id": "bad", "images": ["corrupt.png"], "turns": ["what?"], "category": "spot"}, SAMPLES[0]]),
        "small": write_manifest(root, 2, 2),  # 2 samples x 2 turns: 8 records with ar,m
        "medium": write_manifest(root, 12, 1),  # 24 records with ar,m: time enough for a signal to land
    }


def bench(files: dict, *args: str, env: dict | None = None):
    return runner.invoke(app, ["bench", *args, "--profile", files["profile"]], env=env)


@pytest.fixture(scope="module")
def run(files) -> dict:
    """One full run: 2 samples x 2 turns x (ar, m, t), summary as JSON."""
    out = files["root"] / "run.jsonl"
    result = bench(files, files["manifest"], "--drafters", DRAFTERS, "--out", str(out), "--format", "json")
    assert result.exit_code == 0, result.stderr
    return {"out": out, "records": read_jsonl(out), "summary": json.loads(result.stdout), "stderr": result.stderr}


# --------------------------------------------------------------------------- records


def test_one_record_per_sample_turn_drafter_with_the_schema(run):
    records = run["records"]
    assert [(r["id"], r["turn"], r["drafter"]) for r in records] == [
        (s, t, d) for s in ("s0", "s1") for d in ("ar", "m", "t") for t in (0, 1)]
    for r in records:
        assert set(r) == RECORD_KEYS
        assert r["category"] == {"s0": "llava-w", "s1": "spot"}[r["id"]]
        assert len(r["token_ids"]) == r["new_tokens"] and 0 < r["new_tokens"] <= MAX_NEW
        assert r["block_efficiency"] == pytest.approx(r["new_tokens"] / r["blocks"])
        assert len(r["accepted_per_block"]) == r["blocks"] and sum(r["accepted_per_block"]) == r["accepted"]
        assert r["tokens_per_s"] == pytest.approx(r["new_tokens"] / r["wall_s"])
        assert (r["gamma"], r["temperature"], r["max_new_tokens"], r["prompt_style"]) == (3, 0.0, MAX_NEW, "default")
        assert r["prompt_tokens"] > 0
        if r["drafter"] == "ar":
            assert r["acceptance_rate"] is None and r["blocks"] == r["new_tokens"]
        else:
            assert r["acceptance_rate"] == pytest.approx(r["accepted"] / r["drafted"])
    later = {(r["id"], r["drafter"]): r["prompt_tokens"] for r in records if r["turn"] == 1}
    first = {(r["id"], r["drafter"]): r["prompt_tokens"] for r in records if r["turn"] == 0}
    assert all(later[k] > first[k] for k in first)  # turn 2 carries the first answer: one conversation


def test_greedy_tokens_agree_and_the_check_says_so(run):
    by_turn = {}
    for r in run["records"]:
        by_turn.setdefault((r["id"], r["turn"]), set()).add(tuple(r["token_ids"]))
    assert all(len(ids) == 1 for ids in by_turn.values())
    check = run["summary"]["token_check"]
    assert check == {"ran": True, "reason": "", "compared": 8, "mismatches": []}
    assert "8 turns compared, 0 mismatches" in run["stderr"]


def test_ensemble_records_carry_members_and_per_block_weights(files):
    out = files["root"] / "mt.jsonl"
    result = bench(files, files["manifest"], "--drafters", "mt", "--limit", "1", "--turns", "1", "--out", str(out))
    assert result.exit_code == 0, result.stderr
    [record] = read_jsonl(out)
    assert record["members"] == ["m", "t"] and len(record["weights"]) == record["blocks"]
    assert all(w is None or (len(w) == 2 and sum(w) == pytest.approx(1.0)) for w in record["weights"])


# --------------------------------------------------------------------------- summary


def expected_rows(records: list[dict]) -> dict:
    """The summary recomputed here by hand, independently of mmspec_cli.bench.summary."""
    rows = {}
    for category in ("llava-w", "spot", "all"):
        group = [r for r in records if category == "all" or r["category"] == category]
        ar = {(r["id"], r["turn"]): r for r in group if r["drafter"] == "ar"}
        for drafter in ("ar", "m", "t"):
            mine = [r for r in group if r["drafter"] == drafter]
            per_sample = []
            for sample_id in sorted({r["id"] for r in mine}):
                turns = [r for r in mine if r["id"] == sample_id]
                per_sample.append(sum(r["new_tokens"] for r in turns) / sum(r["blocks"] for r in turns))
            drafted = sum(r["drafted"] for r in mine)
            ar_spt = sum(ar[(r["id"], r["turn"])]["wall_s"] for r in mine) / sum(ar[(r["id"], r["turn"])]["new_tokens"] for r in mine)
            spt = sum(r["wall_s"] for r in mine) / sum(r["new_tokens"] for r in mine)
            rows[(category, drafter)] = {
                "samples": len(per_sample),
                "block_efficiency": statistics.fmean(per_sample),
                "block_efficiency_std": statistics.stdev(per_sample) if len(per_sample) > 1 else 0.0,
                "acceptance_rate": sum(r["accepted"] for r in mine) / drafted if drafted else None,
                "tokens_per_s": 1 / spt,
                "speedup": ar_spt / spt,
            }
    return rows


def test_summary_numbers_are_recomputed_from_the_records(run, files):
    expected = expected_rows(run["records"])
    got = {(r["category"], r["drafter"]): r for r in run["summary"]["rows"]}
    assert list(got) == list(expected)
    for key, want in expected.items():
        for name, value in want.items():
            assert got[key][name] == pytest.approx(value), (key, name)
        assert got[key]["expected_speedup"] is None and got[key]["failed"] == 0
    again = runner.invoke(app, ["bench", "--summarize", str(run["out"]), "--format", "json"])
    assert again.exit_code == 0 and json.loads(again.stdout) == run["summary"]


def test_summarize_merges_several_files(run, tmp_path):
    records = run["records"]
    a = write_jsonl(tmp_path / "a.jsonl", [json.dumps(r) for r in records if r["id"] == "s0"])
    b = write_jsonl(tmp_path / "b.jsonl", [json.dumps(r) for r in records if r["id"] == "s1"])
    merged = runner.invoke(app, ["bench", "--summarize", a, "--summarize", b, "--format", "json"])
    assert merged.exit_code == 0 and json.loads(merged.stdout)["rows"] == run["summary"]["rows"]
    csv = runner.invoke(app, ["bench", "--summarize", a, "--summarize", b, "--format", "csv"])
    lines = csv.stdout.splitlines()
    assert lines[0].startswith("category,drafter,samples,block_efficiency") and len(lines) == 1 + 9


def test_summarize_refuses_the_records_of_two_runs_joined(run, tmp_path, no_model_loading):
    """``cat a.jsonl a.jsonl``: every turn twice, ar compared with itself. Refused in one line naming the repeat."""
    lines = run["out"].read_text().splitlines()
    joined = write_jsonl(tmp_path / "joined.jsonl", lines + lines)
    result = runner.invoke(app, ["bench", "--summarize", joined])
    assert_one_line_error(result, f"joined.jsonl line {len(lines) + 1} repeats sample 's0' turn 0 drafter 'ar' of "
                                  f"{joined} line 1: two runs' records were joined; remove the repeated run's records, "
                                  f"or summarise each run's file apart")
    twice = runner.invoke(app, ["bench", "--summarize", str(run["out"]), "--summarize", str(run["out"])])
    assert_one_line_error(twice, "is given twice")
    other = write_jsonl(tmp_path / "other.jsonl", [json.dumps(dict(json.loads(line), category="elsewhere"))
                                                   for line in lines])  # another manifest's sample 's0'
    both = runner.invoke(app, ["bench", "--summarize", str(run["out"]), "--summarize", other])
    assert_one_line_error(both, "the runs' sources use the same ids")


def compiled_copy(records: list[dict]) -> list[dict]:
    """``records`` as ``bench --compile`` writes them: their drafting settings say compile."""
    return [dict(r, ensemble=json.dumps({**json.loads(r["ensemble"]), "compile": True}, sort_keys=True))
            for r in records]


def test_summarize_refuses_compiled_and_eager_records_together(run, tmp_path, no_model_loading):
    eager = write_jsonl(tmp_path / "eager.jsonl", [r for r in run["records"] if r["id"] == "s0"])
    compiled = write_jsonl(tmp_path / "compiled.jsonl", compiled_copy([r for r in run["records"] if r["id"] == "s1"]))
    result = runner.invoke(app, ["bench", "--summarize", eager, "--summarize", compiled])
    assert_one_line_error(result, f"{compiled} line 1 was made with --compile and {eager} line 1 without; compiled "
                                  f"and eager times are not summarised together: summarise the files of each kind apart")
    alone = runner.invoke(app, ["bench", "--summarize", compiled, "--format", "json"])
    assert alone.exit_code == 0 and json.loads(alone.stdout)["rows"]


def test_expected_speedup_uses_the_cached_latency_ratio(run, files, tmp_path, monkeypatch):
    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path))
    spec = yaml.safe_load(Path(files["profile"]).read_text())
    device = latency.device_name(resolve_device("cpu"))
    latency.save(latency.LatencyResult(device, spec["target"]["model"], spec["draft"]["model"],
                                       target_ms={"32,3": 10.0}, draft_ms={"1,32": 1.0}))
    result = runner.invoke(app, ["bench", "--summarize", str(run["out"]), "--profile", files["profile"], "--format", "json"])
    rows = {(r["category"], r["drafter"]): r for r in json.loads(result.stdout)["rows"]}
    m = rows[("all", "m")]
    assert m["expected_speedup"] == pytest.approx(m["block_efficiency"] / (3 * 0.1 + 1))
    assert rows[("all", "ar")]["expected_speedup"] is None


def test_gamma_schedule_cost_drafts_from_the_cached_step_costs_or_says_none_are(files, tiny_dirs, tmp_path,
                                                                               monkeypatch):
    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path))
    args = (files["manifest"], "--drafters", "ar,m", "--limit", "1", "--turns", "1", "--threads", "1",
            "--max-new-tokens", "16", "--gamma-schedule", "cost", "--format", "json")
    unmeasured = bench(files, *args)
    assert unmeasured.exit_code == 0, unmeasured.stderr
    assert ("note: --gamma-schedule cost has no step costs measured on this machine (cpu-" in unmeasured.stderr
            and "it uses the constant γ = 3 (run mmspec profile-latency --profile" in unmeasured.stderr)
    spec = yaml.safe_load(Path(files["profile"]).read_text())
    latency.save(latency.LatencyResult(latency.device_name("cpu", 1), spec["target"]["model"], spec["draft"]["model"],
                                       {f"{s},{n}": 10.0 * n for s in (16, 256) for n in range(1, 8)},
                                       {"1,16": 0.5, "1,256": 0.5}))  # γ = 1 is best after the first block
    measured = bench(files, *args, "--out", str(tmp_path / "cost.jsonl"))
    assert measured.exit_code == 0 and "--gamma-schedule cost" not in measured.stderr, measured.stderr
    ar, m = read_jsonl(tmp_path / "cost.jsonl")
    assert m["token_ids"] == ar["token_ids"]
    opening = OPENING_BLOCKS  # blocks of γ = 3 first, then at most 1 (the constant γ drafts 3 more often)
    assert m["blocks"] > opening + 1 and m["drafted"] <= 3 * opening + (m["blocks"] - opening)


def test_an_injected_mismatch_is_counted_and_fails_the_run(run, tmp_path):
    records = [dict(r) for r in run["records"]]
    victim = next(r for r in records if r["drafter"] == "t" and r["turn"] == 1)
    victim["token_ids"] = victim["token_ids"][:-1] + [victim["token_ids"][-1] + 1]
    check = token_check(records)
    assert check.ran and check.compared == 8 and check.mismatches == [(victim["id"], 1, "t")]
    path = write_jsonl(tmp_path / "bad.jsonl", records)
    result = runner.invoke(app, ["bench", "--summarize", path])
    assert result.exit_code == 1
    assert f"1 mismatch (first: {victim['id']} turn 1 t)" in result.stdout


def test_the_check_says_why_it_did_not_run(run):
    no_ar = [r for r in run["records"] if r["drafter"] != "ar"]
    assert token_check(no_ar).reason == "ar was not among the drafters" and not token_check(no_ar).ran
    sampled = [dict(r, temperature=0.7) for r in run["records"]]
    assert not token_check(sampled).ran and "temperature > 0" in token_check(sampled).reason


def test_best_is_bold_and_second_underlined_per_column(run):
    summary = summarize(run["records"])
    rows = [r for r in summary.rows if r.category == "all"]
    marks = ranks(rows, "block_efficiency")
    assert marks[0] is None  # ar's τ = 1 is the lowest
    rendered = table(summary)
    tau_cells = rendered.columns[3]._cells
    styles = {cell.plain: cell.style for cell in tau_cells}
    best = max(rows, key=lambda r: r.block_efficiency)
    assert styles[f"{best.block_efficiency:.2f} ± {best.block_efficiency_std:.2f}"] == "bold"
    assert "underline" in [cell.style for cell in tau_cells]


# --------------------------------------------------------------------------- resume


def test_resume_after_a_kill_loses_and_repeats_nothing(files, tmp_path):
    out = tmp_path / "killed.jsonl"
    args = ["bench", files["manifest"], "--drafters", DRAFTERS, "--out", str(out), "--profile", files["profile"],
            "--format", "json", "--no-warmup"]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    process = subprocess.Popen([sys.executable, "-c", "from mmspec_cli.cli.app import main; main()", *args],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        if out.exists() and out.read_bytes().count(b"\n") >= 1:
            process.send_signal(signal.SIGKILL)
            break
        time.sleep(0.005)
    process.wait(timeout=30)
    assert process.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    before = out.read_text().splitlines()
    assert 1 <= len(before) < 12
    with out.open("a") as f:
        f.write('{"id": "s1", "turn": 0, "drafter": "t", "tok')  # a torn last write
    result = runner.invoke(app, args[:-1] + ["--resume"])
    assert result.exit_code == 0, result.stderr
    after = out.read_text()
    assert after.endswith("\n")
    records = [json.loads(line) for line in after.splitlines()]
    keys = [(r["id"], r["turn"], r["drafter"]) for r in records]
    assert len(keys) == len(set(keys)) == 12
    assert after.splitlines()[: len(before)] == before  # finished records are kept as they were
    assert token_check(records).mismatches == []


def test_resume_refuses_other_settings_and_plain_rerun_refuses_to_overwrite(run, files):
    out = str(run["out"])
    other = bench(files, files["manifest"], "--drafters", DRAFTERS, "--out", out, "--resume", "--gamma", "2")
    assert_one_line_error(other, "holds results made with gamma 3 but this run uses 2")
    again = bench(files, files["manifest"], "--drafters", DRAFTERS, "--out", out)
    assert_one_line_error(again, "already exists; pass --resume")


def test_resume_with_another_compile_setting_says_so_in_one_short_line(run, files, tmp_path, no_model_loading):
    common = [files["manifest"], "--drafters", DRAFTERS, "--resume"]
    eager = bench(files, *common, "--out", str(run["out"]), "--compile")
    assert_one_line_error(eager, f"--out {run['out']} was made without --compile; drop --compile to resume it, "
                                 f"or pass a new --out")
    compiled = write_jsonl(tmp_path / "compiled.jsonl", compiled_copy(run["records"]))
    again = bench(files, *common, "--out", compiled)
    assert_one_line_error(again, f"--out {compiled} was made with --compile; add --compile to resume it, "
                                 f"or pass a new --out")


def test_resume_names_the_drafting_setting_that_differs():
    def drafting(**settings) -> str:
        return json.dumps({"ensemble": {"members": ["m", "t"], "policy": "grid"}, "pooling": {"kernel": 2},
                           **settings}, sort_keys=True)

    def refusal(recorded: str, current: str) -> str:
        return records_mod.other_settings(Path("r.jsonl"), "ensemble", recorded, current)

    fix = "; resume with the same settings, or choose another --out"
    assert refusal(drafting(), drafting(tree_width=2)) == \
        "--out r.jsonl holds results made with tree_width 1 but this run uses 2" + fix
    assert refusal(drafting(), drafting(tree={"kind": "dynamic", "budget": 30})) == \
        "--out r.jsonl holds results made without tree, but this run sets it to dynamic" + fix
    members = drafting().replace('["m", "t"]', '["m", "c"]')
    assert refusal(drafting(), members) == \
        '--out r.jsonl holds results made with ensemble.members ["m", "t"] but this run uses ["m", "c"]' + fix
    assert refusal(drafting(compile=True, tree_width=2), drafting()).startswith("--out r.jsonl was made with --compile")
    long_path = "/models/" + "x" * 200
    line = records_mod.other_settings(Path("r.jsonl"), "target", long_path, "/models/other")
    assert len(line) < 200 and "holds results made with target /models/xx" in line  # the path cut in the middle


@pytest.mark.parametrize("kind", ["eagle", "vispec", "eagle3"])
def test_every_head_drafter_records_its_head_so_resume_refuses_another(run, files, tmp_path, no_model_loading, kind):
    """A file made with one head of any kind (eagle3 included) is not continued with another head of that kind."""
    from mmspec_cli.bench.runner import drafting_settings

    def with_head(folder: str) -> str:
        spec = yaml.safe_load(Path(files["profile"]).read_text()) | {"head": [{"model": folder, "kind": kind}]}
        return write_profile_data(tmp_path / f"{kind}-{Path(folder).name}.yaml", spec)

    first, second = with_head(str(tmp_path / "head-a")), with_head(str(tmp_path / "head-b"))
    drafting = drafting_settings(load_profile(first), ["ar", kind])
    assert drafting["head"] == [{"model": str(tmp_path / "head-a"), "kind": kind, "num_q": None, "revision": None}]
    made = [dict(r, ensemble=json.dumps(drafting, sort_keys=True)) for r in run["records"] if r["drafter"] == "ar"]
    out = write_jsonl(tmp_path / f"{kind}.jsonl", made)
    result = runner.invoke(app, ["bench", files["manifest"], "--drafters", f"ar,{kind}", "--out", out, "--resume",
                                 "--profile", second])
    assert_one_line_error(result, f"--out {out} holds results made with head.model")
    assert "head-a" in result.stderr and "head-b" in result.stderr
    assert read_jsonl(out) == made  # nothing of the file changed


def write_profile_data(path: Path, data: dict) -> str:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


#: What a profile can't run, each with the drafter that needs it, the profile's change and the refusal's words.
CANT_RUN = {
    "no draft": ("m", {"draft": None}, "drafter 'm' needs a draft model"),
    "no captioner": ("tabed:mc", {}, "uses caption drafting (c) but the profile has no captioner"),
    "no ssd layer": ("ssd", {}, "drafter 'ssd' needs ssd.layer"),
    "no head": ("eagle3", {}, "drafter 'eagle3' needs an eagle3 head"),
    "images to a language-only draft": ("m", {"draft": "language"}, "which shows the images to the draft"),
    "a tree for pld": ("pld", {"decoding": {"tree_width": 2}}, "the pld drafter drafts chains"),
    "compiling a quantized target": ("ar", {"decoding": {"compile": True}, "target": {"quantization": "8bit"}},
                                     "--compile: the target model can't be compiled here"),
}


@pytest.mark.parametrize("case", CANT_RUN)
def test_bench_and_model_loading_refuse_what_the_profile_cant_run_alike(files, tmp_path, no_model_loading, case):
    """One function refuses for both (api.check_profile_runs): ``ModelSet.load`` (generate, compare, the Python
    API) and ``bench``, before it opens --out, in the same words and before any model loads."""
    from mmspec_cli.api import ModelSet

    drafter, change, words = CANT_RUN[case]
    data = yaml.safe_load(Path(files["profile"]).read_text())
    if change.get("draft") == "language":  # a causal language model's folder: a draft with no vision part
        language = tmp_path / "language-draft"
        language.mkdir()
        (language / "config.json").write_text(json.dumps({"model_type": "llama"}))
        change = {"draft": {"model": str(language)}}
    for key, value in change.items():
        data[key] = None if value is None else {**(data.get(key) or {}), **value}
    data = {key: value for key, value in data.items() if value is not None}
    profile = write_profile_data(tmp_path / "cant.yaml", data)
    with pytest.raises(InputError) as refused:
        ModelSet.load(load_profile(profile), [drafter])
    assert words in str(refused.value)
    out = tmp_path / "out.jsonl"
    drafters = "ar" if drafter == "ar" else f"ar,{drafter}"
    result = runner.invoke(app, ["bench", files["manifest"], "--drafters", drafters, "--out", str(out),
                                 "--profile", profile])
    assert assert_one_line_error(result, words) == f"error: {refused.value}".replace("--drafter ar", "--drafters ar")
    assert not out.exists()


def test_resume_of_a_finished_file_loads_no_model(run, files, no_model_loading):
    result = bench(files, files["manifest"], "--drafters", DRAFTERS, "--out", str(run["out"]), "--resume",
                   "--format", "json")
    assert result.exit_code == 0 and json.loads(result.stdout)["rows"] == run["summary"]["rows"]


# --------------------------------------------------------------------------- failures


def test_a_corrupt_image_is_recorded_and_the_run_goes_on(files, tmp_path):
    out = tmp_path / "corrupt.jsonl"
    result = bench(files, files["with_corrupt"], "--drafters", "ar,m", "--turns", "1", "--out", str(out))
    assert result.exit_code == 1
    records = read_jsonl(out)
    errors = [r for r in records if "error" in r]
    assert [(r["id"], r["drafter"]) for r in errors] == [("bad", "ar"), ("bad", "m")]
    assert all(set(r) == {"id", "category", "drafter", "error"} and "could not be read as an image" in r["error"]
               for r in errors)
    assert [(r["id"], r["drafter"]) for r in records if "error" not in r] == [("s0", "ar"), ("s0", "m")]
    # why the exit code is 1 goes to stderr, also under a table on stdout
    assert "2 (sample, drafter) pairs failed" in result.stderr and "pairs failed" not in result.stdout
    retry = bench(files, files["with_corrupt"], "--drafters", "ar,m", "--turns", "1", "--out", str(out), "--resume")
    assert retry.exit_code == 1  # failed samples are retried on resume, and fail again: still recorded once
    assert [r.get("error") is not None for r in read_jsonl(out)] == [False, False, True, True]


# --------------------------------------------------------------------------- shards


def test_shard_selection():
    samples = [Sample(str(i), "c", ("q",)) for i in range(7)]
    assert [s.id for s in select(samples, shard=(1, 3))] == ["1", "4"]
    assert [s.id for s in select(samples, limit=5, shard=(0, 2))] == ["0", "2", "4"]
    assert parse_shard("2/4") == (2, 4) and parse_shard(None) is None
    assert parse_shard("auto", {"RANK": "3", "WORLD_SIZE": "8"}) == (3, 8)
    assert parse_shard("auto", {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}) == (1, 2)


def test_shard_runs_its_samples_into_its_own_file(files, tmp_path):
    pattern = str(tmp_path / "part-{rank}.jsonl")
    result = bench(files, files["manifest"], "--drafters", "ar", "--turns", "1", "--shard", "1/2", "--out", pattern)
    assert result.exit_code == 0, result.stderr
    assert [r["id"] for r in read_jsonl(tmp_path / "part-1.jsonl")] == ["s1"]


# --------------------------------------------------------------------------- other drafters and prompt styles


def test_hf_assisted_is_a_peer_row_with_the_same_tokens(files, tmp_path):
    out = tmp_path / "hf.jsonl"
    result = bench(files, files["manifest"], "--drafters", "ar,hf-assisted", "--limit", "1", "--out", str(out),
                   "--format", "json")
    assert result.exit_code == 0, result.stderr
    hf = [r for r in read_jsonl(out) if r["drafter"] == "hf-assisted"]
    assert [r["turn"] for r in hf] == [0, 1] and all(r["acceptance_rate"] is None for r in hf)
    assert json.loads(result.stdout)["token_check"]["mismatches"] == []


def test_assisted_generate_counts_target_calls_and_restores_the_draft_config(tiny_models):
    target, draft = tiny_models["target"], tiny_models["perturbed"]
    images = tiny.images(1)
    prompt = render_prompt(target.processor, ["what is in the image?"], [], 1)
    before = draft.model.generation_config.num_assistant_tokens
    result = assisted_generate(target, draft, images, prompt, gamma=2, max_new_tokens=MAX_NEW)
    assert draft.model.generation_config.num_assistant_tokens == before
    decoder = SpeculativeDecoder(target, build_drafter("ar", target, None), max_new_tokens=MAX_NEW)
    assert result.token_ids == decoder.generate(images, ["what is in the image?"]).turns[0].token_ids
    assert 1 <= result.target_calls <= len(result.token_ids) and result.draft_calls >= result.target_calls - 1


def test_paper_prompts(files, tmp_path, run):
    assert prompt_key_for("LLaVA-W") == "llava-w" and prompt_key_for("Spot-the-Diff") == "spot-the-diff"
    assert prompt_key_for("demo") is None
    first = paper_prompt("llava-w", " What is it? ", 1)
    assert first == ("USER: <image> For the following question, provide a detailed explanation of your reasoning "
                     "leading to the answer. What is it? ASSISTANT:")
    assert continue_prompt(first, "A cat.", "</s>", "Why?").endswith("ASSISTANT: A cat.</s>USER: Why? ASSISTANT:")
    with pytest.raises(InputError, match="takes 2 image"):
        paper_prompt("spot-the-diff", "", 1)
    out = tmp_path / "paper.jsonl"
    result = bench(files, files["manifest"], "--drafters", "ar,m", "--limit", "1", "--prompt-style", "paper",
                   "--out", str(out), "--format", "json")
    assert result.exit_code == 0, result.stderr
    records = read_jsonl(out)
    assert [(r["turn"], r["prompt_style"]) for r in records] == [(0, "paper"), (1, "paper")] * 2
    assert json.loads(result.stdout)["token_check"]["compared"] == 2
    # the manifest's category "llava-w" took the paper's prompt, longer than the chat template's
    default = {r["turn"]: r["prompt_tokens"] for r in run["records"] if r["id"] == "s0" and r["drafter"] == "ar"}
    assert records[0]["prompt_tokens"] > default[0] + 10  # "For the following question, provide ..."


@pytest.mark.parametrize("style", ["default", "paper"])
def test_a_given_history_continues_the_conversation_as_if_generated(files, tmp_path, style):
    """The first turn and its own answer given as history: the second turn comes out as in the
    two-turn run (same prompt, same tokens), and only that turn is generated and recorded."""
    whole = tmp_path / "whole.jsonl"
    assert bench(files, files["manifest"], "--drafters", "ar", "--limit", "1", "--prompt-style", style,
                 "--out", str(whole)).exit_code == 0
    first, second = read_jsonl(whole)
    given = {**SAMPLES[0], "turns": SAMPLES[0]["turns"][1:], "history": [[SAMPLES[0]["turns"][0], first["text"]]]}
    manifest = write_jsonl(files["root"] / f"history-{style}.jsonl", [given])
    out = tmp_path / "history.jsonl"
    result = bench(files, manifest, "--drafters", "ar,m", "--prompt-style", style, "--out", str(out), "--format", "json")
    assert result.exit_code == 0, result.stderr
    records = read_jsonl(out)
    assert [(r["turn"], r["drafter"], r["history_turns"]) for r in records] == [(0, "ar", 1), (0, "m", 1)]
    assert all(r["token_ids"] == second["token_ids"] and r["prompt_tokens"] == second["prompt_tokens"] for r in records)
    # resuming records whose turn 0 was the conversation's first turn would mix two different turns
    assert_one_line_error(bench(files, manifest, "--drafters", "ar", "--prompt-style", style, "--out", str(whole),
                                "--resume"), "made after 0 given history turns, but this run gives 1")


def test_engine_history_is_checked_and_rendered_before_the_questions(tiny_models):
    target = tiny_models["target"]
    decoder = SpeculativeDecoder(target, build_drafter("ar", target, None), max_new_tokens=MAX_NEW)
    started = [e for e in decoder.stream(tiny.images(1), ["and then?"], history=[("what is it?", "a shape.")])
               if type(e).__name__ == "TurnStarted"]
    assert started[0].prompt == render_prompt(target.processor, ["what is it?", "and then?"], ["a shape."], 1)
    with pytest.raises(InputError, match="history turn 1 must be a \\[question, answer\\] pair"):
        decoder.generate(tiny.images(1), ["and then?"], history=[("what is it?", "")])
    with pytest.raises(InputError, match="write the earlier turns into it"):
        decoder.generate(tiny.images(1), [], raw_prompt="USER: <image> hi ASSISTANT:", history=[("q", "a")])


# --------------------------------------------------------------------------- Hugging Face datasets (adapters only)


def test_dataset_rows_become_samples():
    red, blue = tiny.images(2)
    interleave = hub.DATASETS["lmms-lab/LLaVA-NeXT-Interleave-Bench"]
    rows = [{"sample_id": 7, "sub_task": "VIST", "image_0": red, "question": "q"},
            {"sample_id": 8, "sub_task": "Spot-the-Diff", "image_0": red, "image_1": blue, "image_2": None,
             "question": "<image> <image> What differs?"}]
    [sample] = hub.rows_to_samples(interleave, rows, "Spot-the-Diff", limit=None)
    assert (sample.id, sample.category, sample.turns, sample.prompt_key) == (
        "Spot-the-Diff-8", "Spot-the-Diff", ("What differs?",), "spot-the-diff")
    assert sample.images == (red, blue)
    wild = hub.DATASETS["lmms-lab/llava-bench-in-the-wild"]
    [s] = hub.rows_to_samples(wild, [{"question_id": 3, "image": red, "question": "Describe."}], None, None)
    assert (s.id, s.category, s.images, s.prompt_key) == ("3", "llava-w", (red,), "llava-w")
    lite = hub.DATASETS["lmms-lab/LMMs-Eval-Lite"]
    [d] = hub.rows_to_samples(lite, [{"questionId": "q9", "image": red, "question": "Total?"}], "docvqa_val", None)
    assert (d.id, d.category, d.prompt_key) == ("q9", "docvqa_val", "docvqa")


class FakeRows(list):
    def select(self, indices):
        return FakeRows(self[i] for i in indices)


def test_datasets_are_loaded_with_the_documented_config_and_split(monkeypatch):
    calls = []
    red, blue = tiny.images(2)

    def load_dataset(name, config, split, streaming):
        calls.append((name, config, split, streaming))
        if name.endswith("Interleave-Bench"):
            return iter([{"sample_id": i, "sub_task": "IEdit", "image_0": red, "image_1": blue, "question": "q"}
                         for i in range(5)])
        if name.endswith("MMVet"):
            raise ConnectionError("no network\nmore detail")
        return FakeRows({"question_id": i, "image": red, "question": f"q{i}"} for i in range(5))

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    assert [s.id for s in hub.load("lmms-lab/llava-bench-in-the-wild", limit=2)] == ["0", "1"]
    edits = hub.load("lmms-lab/LLaVA-NeXT-Interleave-Bench:IEdit", limit=3)
    assert [s.id for s in edits] == ["IEdit-0", "IEdit-1", "IEdit-2"] and edits[0].prompt_key == "iedit"
    hub.load("lmms-lab/LLaVA-NeXT-Interleave-Bench:out_of_domain/IEdit", limit=1)
    assert calls == [("lmms-lab/llava-bench-in-the-wild", None, "train", False),
                     ("lmms-lab/LLaVA-NeXT-Interleave-Bench", "in_domain", "test", True),
                     ("lmms-lab/LLaVA-NeXT-Interleave-Bench", "out_of_domain", "test", True)]
    with pytest.raises(InputError, match=r"could not load dataset lmms-lab/MMVet \(ConnectionError: no network\)"):
        hub.load("lmms-lab/MMVet")


def test_a_dataset_without_the_datasets_package_says_how_to_install(files, monkeypatch, no_model_loading, tmp_path):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    result = bench(files, "lmms-lab/llava-bench-in-the-wild", "--out", str(tmp_path / "x.jsonl"))
    assert_one_line_error(result, "pip install 'mmspec[datasets]'")


# --------------------------------------------------------------------------- bad inputs


def _bad_manifests(root: Path) -> dict:
    good = json.dumps(SAMPLES[0])
    return {
        "malformed line": (write_jsonl(root / "malformed.jsonl", [good, '{"id": "s1", "images": [']),
                           "manifest.*line 2: not valid JSON"),
        "missing field": (write_jsonl(root / "missing.jsonl", [{"id": "s1", "images": [], "category": "c"}]),
                          "line 1: missing 'turns'"),
        "duplicate id": (write_jsonl(root / "dup.jsonl", [good, good]), "line 2: id 's0' repeats line 1"),
        "empty": (write_jsonl(root / "empty.jsonl", []), "has no samples"),
        "bad history": (write_jsonl(root / "history.jsonl", [{**SAMPLES[0], "history": [["only a question"]]}]),
                        "line 1: history turn 1 must be a \\[question, answer\\] pair"),
        "binary file": (_binary(root / "binary.jsonl"), r"could not be read \(UnicodeDecodeError\); pass a readable "
                                                         r"UTF-8 JSONL file"),
        "plain text": (write_jsonl(root / "notes.txt", ["some notes, not JSON"]), "notes.txt line 1: not valid JSON"),
    }


def _binary(path: Path) -> str:
    path.write_bytes(bytes(range(256)) * 4)
    return str(path)


BAD_ARGS = {
    "unknown suite": (["no-such-suite"], "neither an existing manifest file, nor a known suite (known suites: demo-all, demo-followup, demo-pair,"),
    "shard out of range": (["M", "--shard", "2/2"], "--shard: expected 0 <= i < n"),
    "shard not numbers": (["M", "--shard", "a/b"], "--shard: expected integers"),
    "shard no slash": (["M", "--shard", "1"], "--shard: expected i/n"),
    "shard negative": (["M", "--shard", "-1/2"], "--shard: expected 0 <= i < n"),
    "shard auto without env": (["M", "--shard", "auto"], "RANK and WORLD_SIZE"),
    "unknown drafter": (["M", "--drafters", "ar,zz"], "drafter 'zz'"),
    "repeated drafter": (["M", "--drafters", "ar,m,ar"], "names 'ar' more than once"),
    "shards sharing one file": (["M", "--shard", "1/2", "--out", "ROOT/r.jsonl"], "put {rank} in the name"),
    "unwritable out": (["M", "--out", "/nonexistent-dir/results.jsonl"], "--out /nonexistent-dir/results.jsonl can't be written"),
    "out is a directory": (["M", "--out", "ROOT"], "is a directory"),
    "bad format": (["M", "--format", "xml"], "--format: expected one of table, json, csv"),
    "bad prompt style": (["M", "--prompt-style", "fancy"], "--prompt-style: expected one of default, paper"),
    "limit 0": (["M", "--limit", "0"], "--limit: expected an integer >= 1"),
    "hf-assisted sampling": (["M", "--drafters", "hf-assisted", "--temperature", "0.5"], "hf-assisted runs greedy only"),
    "hf-assisted tree": (["M", "--drafters", "hf-assisted", "--tree-width", "2"], "hf-assisted drafts a constant-γ chain"),
    "hf-assisted schedule": (["M", "--drafters", "ar,hf-assisted", "--gamma-schedule", "heuristic"],
                             "hf-assisted drafts a constant-γ chain"),
    "ssd without layer": (["M", "--drafters", "ar,ssd"], "run `mmspec select-layer"),
    "tree width 9": (["M", "--tree-width", "9"], "--tree-width: expected an integer between 1 and 8, got 9"),
    "no source": ([], "no SOURCE given"),
    "resume without out": (["M", "--resume"], "--resume continues an --out file"),
    "source and summarize": (["M", "--summarize", "M"], "not both"),
    "unknown dataset subset": (["lmms-lab/LMMs-Eval-Lite"], "needs a subset"),
}


@pytest.mark.parametrize("case", BAD_ARGS)
def test_bad_arguments_are_one_line_before_loading(files, no_model_loading, case, monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    args, fragment = BAD_ARGS[case]
    args = [{"M": files["manifest"], "ROOT": str(files["root"])}.get(a, a) for a in args]
    assert_one_line_error(bench(files, *args), fragment)


@pytest.mark.parametrize("case", ["malformed line", "missing field", "duplicate id", "empty", "bad history",
                                  "binary file", "plain text"])
def test_bad_manifests_are_one_line_with_the_line_number(files, no_model_loading, case):
    path, fragment = _bad_manifests(files["root"])[case]
    result = bench(files, path)
    assert_one_line_error(result, "")
    assert re.search(fragment, result.stderr), result.stderr


def test_an_image_as_source_is_one_line_before_loading(files, no_model_loading):
    """Not a UnicodeDecodeError of a "manifest": the image is named, with what SOURCE takes."""
    assert_one_line_error(bench(files, files["images"][0]), "is an image, and a SOURCE is a set of samples")


@pytest.mark.parametrize("source", ["", "  "])
def test_an_empty_source_is_one_line_not_the_current_folder(source, tmp_path, monkeypatch):
    """``Path("")`` is the current folder: train-head once trained on the ``mmspec.jsonl`` it found there."""
    (tmp_path / "mmspec.jsonl").write_text("")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InputError, match="^SOURCE is empty; pass a JSONL manifest"):
        resolve(source)


def test_results_file_keeps_only_complete_lines(tmp_path):
    path = tmp_path / "r.jsonl"
    complete = ('{"id": "a", "category": "c", "turn": 0, "drafter": "ar", "token_ids": [1], "new_tokens": 1, '
                '"blocks": 1, "wall_s": 0.1}')
    path.write_text(complete + '\n{"id": "b", "tu')
    assert [r["id"] for r in records_mod.read_records([path])] == ["a"]
    path.write_text(complete + '\nnot json\n')
    with pytest.raises(InputError, match="line 2 is not valid JSON"):
        records_mod.read_records([path])
    path.write_text('{"id": "a", "turn": 0, "drafter": "ar"}\n')  # a record without its numbers: one line, no KeyError
    with pytest.raises(InputError, match="line 1 lacks category, token_ids, new_tokens, blocks, wall_s"):
        records_mod.read_records([path])


def test_text_only_samples_run(files, tmp_path):
    manifest = write_jsonl(tmp_path / "m.jsonl", [
        {"id": "text", "images": [], "turns": ["tell me a story"], "category": "nlp"}])
    result = bench(files, manifest, "--drafters", "ar", "--out", str(tmp_path / "r.jsonl"), "--format", "json")
    assert result.exit_code == 0, result.stderr
    assert [r["samples"] for r in json.loads(result.stdout)["rows"] if r["category"] == "nlp"] == [1]


def test_missing_image_files_are_one_line_before_loading(files, tmp_path, no_model_loading):
    """In any turn: not a failed sample found after the models load, with exit 1 and its reason on stdout."""
    later = {"id": "later", "images": [files["images"][0]], "category": "c",
             "turns": ["what?", {"question": "and this one?", "images": ["missing.png"]}]}
    out = tmp_path / "r.jsonl"
    result = bench(files, write_jsonl(tmp_path / "m.jsonl", [later]), "--out", str(out))
    assert_one_line_error(result, "sample 'later' turn 2: image '")
    assert "missing.png' does not exist; check the path" in result.stderr
    assert not out.exists()  # the run made it, and leaves nothing behind
    opening = dict(later, id="opening", images=["gone.png"], turns=["what?"])
    both = bench(files, write_jsonl(tmp_path / "both.jsonl", [opening, later]))
    assert_one_line_error(both, "sample 'opening': image")
    assert "(and 1 more image missing)" in both.stderr


@pytest.fixture(scope="module")
def qwen_target(tmp_path_factory) -> str:
    """A tiny Qwen2-VL target saved as a hub repository holds it (``tests/tiny_qwen.py``)."""
    from tests import tiny_qwen

    tokenizer = tiny_qwen.train_tokenizer()
    model = tiny_qwen.make_model("qwen2_vl", len(tokenizer), seed=0)
    return tiny_qwen.save(model, tiny_qwen.make_processor("qwen2_vl", tokenizer),
                          tmp_path_factory.mktemp("qwen") / "target")


def test_paper_prompts_are_refused_for_a_qwen_target_before_loading(files, qwen_target, tmp_path, no_model_loading):
    profile = write_profile(tmp_path / "qwen.yaml", qwen_target, qwen_target)
    result = runner.invoke(app, ["bench", files["manifest"], "--profile", profile, "--prompt-style", "paper"])
    assert_one_line_error(result, "--prompt-style paper: TABED's prompts are written for LLaVA-1.5, but the target "
                                  f"{str(qwen_target)[:20]}")
    assert "is a Qwen-VL model (qwen2_vl) that reads its own chat template; use --prompt-style default" in result.stderr


def test_paper_prompts_are_refused_for_a_qwen_target_once_loaded(files, qwen_target, tmp_path, monkeypatch):
    """A hub target whose config.json was not downloaded yet is known once it loads, before any sample runs."""
    from mmspec_cli.models import loading

    monkeypatch.setattr(loading, "model_type_on_disk", lambda spec: None)
    profile = write_profile(tmp_path / "qwen.yaml", qwen_target, qwen_target)
    out = tmp_path / "r.jsonl"
    result = runner.invoke(app, ["bench", files["manifest"], "--profile", profile, "--prompt-style", "paper",
                                 "--drafters", "ar", "--out", str(out)])
    assert_one_line_error(result, "is a Qwen-VL model (qwen2_vl)")
    assert not out.exists()


def test_pil_images_from_datasets_load(tmp_path):
    from mmspec_cli.inputs.samples import load_sample_images

    gray = Image.new("L", (8, 8))
    assert load_sample_images(Sample("x", "c", ("q",), (gray,)))[0].mode == "RGB"


def test_built_in_demo_suites_run_and_are_deterministic(files, tmp_path):
    from mmspec_cli.inputs.sources import DEMO_SUITES
    from mmspec_cli.demo.tasks import DEFAULT_SUITE_SIZE, suite

    first, again = resolve("demo-story"), resolve("demo-story")
    assert [s.id for s in first] == [s.id for s in again] and len(first) == DEFAULT_SUITE_SIZE
    assert all(len(s.images) == 5 and s.category == "demo-story" for s in first)
    assert first[0].images[0].tobytes() == again[0].images[0].tobytes()
    assert len(resolve("demo-all")) == 4 * DEFAULT_SUITE_SIZE
    # a follow-up measures its second turn; the first is given with its reference answer
    followups, conversations = resolve("demo-followup"), suite("demo-followup")
    assert all(s.history == (c.turns[0],) and s.turns == (c.turns[1][0],) for s, c in zip(followups, conversations))
    assert all(s.history == () for s in first)
    assert [s.category for s in resolve("demo-all", 2)] == [c for c in DEMO_SUITES for _ in range(2)]
    result = bench(files, "demo-all", "--drafters", "ar,m", "--limit", "1", "--format", "json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)  # --limit 1 on demo-all: one sample of every suite
    assert {r["category"] for r in summary["rows"]} == {*DEMO_SUITES, "all"}

# --------------------------------------------------------------------------- a full disk, two writers, Ctrl-C, Eq. (1)
# with the default profile, plurals


CLI = [sys.executable, "-c", "from mmspec_cli.cli.app import main; main()"]
# one thread per process: two processes on a 2-core machine, and steady timings
SUBPROCESS_ENV = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")


def keys(path: Path) -> list[tuple]:
    return [(r["id"], r["turn"], r["drafter"]) for r in records_mod.read_records([path])]


def no_traceback(result) -> None:
    """The error was mapped to its exit code, not raised (under CliRunner an unmapped one lands in ``exception``)."""
    assert "Traceback" not in result.stderr and isinstance(result.exception, SystemExit), result.exception


# --------------------------------------------------------------------------- a full disk


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


# --------------------------------------------------------------------------- two writers of one file


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


# --------------------------------------------------------------------------- Ctrl-C


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


# --------------------------------------------------------------------------- Eq. (1) with the default profile


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


# --------------------------------------------------------------------------- plurals


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


# --------------------------------------------------------------------------- bench --out after a failure


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
