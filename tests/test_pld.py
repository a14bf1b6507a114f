"""``pld``, prompt-lookup decoding: the lookup rule on its pure function and against Hugging Face's candidate
generator, the n-gram index against that rule, the drafter end to end (greedy output is the target's own, sampling
proposes point masses), and what it refuses or runs through the CLI without a draft model."""

from __future__ import annotations

import json
import random

import pytest
import torch
import yaml
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator
from typer.testing import CliRunner

from mmspec_cli.cli.app import app
from mmspec_cli.decoding.drafter import DraftShape, TurnStart
from mmspec_cli.decoding.sampling import SamplingParams, TokenPicker
from mmspec_cli.drafters.pld import NgramIndex, PromptLookupDrafter, cut_before, lookup
from mmspec_cli.models.prompts import process, render_prompt

from tests import tiny
from tests.helpers import QUESTION, assert_one_line_error, decode, own_generate, save_images

runner = CliRunner()
GREEDY = TokenPicker(SamplingParams())
#: A question the tiny target answers by repeating a phrase of its own answer, so lookups get accepted.
STORY = "finish the story: the cat sat on the mat, then it jumped over the fence and ran away."


# --------------------------------------------------------------------------- the rule


def test_the_first_occurrence_of_the_largest_matching_ngram_gives_the_draft():
    #            0  1  2  3  4  5  6  7  8  9
    sequence = [5, 6, 7, 8, 5, 6, 9, 4, 7, 5, 6]  # tail (5, 6): first at 0, again at 4
    assert lookup(sequence, 3) == [7, 8, 5]  # after the FIRST occurrence, not the most recent (4: 9, 4, 7)
    assert lookup(sequence, 2) == [7, 8]  # cut to γ
    assert lookup([1, 2, 3, 1, 2], 5) == [3, 1, 2]  # cut to what the match offers
    assert lookup([4, 9, 4, 8, 9], 3) == [4, 8, 9]  # no 2-gram (8, 9) earlier: the 1-gram (9) at 1
    assert lookup([3, 1, 2, 3, 4, 2, 3], 2) == [4, 2]  # the 2-gram (2, 3) wins over the earlier 1-gram (3) at 0
    assert lookup([1, 2, 3, 4], 3) == []  # no match: an empty draft
    assert lookup([1, 1], 3) == [1]  # the tail's own window has nothing after it; the one before does
    assert lookup([7], 3) == [] and lookup([], 3) == []
    assert lookup([1, 2, 3, 9, 2, 3, 1, 2, 3], 2, max_ngram=3, min_ngram=3) == [9, 2]  # vLLM-style sizes [3, 3]
    assert lookup([1, 2, 9, 1, 2], 2, max_ngram=3, min_ngram=3) == []  # no 3-gram, and 2 is below min


def test_the_rule_is_hugging_faces_prompt_lookup():
    """Hugging Face's own candidate generator at its defaults (2-grams first, EOS cut) proposes the same tokens."""
    rng = random.Random(0)
    eos = 2
    for _ in range(300):
        sequence = [rng.randrange(6) for _ in range(rng.randrange(2, 40))]
        gamma = rng.randrange(1, 8)
        hf = PromptLookupCandidateGenerator(eos_token_id=torch.tensor([eos]), num_output_tokens=gamma,
                                            max_length=10_000)
        candidates, _ = hf.get_candidates(torch.tensor([sequence]))
        assert cut_before(lookup(sequence, gamma), {eos}) == candidates[0, len(sequence):].tolist(), sequence


@pytest.mark.parametrize("max_ngram, min_ngram", [(2, 1), (3, 1), (5, 5), (4, 2)])
def test_the_index_proposes_what_the_rule_does(max_ngram, min_ngram):
    """Built once over a "prompt" and extended a few tokens at a time, the index gives the brute-force proposal
    after every extension."""
    rng = random.Random(max_ngram * 10 + min_ngram)
    for _ in range(60):
        alphabet = rng.randrange(2, 8)
        sequence = [rng.randrange(alphabet) for _ in range(rng.randrange(0, 30))]
        index = NgramIndex(max_ngram, min_ngram)
        index.extend(sequence)
        for _ in range(8):
            gamma = rng.randrange(1, 7)
            assert index.lookup(gamma) == lookup(sequence, gamma, max_ngram, min_ngram), (sequence, gamma)
            new = [rng.randrange(alphabet) for _ in range(rng.randrange(1, 4))]
            sequence += new
            index.extend(new)


def test_a_draft_stops_before_an_eos():
    assert cut_before([4, 5, 2, 6], {2}) == [4, 5]
    assert cut_before([2, 6], {2}) == [] and cut_before([4, 5], {2}) == [4, 5]


# --------------------------------------------------------------------------- the drafter


def start(target, question: str = QUESTION, images: int = 1) -> tuple[PromptLookupDrafter, list[int]]:
    """A pld drafter over ``target`` at the start of a turn asking ``question``; the prompt's ids as the target
    sees them."""
    text = render_prompt(target.processor, [question], [], [images])
    shown = tiny.images(images)
    drafter = PromptLookupDrafter(target)
    prompt = process(target.processor, text, shown)
    drafter.begin_turn(TurnStart(text, shown, None, 0, prompt))
    return drafter, prompt.ids


