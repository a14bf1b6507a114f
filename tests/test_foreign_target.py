"""A target this project did not make can emit any token of its vocabulary, its own image placeholder id included.

The target here is a random tiny LLaVA whose LM head makes the placeholder id its most likely token at
most positions (and with a context of 4096, so the commands' defaults fit). ``train-head`` must run at its
defaults on it and count such answers; multi-turn decoding must stay the target's own output when the
earlier answers (which later prompts carry) hold the placeholder.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import yaml
from typer.testing import CliRunner

from mmspec_cli.cli.app import app
from mmspec_cli.models.prompts import process, render_prompt

from tests import tiny
from tests.conftest import load
from tests.helpers import decode, generate_from_text, own_generate, save_images

runner = CliRunner()
QUESTIONS = ["what is in the image?", "how many shapes are there?"]
IMAGE_ID = tiny.IMAGE_TOKEN_ID


def emitter(tokenizer, processor, seed: int):
    """A random tiny LLaVA whose LM head row of the placeholder follows its own mean final hidden state, so greedy
    decoding emits the placeholder mostly and sampling often."""
    model = tiny.make_model(len(tokenizer), seed=seed)
    model.config.text_config.max_position_embeddings = 4096
    prompt = process(processor, render_prompt(processor, QUESTIONS[:1], [], 1), tiny.images(1))
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt.ids]), output_hidden_states=True, **prompt.vision)
        mean = out.hidden_states[-1][0].mean(0)
        top = out.logits[0].max(-1).values.mean()
        model.get_output_embeddings().weight[IMAGE_ID] = mean / mean.norm() ** 2 * (top + 0.3)
    return model


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("emitter")
    tokenizer = tiny.train_tokenizer()
    processor = tiny.make_processor(tokenizer)
    target = emitter(tokenizer, processor, seed=5)
    dirs = {"target": tiny.save(target, processor, root / "target"),
            "draft": tiny.save(tiny.perturbed_copy(target, 0.1, seed=6), processor, root / "draft")}
    spec = {"dtype": "float64", "device": "cpu"}
    profile = root / "emitter.yaml"
    profile.write_text(yaml.safe_dump({"target": {"model": dirs["target"], **spec},
                                       "draft": {"model": dirs["draft"], **spec},
                                       "decoding": {"max_new_tokens": 24}}))
    images = save_images(root, 2)
    manifest = root / "manifest.jsonl"
    manifest.write_text("".join(json.dumps({"id": f"s{i}", "images": [images[i % 2]], "turns": QUESTIONS,
                                            "category": "demo"}) + "\n" for i in range(3)))
    single = root / "single.jsonl"  # one question: at train-head's defaults an answer is 1,024 tokens
    single.write_text(json.dumps({"id": "one", "images": [images[0]], "turns": QUESTIONS[:1], "category": "demo"}) + "\n")
    return {"root": root, "profile": str(profile), "manifest": str(manifest), "single": str(single), **dirs,
            "models": {"target": load(dirs["target"], "target"), "draft": load(dirs["draft"], "draft")}}


def test_the_target_really_emits_its_placeholder(family):
    target = family["models"]["target"]
    out = own_generate(target, QUESTIONS[:1], [], 1, tiny.images(1), 12)
    assert IMAGE_ID in out


def test_train_head_runs_at_its_defaults_and_counts_placeholder_answers(family, tmp_path):
    """vispec at every default (answers sampled at temperature 1, 1,024 tokens, 20 epochs), then imitation on the
    same answers: before, re-reading prompt + answer with the pixels asked for one image per placeholder."""
    out = tmp_path / "vispec"
    result = runner.invoke(app, ["train-head", "vispec", family["single"], "--out", str(out),
                                 "--profile", family["profile"], "--json"])
    assert result.exit_code == 0, (result.stderr, result.exception)
    report = json.loads(result.stdout)
    answers = [json.loads(line) for line in (tmp_path / "vispec.answers.jsonl").read_text().splitlines()[1:]]
    holding = sum(IMAGE_ID in a["answer_ids"] for a in answers if a["error"] is None)
    assert holding > 0 and report["placeholder_answers"] == holding
    assert f"{holding} of {report['sequences']} answers hold the target's image placeholder id" in result.stderr
    assert (out / "model.safetensors").is_file()

    imitation = tmp_path / "imitation"
    shutil.copy(tmp_path / "vispec.answers.jsonl", tmp_path / "imitation.answers.jsonl")  # the same answers, reused
    result = runner.invoke(app, ["train-head", "imitation", family["single"], "--out", str(imitation),
                                 "--ssd-layer", "1", "--profile", family["profile"], "--steps", "2", "--json"])
    assert result.exit_code == 0, (result.stderr, result.exception)
    assert json.loads(result.stdout)["placeholder_answers"] == holding


def test_train_head_reads_later_turns_whose_prompts_carry_placeholder_answers(family, tmp_path):
    """Two turns each (the second prompt carries the first answer), eagle, shorter answers and two steps."""
    result = runner.invoke(app, ["train-head", "eagle", family["manifest"], "--out", str(tmp_path / "eagle"),
                                 "--profile", family["profile"], "--answer-tokens", "48", "--steps", "2", "--json"])
    assert result.exit_code == 0, (result.stderr, result.exception)
    report = json.loads(result.stdout)
    assert report["turns"] == report["sequences"] == 6 and report["placeholder_answers"] > 0


@pytest.mark.parametrize("drafter", ["m", "t", "tabed"])
def test_later_turns_after_placeholder_answers_are_the_targets_own(family, drafter):
    """Turn 2's prompt carries turn 1's answer, full of placeholders; every drafter's output is still ``generate``'s."""
    target, draft = family["models"]["target"], family["models"]["draft"]
    first, second = decode(target, drafter, draft, questions=QUESTIONS, max_new_tokens=16).turns
    assert IMAGE_ID in first.token_ids
    for turn, answers in ((first, []), (second, [first.text])):
        text = render_prompt(target.processor, QUESTIONS, answers, 1)
        assert turn.token_ids == generate_from_text(target, text, tiny.images(1), 16)


def test_bench_over_two_turns_stays_lossless(family, tmp_path):
    out = tmp_path / "bench.jsonl"
    result = runner.invoke(app, ["bench", family["manifest"], "--drafters", "ar,m,t", "--profile", family["profile"],
                                 "--out", str(out), "--no-warmup", "--format", "json"])
    assert result.exit_code == 0, (result.stderr, result.exception)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 3 * 2 * 3 and not any(r.get("error") for r in records)
    by_turn: dict = {}
    for r in records:
        by_turn.setdefault((r["id"], r["turn"]), {})[r["drafter"]] = r["token_ids"]
    assert all(ids["m"] == ids["ar"] == ids["t"] for ids in by_turn.values())
    assert any(IMAGE_ID in ids["ar"] for ids in by_turn.values())
