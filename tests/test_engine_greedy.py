"""Greedy speculative decoding must reproduce the target's own ``generate`` token for token."""

from __future__ import annotations

import pytest
import torch

from tests import tiny
from mmspec_cli.models.prompts import render_prompt
from tests.helpers import FOLLOW_UP, QUESTION, decode, generate_from_text, reference, speculative_decoder


@pytest.fixture(scope="module")
def refs(tiny_models):
    return {n: reference(tiny_models["target"], [QUESTION], [], n) for n in (0, 1, 2)}


@pytest.mark.parametrize("drafter", ["ar", "m", "t"])
@pytest.mark.parametrize("gamma", [1, 3, 5])
@pytest.mark.parametrize("n_images", [0, 1, 2])
def test_greedy_equals_target_generate(tiny_models, refs, drafter, gamma, n_images):
    generation = decode(tiny_models["target"], drafter, tiny_models["perturbed"], gamma=gamma, n_images=n_images)
    assert generation.turns[0].token_ids == refs[n_images]


@pytest.mark.parametrize("draft, expect", [("same", "all"), ("random", "none"), ("perturbed", "some")])
@pytest.mark.parametrize("drafter", ["m", "t"])
def test_lossless_whatever_the_draft_quality(tiny_models, refs, draft, expect, drafter):
    turn = decode(tiny_models["target"], drafter, tiny_models[draft], gamma=5).turns[0]
    assert turn.token_ids == refs[1]
    rate = turn.stats.acceptance_rate
    if expect == "all" and drafter == "m":  # the target drafting for itself, with the same images
        assert rate == 1.0
    elif expect == "none":
        assert rate < 0.2
    elif expect == "some" and drafter == "m":
        assert 0.0 < rate < 1.0


@pytest.mark.parametrize("drafter, kv", [("m", "dynamic"), ("m", "static"), ("tabed", "static")])
def test_a_block_enters_inference_mode_once_whatever_it_calls(tiny_models, monkeypatch, drafter, kv):
    """A block runs under one ``torch.inference_mode``: the calls it makes (the target's forward, the draft's chain,
    each rollback, an ensemble's rows) find the mode on instead of entering it again (``decoding.inference``)."""
    entries = []
    enter = torch.inference_mode.__enter__

    def counted(self):
        if self.mode:  # an entry that turns the mode on (batched rows leave it for one buffer on purpose)
            entries.append(self)
        return enter(self)

    monkeypatch.setattr(torch.inference_mode, "__enter__", counted)
    decoder = speculative_decoder(tiny_models["target"], drafter, tiny_models["perturbed"], gamma=3, kv=kv)
    per_block = []
    for event in decoder.stream(tiny.images(1), [QUESTION]):
        per_block.append(len(entries))
        entries.clear()
    later_blocks = per_block[2:-1]  # after the turn's start and its first block, before the turn's end
    assert later_blocks and set(later_blocks) == {1}, per_block
    assert decoder.generate(tiny.images(1), [QUESTION]).turns[0].token_ids == reference(
        tiny_models["target"], [QUESTION], [], 1)


def test_block_statistics_are_consistent(tiny_models):
    turn = decode(tiny_models["target"], "m", tiny_models["perturbed"], gamma=4).turns[0]
    assert sum(len(b.tokens) for b in turn.blocks) == turn.stats.new_tokens == len(turn.token_ids)
    assert turn.stats.blocks == len(turn.blocks)
    assert turn.stats.block_efficiency == pytest.approx(turn.stats.new_tokens / turn.stats.blocks)
    for block in turn.blocks:
        assert len(block.draft) <= 4
        assert block.tokens[: block.accepted] == block.draft[: block.accepted]
        assert 1 <= len(block.tokens) <= len(block.draft) + 1


