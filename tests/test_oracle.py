"""``oracle``, the benchmarking drafter: it replays a first ``ar`` run, so every draft is accepted at no drafting cost."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from mmspec_cli.cli.app import app
from mmspec_cli.decoding.sampling import SamplingParams, TokenPicker
from mmspec_cli.drafters.oracle import OracleDrafter

from tests import tiny
from tests.helpers import QUESTION, assert_one_line_error, decode, speculative_decoder, tiny_files

runner = CliRunner()
FOLLOW_UP = "and how many shapes are there?"


@pytest.fixture(scope="module")
def files(tiny_dirs, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("oracle")
    found = tiny_files(root, tiny_dirs, max_new_tokens=20)
    manifest = root / "manifest.jsonl"
    manifest.write_text("".join(json.dumps({"id": f"s{i}", "images": [found["images"][i % 2]],
                                            "turns": [QUESTION, FOLLOW_UP], "category": "demo"}) + "\n"
                                for i in range(2)))
    return {**found, "manifest": str(manifest)}


def test_every_draft_is_accepted_and_the_output_is_ars(tiny_models):
    target = tiny_models["target"]
    ar = decode(target, "ar", questions=[QUESTION, FOLLOW_UP], max_new_tokens=20, gamma=4)
    recorded = [turn.token_ids for turn in ar.turns]
    oracle = speculative_decoder(target, OracleDrafter(recorded), gamma=4, max_new_tokens=20)
    generation = oracle.generate(tiny.images(1), [QUESTION, FOLLOW_UP])
    assert [turn.token_ids for turn in generation.turns] == recorded
    for turn in generation.turns:
        assert turn.stats.acceptance_rate == 1.0
        assert all(len(block.tokens) == 5 for block in turn.blocks[:-1])  # γ + 1 tokens a block
        assert turn.stats.blocks == -(-len(turn.token_ids) // 5)


def test_off_the_recording_it_proposes_nothing():
    from mmspec_cli.decoding.drafter import DraftShape, TurnStart
    from mmspec_cli.models.prompts import ModelPrompt

    drafter = OracleDrafter([[7, 8, 9, 10]])
    drafter.begin_turn(TurnStart("prompt", [], None, 0, ModelPrompt(ids=[])))
    greedy = TokenPicker(SamplingParams())
    assert drafter.propose([7], DraftShape(2), greedy).tokens == [8, 9]
    assert drafter.propose([7, 8, 9], DraftShape(5), greedy).tokens == [10]
    assert drafter.propose([7, 8, 99], DraftShape(2), greedy).tokens == []  # the target's token left the recording
    assert drafter.propose([7, 8, 99, 10], DraftShape(2), greedy).tokens == []  # and it stays off for the turn
    drafter.begin_turn(TurnStart("a turn it has no recording of", [], None, 0, ModelPrompt(ids=[])))
    assert drafter.propose([], DraftShape(3), greedy).tokens == []


def test_generate_runs_ar_first_and_replays_it(files):
    result = runner.invoke(app, ["generate", files["images"][0], "-q", QUESTION, "--drafter", "oracle",
                                 "--profile", files["profile"], "--gamma", "4", "--json"])
    assert result.exit_code == 0, result.stderr
    assert "note: oracle replays the target's output of a first ar run" in result.stderr
    oracle = json.loads(result.stdout)["turns"][0]
    ar = runner.invoke(app, ["generate", files["images"][0], "-q", QUESTION, "--drafter", "ar",
                             "--profile", files["profile"], "--json"])
    assert oracle["token_ids"] == json.loads(ar.stdout)["turns"][0]["token_ids"]
    assert oracle["stats"]["acceptance_rate"] == 1.0


def test_bench_replays_ar_sample_by_sample_and_on_resume(files, tmp_path):
    out = tmp_path / "oracle.jsonl"
    args = ["bench", files["manifest"], "--profile", files["profile"], "--out", str(out), "--no-warmup",
            "--format", "json"]
    result = runner.invoke(app, args + ["--drafters", "ar,oracle"])
    assert result.exit_code == 0, result.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    by_key = {(r["id"], r["turn"], r["drafter"]): r for r in records}
    assert len(records) == 2 * 2 * 2
    for (sample, turn, drafter), record in by_key.items():
        if drafter == "oracle":
            assert record["token_ids"] == by_key[(sample, turn, "ar")]["token_ids"]
            assert record["acceptance_rate"] == 1.0
    kept = [line for line in out.read_text().splitlines() if json.loads(line)["drafter"] == "ar"]
    out.write_text("".join(line + "\n" for line in kept))  # the oracle's records lost: --resume replays ar's file
    result = runner.invoke(app, args + ["--drafters", "ar,oracle", "--resume"])
    assert result.exit_code == 0, result.stderr
    resumed = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted((r["id"], r["turn"], r["drafter"]) for r in resumed) == sorted(by_key)
    summary = runner.invoke(app, ["bench", "--summarize", str(out), "--format", "json", "--profile", files["profile"]])
    rows = [r for r in json.loads(summary.stdout)["rows"] if r["drafter"] == "oracle"]
    assert rows and all(r["expected_speedup"] is None and r["acceptance_rate"] == 1.0 for r in rows)
    assert "oracle" not in summary.stderr  # no Eq. (1), and no note asking for a latency it has no use for


@pytest.mark.parametrize("command, args, fragment", [
    ("generate", ["--drafter", "oracle", "--temperature", "0.7"], "run it with --temperature 0"),
    ("generate", ["--drafter", "oracle", "--tree", "dynamic"], "drafts chains"),
    ("bench", ["--drafters", "m,oracle"], "list ar before it"),
    ("bench", ["--drafters", "oracle,ar"], "list ar before it"),
    ("compare", ["--drafters", "oracle,m"], "list ar before it"),
    ("compare", ["--drafters", "ar,oracle", "--tree-width", "2"], "drafts chains")])
def test_what_the_oracle_cant_do_is_refused_before_loading(files, no_model_loading, command, args, fragment):
    inputs = [files["manifest"]] if command == "bench" else [files["images"][0], "-q", QUESTION]
    result = runner.invoke(app, [command, *inputs, "--profile", files["profile"], *args])
    assert_one_line_error(result, fragment)