def test_it_searches_the_prompt_as_the_target_sees_it_and_never_proposes_an_image_placeholder(tiny_models):
    target = tiny_models["target"]
    drafter, prompt = start(target)
    image = target.image_token_id
    assert prompt.count(image) > 1  # the expanded placeholders are part of what is searched
    before = prompt.index(image)
    verified = prompt[before - 2:before]  # the 2 tokens before the images: the lookup continues into them
    assert lookup(prompt + verified, 3)[0] == image
    assert drafter.propose(verified, DraftShape(3), GREEDY).tokens == []
    after = prompt[before + prompt.count(image):]
    verified = [*verified, image, after[0], after[1]]  # ...; (after[0], after[1]) continues with the prompt's text
    assert drafter.propose(verified, DraftShape(3), GREEDY).tokens == lookup(prompt + verified, 3)
    assert drafter.propose(verified, DraftShape(3), GREEDY).tokens == after[2:5]


def test_greedy_output_is_the_targets_own_and_drafts_get_accepted(tiny_models):
    target = tiny_models["target"]
    generation = decode(target, "pld", questions=[STORY], max_new_tokens=24, gamma=4)
    [turn] = generation.turns
    assert turn.token_ids == own_generate(target, [STORY], [], [1], tiny.images(1), 24)
    assert turn.stats.accepted > 0 and turn.stats.blocks < len(turn.token_ids)


def test_sampling_proposes_point_masses_over_the_targets_vocabulary(tiny_models):
    target = tiny_models["target"]
    drafter, prompt = start(target)
    sampling = TokenPicker(SamplingParams(temperature=0.8), seed=0)
    verified = prompt[-3:-1]  # a 2-gram of the prompt: the lookup copies what followed it
    draft = drafter.propose(verified, DraftShape(4), sampling)
    assert draft.tokens and draft.probs.shape == (len(draft.tokens), target.vocab_size)
    assert torch.equal(draft.probs.sum(-1), torch.ones(len(draft.tokens), dtype=draft.probs.dtype))
    assert draft.probs.argmax(-1).tolist() == draft.tokens
    assert drafter.propose(verified, DraftShape(4), GREEDY).probs is None
    generation = decode(target, "pld", questions=[STORY], max_new_tokens=16, gamma=4,
                        sampling=SamplingParams(temperature=0.8), seed=1)
    assert 0 < len(generation.turns[0].token_ids) <= 16


# --------------------------------------------------------------------------- through the CLI


@pytest.fixture(scope="module")
def files(tiny_dirs, tmp_path_factory) -> dict:
    """A profile with the tiny target and NO draft model (pld needs none), an image, a two-sample manifest."""
    root = tmp_path_factory.mktemp("pld")
    images = save_images(root, 1)
    profile = root / "target-only.yaml"
    profile.write_text(yaml.safe_dump({"target": {"model": tiny_dirs["target"], "dtype": "float64", "device": "cpu"},
                                       "decoding": {"max_new_tokens": 12, "gamma": 3}}))
    manifest = root / "manifest.jsonl"
    samples = [{"id": f"s{i}", "images": [images[0]], "turns": [question], "category": "demo"}
               for i, question in enumerate([STORY, QUESTION])]
    manifest.write_text("".join(json.dumps(sample) + "\n" for sample in samples))
    return {"images": images, "profile": str(profile), "manifest": str(manifest), "root": root}


def test_bench_runs_pld_beside_ar_without_a_draft_model(files):
    out = files["root"] / "bench.jsonl"
    result = runner.invoke(app, ["bench", files["manifest"], "--profile", files["profile"], "--drafters", "ar,pld",
                                 "--out", str(out), "--no-warmup", "--format", "json"])
    assert result.exit_code == 0, result.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    by_key = {(r["id"], r["drafter"]): r for r in records}
    assert sorted(by_key) == [(s, d) for s in ("s0", "s1") for d in ("ar", "pld")]
    for sample in ("s0", "s1"):
        assert by_key[(sample, "pld")]["token_ids"] == by_key[(sample, "ar")]["token_ids"]
    assert by_key[("s0", "pld")]["accepted"] > 0
    assert "Eq. (1)" not in result.stderr  # pld runs no draft step: c = 0, no latency ratio asked for or priced


def test_compare_runs_pld_without_a_draft_model(files):
    result = runner.invoke(app, ["compare", files["images"][0], "-q", STORY, "--profile", files["profile"],
                                 "--drafters", "ar,pld", "--json"])
    assert result.exit_code == 0, result.stderr
    shown = json.loads(result.stdout)
    assert shown["identical"] and [d["drafter"] for d in shown["drafters"]] == ["ar", "pld"]
    assert shown["drafters"][1]["turns"][0]["stats"]["acceptance_rate"] > 0


@pytest.mark.parametrize("command, args, fragment", [
    ("generate", ["--drafter", "pld", "--tree", "dynamic"], "pld drafter drafts chains"),
    ("generate", ["--drafter", "pld", "--tree-width", "2"], "pld drafter drafts chains"),
    ("bench", ["--drafters", "ar,pld", "--tree", "width", "--tree-width", "3"], "pld drafter drafts chains"),
    ("compare", ["--drafters", "ar,pld", "--tree", "dynamic"], "pld drafter drafts chains"),
    ("generate", ["--drafter", "tabed:mpld"], "pld can't be an ensemble member"),
    ("bench", ["--drafters", "ar,mpld"], "pld can't be an ensemble member"),
    ("generate", ["--drafter", "pdl"], "pld"),  # a typo is told the drafter names
])
def test_what_pld_cant_do_is_refused_before_loading(files, no_model_loading, command, args, fragment):
    inputs = [files["manifest"]] if command == "bench" else [files["images"][0], "-q", QUESTION]
    result = runner.invoke(app, [command, *inputs, "--profile", files["profile"], *args])
    assert_one_line_error(result, fragment)