def test_max_new_tokens_is_exact_at_a_block_boundary(tiny_models):
    ref = reference(tiny_models["target"], [QUESTION], [], 1, max_new_tokens=7)
    turn = decode(tiny_models["target"], "m", tiny_models["same"], gamma=5, max_new_tokens=7).turns[0]
    assert turn.token_ids == ref and len(ref) == 7
    assert [len(b.draft) for b in turn.blocks] == [5, 0]  # γ shrinks so the last block cannot overshoot


def test_eos_inside_a_block_ends_the_turn(tiny_models, refs, monkeypatch):
    ref = refs[1]
    k = next(i for i in range(2, len(ref)) if ref[i] not in ref[:i])  # a token first seen at position k
    monkeypatch.setattr(tiny_models["target"].model.generation_config, "eos_token_id", ref[k])
    expected = reference(tiny_models["target"], [QUESTION], [], 1)
    assert expected == ref[: k + 1]
    turn = decode(tiny_models["target"], "m", tiny_models["same"], gamma=8).turns[0]
    assert turn.token_ids == expected
    last = turn.blocks[-1]
    assert last.tokens[-1] == ref[k] and len(last.draft) > len(last.tokens) - 1  # cut inside the block


def test_two_turns_equal_generate_and_reuse_the_cache(tiny_models):
    target = tiny_models["target"]
    fed = []
    hook = target.model.register_forward_hook(lambda mod, args, kwargs, out: fed.append(kwargs["input_ids"].shape[1]),
                                              with_kwargs=True)
    try:
        generation = decode(target, "m", tiny_models["perturbed"], questions=(QUESTION, FOLLOW_UP))
    finally:
        hook.remove()
    first, second = generation.turns
    assert first.token_ids == reference(target, [QUESTION], [], 1)
    assert second.token_ids == reference(target, [QUESTION, FOLLOW_UP], [first.text], 1)
    turn2_prompt = render_prompt(target.processor, [QUESTION, FOLLOW_UP], [first.text], 1)
    turn2_len = len(target.processor(images=tiny.images(1), text=turn2_prompt)["input_ids"][0])
    first_call_of_turn2 = fed[first.stats.blocks]
    assert first_call_of_turn2 < turn2_len  # only the new part of the prompt was fed


def test_no_chat_template_falls_back_to_llava15_format(tiny_models):
    target = tiny_models["no_template"]
    text = render_prompt(target.processor, [QUESTION], [], 1)
    assert text == f"USER: <image>\n{QUESTION} ASSISTANT:"
    decoder = speculative_decoder(target, "t", tiny_models["perturbed"])
    assert decoder.generate(tiny.images(1), [QUESTION]).turns[0].token_ids == generate_from_text(target, text, tiny.images(1))


def test_raw_prompt_is_used_verbatim(tiny_models):
    target = tiny_models["target"]
    raw = "USER: <image>\n<image>\nCompare them. ASSISTANT:"
    decoder = speculative_decoder(target, "m", tiny_models["perturbed"])
    assert decoder.generate(tiny.images(2), [], raw_prompt=raw).turns[0].token_ids == generate_from_text(
        target, raw, tiny.images(2))


def test_text_only_view_replaces_each_image_by_one_newline(tiny_models):
    from mmspec_cli.models.prompts import newline_token_id, text_only_ids

    tok = tiny_models["target"].tokenizer
    text = "USER: <image><image>\nhi ASSISTANT:"
    ids = tok(text)["input_ids"]
    out = text_only_ids(tok, text, tiny.IMAGE_TOKEN_ID, 2)
    newline = newline_token_id(tok)
    assert len(out) == len(ids) and tiny.IMAGE_TOKEN_ID not in out
    assert [t for t, s in zip(out, ids) if s == tiny.IMAGE_TOKEN_ID] == [newline, newline]
    assert torch.tensor(out).ne(tiny.IMAGE_TOKEN_ID).all()


def test_a_reused_decoder_sees_the_new_image(tiny_models):
    """Placeholder ids are the same for every image: the cache must not keep the old image's positions."""
    target = tiny_models["target"]
    for name in ("m", "mt"):
        decoder = speculative_decoder(target, name, tiny_models["perturbed"])
        first, second = tiny.images(2)
        decoder.generate([first], [QUESTION])
        text = render_prompt(target.processor, [QUESTION], [], 1)
        own = generate_from_text(target, text, [second])
        assert decoder.generate([second], [QUESTION]).turns[0].token_ids == own
        assert decoder.generate([first], [QUESTION]).turns[0].token_ids != own


def test_wall_time_does_not_count_the_consumers_time(tiny_models):
    """A slow consumer of the event stream (a live display) must not lower the reported tokens/s."""
    import time

    from mmspec_cli.decoding.events import TurnFinished

    target = tiny_models["target"]
    decoder = speculative_decoder(target, "m", tiny_models["perturbed"], max_new_tokens=12)
    start = time.perf_counter()
    for event in decoder.stream(tiny.images(1), [QUESTION]):
        time.sleep(0.05)
        if isinstance(event, TurnFinished):
            stats = event.result.stats
    elapsed = time.perf_counter() - start
    assert stats.blocks >= 3 and elapsed > 0.05 * stats.blocks
    assert stats.wall_s < elapsed - 0.05 * stats.blocks + 0.01


@pytest.mark.parametrize("tree", [{}, {"tree_width": 2}, {"tree": "dynamic", "tree_budget": 8, "tree_depth": 3,
                                                          "tree_topk": 3}])
def test_the_targets_repetition_penalty_is_applied_as_its_generate_applies_it(tiny_models, refs, monkeypatch, tree):
    """A generation_config with a repetition penalty (Qwen2.5-VL's publishes 1.05): chains and trees verify under it,
    and the output is the target's own ``generate``'s, which differs from the output without it."""
    target = tiny_models["target"]
    monkeypatch.setattr(target.model.generation_config, "repetition_penalty", 3.0)
    penalized = reference(target, [QUESTION], [], 1)
    assert penalized != refs[1]
    turn = decode(target, "m", tiny_models["perturbed"], gamma=4, **tree).turns[0]
    assert turn.token_ids == penalized and turn.stats.accepted > 0


def test_what_a_generation_config_asks_and_mmspec_does_not_apply_is_named():
    from transformers import GenerationConfig

    from mmspec_cli.api import unapplied_generation_settings

    assert unapplied_generation_settings(GenerationConfig(repetition_penalty=1.05, eos_token_id=2)) == {}
    assert unapplied_generation_settings(GenerationConfig(no_repeat_ngram_size=3)) == {"no_repeat_ngram_size": 3}


def test_the_repetition_penalty_is_computed_as_generate_computes_it_in_half_precision(tmp_path, monkeypatch):
    """generate casts a bfloat16 model's logits to float32 before its processors: a penalised logit must not be
    rounded back to bfloat16, where 10 / 1.05 = 9.5 ties another token (an LM head sharpened only 0.6x, so logits
    sit close). Measured when written, with the penalty computed in bfloat16: 3 of these 8 prompts differ."""
    from mmspec_cli.models.loading import load_model
    from mmspec_cli.models.profiles import ModelSpec
    from tests.helpers import own_generate

    tokenizer = tiny.train_tokenizer()
    folder = tiny.save(tiny.make_model(len(tokenizer), seed=0, sharpen=0.6), tiny.make_processor(tokenizer),
                       tmp_path / "bf16")
    target = load_model(ModelSpec(model=folder, dtype="bfloat16", device="cpu"), "target")
    monkeypatch.setattr(target.model.generation_config, "repetition_penalty", 1.05)
    images = tiny.images(1)
    for question in ("what is in the image?", "how many shapes are there?", "what colour is the circle?",
                     "describe it", "is there a square?", "count the dots", "what is left of the star?",
                     "name the shapes"):
        ours = speculative_decoder(target, "ar", max_new_tokens=48).generate(images, [question]).turns[0]
        assert ours.token_ids == own_generate(target, [question], [], 1, images, 48), question
