"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL targets with a draft of the same family (same tokenizer).

The tiny families (``tests/tiny_qwen.py``) load through ``load_model`` like a hub id: the processor is
built from the image processor and the tokenizer (no torchvision here), every image is seen at its
native resolution (its vision token count follows its size), and the language model reads M-RoPE
positions whose offset after the images comes from the prompt. Greedy speculative decoding must
reproduce the target's own ``generate(do_sample=False)`` token for token, and the tests that break the
offset on purpose show that the position handling is what makes it so.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from PIL import Image
from typer.testing import CliRunner
from transformers.utils import is_torchvision_available

from mmspec_cli.cli.app import app
from mmspec_cli.decoding.compiled import compile_blocker, compiled_forward
from mmspec_cli.decoding.engine import SpeculativeDecoder
from mmspec_cli.decoding.kv import CachedModel
from mmspec_cli.drafters import build_drafter
from mmspec_cli.drafters import rows as rows_module
from mmspec_cli.drafters.head import HeadDrafter
from mmspec_cli.drafters.rows import BatchedRows
from mmspec_cli.drafters.views import multimodal_row, pooled_row
from mmspec_cli.errors import InputError, ModelLoadError
from mmspec_cli.models import families
from mmspec_cli.models.loading import check_compatible, load_model, with_pixel_bounds
from mmspec_cli.models.profiles import ModelSpec
from mmspec_cli.models.prompts import process, render_prompt, shrink_runs, text_only_ids
from mmspec_cli.models.positions import MRopePositions
from tests import tiny, tiny_qwen
from tests.conftest import load
from tests.distributions import ENGINE_RUNS, PARAMS, chi_square_p_value, exact_joint, sampled_pairs
from tests.helpers import (FOLLOW_UP, QUESTION, image_in_second_turn, own_generate, speculative_decoder, uncached_forward,
                           write_profile)
from tests.test_eagle3 import random_eagle3
from tests.test_heads import random_head

MAX_NEW = 16
FAMILIES = list(tiny_qwen.FAMILIES)
DYNAMIC = dict(tree="dynamic", tree_budget=10, tree_depth=3, tree_topk=2)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """Per family: the target and a perturbed copy as the draft, saved and loaded back through ``load_model``."""
    root = tmp_path_factory.mktemp("qwen")
    tokenizer = tiny_qwen.train_tokenizer()
    out = {}
    for family in FAMILIES:
        processor = tiny_qwen.make_processor(family, tokenizer)
        target = tiny_qwen.make_model(family, len(tokenizer), seed=0)
        draft = tiny.perturbed_copy(target, 0.3, seed=1)
        out[family] = {"target": load(tiny_qwen.save(target, processor, root / family), "target"),
                       "draft": load(tiny_qwen.save(draft, processor, root / f"{family}_draft"), "draft")}
    return out


def reference(target, questions, answers, images, max_new_tokens=MAX_NEW) -> list[int]:
    """:func:`~tests.helpers.own_generate` with every image in the first turn."""
    return own_generate(target, questions, answers, len(images), images, max_new_tokens)


@pytest.fixture(scope="module")
def refs(qwen):
    return {(family, n): reference(qwen[family]["target"], [QUESTION], [], tiny_qwen.images(n))
            for family in FAMILIES for n in (0, 1, 2)}


def first_turn(target, drafter, draft, images, gamma=4, **options):
    decoder = speculative_decoder(target, drafter, draft, gamma=gamma, max_new_tokens=MAX_NEW, **options)
    return decoder.generate(images, [QUESTION]).turns[0]


# --------------------------------------------------------------------------- loading and prompts


@pytest.mark.parametrize("family", FAMILIES)
def test_the_family_loads_through_from_pretrained(qwen, family):
    target = qwen[family]["target"]
    model_class, processor_class, _ = tiny_qwen.FAMILIES[family]
    assert type(target.model).__name__ == model_class
    assert type(target.processor).__name__ == processor_class
    assert getattr(target.processor, "images_only", False) is not is_torchvision_available()
    assert isinstance(families.family_of(target.model), families.QwenVLFamily)
    assert target.image_placeholder_ids == (tiny_qwen.VISION_START_ID, tiny_qwen.IMAGE_ID, tiny_qwen.VISION_END_ID)
    check_compatible(target, qwen[family]["draft"])


@pytest.mark.parametrize("family", FAMILIES)
def test_images_keep_their_native_resolution(qwen, family):
    """Each image's vision token count follows its size; the prompt's rope offset is negative (an image's
    tokens span fewer positions than there are tokens), so it is what every later position depends on."""
    target = qwen[family]["target"]
    text = render_prompt(target.processor, [QUESTION], [], 2)
    prompt = process(target.processor, text, tiny_qwen.images(2))
    grid = prompt.vision["image_grid_thw"]
    counts = (grid.prod(dim=1) // 4).tolist()  # merged 2×2
    assert counts[0] != counts[1] and prompt.ids.count(tiny_qwen.IMAGE_ID) == sum(counts)
    _, offset = families.family_of(target.model).prompt_positions(target.model, prompt.ids, prompt.vision, "cpu")
    assert offset < 0


def test_text_only_view_turns_each_image_span_into_one_newline(qwen):
    target = qwen["qwen2_vl"]["target"]
    tokenizer = target.tokenizer
    text = render_prompt(target.processor, [QUESTION], [], 2)
    ids = text_only_ids(tokenizer, text, target.image_placeholder_ids, 2)
    plain = tokenizer(text)["input_ids"]
    assert len(ids) == len(plain) - 2 * 3 + 2
    assert not {tiny_qwen.VISION_START_ID, tiny_qwen.IMAGE_ID, tiny_qwen.VISION_END_ID} & set(ids)


def test_mrope_positions_follow_the_offset():
    positions = MRopePositions(-8)
    assert positions.chain(45, 3).tolist() == [[[37, 38, 39]]] * 3
    tree = positions.tree(torch.tensor([[45], [40]]), torch.tensor([0, 1, 1]))
    assert tree.shape == (3, 2, 3) and tree[2].tolist() == [[37, 38, 38], [32, 33, 33]]


def test_pooling_averages_each_frames_merged_grid_in_raster_order():
    """A 1-frame image of 3×4 merged tokens (grid in patches: 6×8, merge 2) pooled 2×2 keeps 2×2 tokens, each the
    mean of the tokens its window covers; the windows over the odd edge cover one row."""
    family = families.QwenVLFamily(tiny_qwen.make_config("qwen2_vl", 400))
    grid = torch.tensor([[1, 6, 8]])
    features = torch.arange(12, dtype=torch.float64)[:, None].repeat(1, 2)  # token r·4 + c holds r·4 + c
    pooled = family.pool_image_features(features, grid[0], 2)
    expected = [(0 + 1 + 4 + 5) / 4, (2 + 3 + 6 + 7) / 4, (8 + 9) / 2, (10 + 11) / 2]
    assert pooled[:, 0].tolist() == expected and pooled.shape == (4, 2)
    assert family.pooled_grid(grid, 2).tolist() == [[1, 4, 4]] and family.pooled_token_counts(grid, 2) == [4]


def test_shrink_runs_cuts_each_images_run_to_its_own_count():
    assert shrink_runs([9, 6, 6, 6, 5, 4, 6, 6, 5], 6, [1, 2]) == [9, 6, 5, 4, 6, 6, 5]
    with pytest.raises(ValueError, match="more runs of token 6 than the 1 counts given"):
        shrink_runs([6, 1, 6], 6, [1])
    with pytest.raises(ValueError, match="1 runs of token 6 but 2 counts given"):
        shrink_runs([6, 6, 1], 6, [1, 1])


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_a_pooled_row_is_its_pooled_images_and_leaves_a_multimodal_row_beside_it_unchanged(qwen, family):
    """Pooled drafting for Qwen-VL: the row's logits are the draft's forward over the prompt with each image's
    features pooled 2×2 (computed here by hand) at the positions of a pooled image; an ``m`` row batched with it
    computes what it computes alone, though its features are then encoded by mmspec rather than by the model
    (Qwen3-VL: its DeepStack features too)."""
    draft = qwen[family]["draft"]
    model = draft.model
    if family == "qwen2_5_vl" and model.device.type == "cuda" and model.dtype == torch.float64:
        pytest.skip("torch has no float64 CUDA kernel for Qwen2.5-VL's patch convolution (slow_conv3d_forward); "
                    "this test runs float64")
    text = render_prompt(draft.processor, [QUESTION], [], 2)
    images = tiny_qwen.images(2)
    m_row, p_row = multimodal_row(draft)(text, images), pooled_row(draft, 2)(text, images)

    def prefix_logits(rows):
        batch = BatchedRows(model, draft.image_token_id)
        batch.begin(rows)
        return batch.prefix_logits

    both, alone_m, alone_p = prefix_logits([m_row, p_row]), prefix_logits([m_row]), prefix_logits([p_row])
    assert torch.allclose(both[0], alone_m[0], atol=1e-9) and torch.allclose(both[1], alone_p[0], atol=1e-9)
    assert not torch.allclose(alone_m[0], alone_p[0])
    if family == "qwen3_vl":
        return  # its DeepStack features have no by-hand reference here: the batch comparison above covers them
    grid = m_row.vision["image_grid_thw"]
    with torch.inference_mode():
        features = model.model.get_image_features(pixel_values=m_row.pixel_values, image_grid_thw=grid,
                                                  return_dict=True).pooler_output
        by_hand = []
        for f, (_, h, w) in zip(features, grid.tolist()):
            tokens = f.reshape(h // 2, w // 2, -1)
            for r in range(0, h // 2, 2):
                for c in range(0, w // 2, 2):
                    by_hand.append(tokens[r:r + 2, c:c + 2].reshape(-1, f.shape[-1]).mean(dim=0))
        ids = torch.tensor([p_row.ids])
        embeds = model.get_input_embeddings()(ids)
        embeds[ids == tiny_qwen.IMAGE_ID] = torch.stack(by_hand)
        pooled_grid = torch.tensor([[1, -(-h // 4) * 2, -(-w // 4) * 2] for _, h, w in grid.tolist()])
        positions, _ = model.model.get_rope_index(input_ids=ids, mm_token_type_ids=(ids == tiny_qwen.IMAGE_ID).int(),
                                                  image_grid_thw=pooled_grid)
        expected = model(inputs_embeds=embeds, position_ids=positions).logits[0, -1]
    assert torch.allclose(alone_p[0], expected, atol=1e-9)


# --------------------------------------------------------------------------- losslessness


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("n_images", [0, 1, 2])
@pytest.mark.parametrize("drafter,gamma", [("ar", 1), ("m", 1), ("m", 4), ("t", 1), ("t", 4), ("mt", 4), ("tabed", 1),
                                           ("tabed", 4), ("p", 4), ("mtp", 1)])
def test_greedy_equals_target_generate(qwen, refs, family, n_images, drafter, gamma):
    models = qwen[family]
    turn = first_turn(models["target"], drafter, models["draft"], tiny_qwen.images(n_images), gamma=gamma)
    assert turn.token_ids == refs[family, n_images]
    if drafter == "m" and gamma == 4 and n_images == 2:
        assert 0.0 < turn.stats.acceptance_rate < 1.0  # accepted and rejected drafts both seen


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case", ["m-width", "m-dynamic", "tabed-width", "mt-dynamic", "ssd", "ssd-width", "eagle",
                                  "vispec-dynamic", "eagle3-dynamic"])
def test_trees_ssd_and_heads_equal_target_generate(qwen, refs, family, case):
    """Token trees of both kinds put node i at the prefix + depth + δ on all three axes (batched rows: each row's
    own δ); ssd drafts in the target's own state (its offset included); a head reads the target's features over
    M-RoPE prompts."""
    models = qwen[family]
    target = models["target"]
    options = {"m-width": dict(tree_width=3), "m-dynamic": DYNAMIC, "tabed-width": dict(tree_width=2),
               "mt-dynamic": DYNAMIC, "ssd": {}, "ssd-width": dict(tree_width=2), "eagle": {},
               "vispec-dynamic": DYNAMIC, "eagle3-dynamic": DYNAMIC}[case]
    name = case.split("-")[0]
    if name == "eagle3":  # at the target's own M-RoPE positions (Qwen3-VL's interleaved)
        drafter = HeadDrafter(target, random_eagle3(target))
    elif name in ("eagle", "vispec"):
        drafter = HeadDrafter(target, random_head(target, name))
    else:
        drafter = build_drafter(name, target, models["draft"], ssd_layer=1)
    assert first_turn(target, drafter, None, tiny_qwen.images(2), **options).token_ids == refs[family, 2]


@pytest.fixture(scope="module")
def qwen3_one_layer(tmp_path_factory):
    """A Qwen3-VL target of one decoder layer, a perturbed copy as its draft, and the target's own ``generate`` with
    two images: the compiled tests' models. A graph costs seconds to compile per layer it holds, and one layer shows
    M-RoPE's positions and DeepStack's features as well as two."""
    root = tmp_path_factory.mktemp("qwen3_one_layer")
    tokenizer = tiny_qwen.train_tokenizer()
    processor = tiny_qwen.make_processor("qwen3_vl", tokenizer)
    target = tiny_qwen.make_model("qwen3_vl", len(tokenizer), seed=0, layers=1)
    draft = tiny.perturbed_copy(target, 0.3, seed=1)
    models = {"target": load(tiny_qwen.save(target, processor, root / "target"), "target"),
              "draft": load(tiny_qwen.save(draft, processor, root / "draft"), "draft")}
    return {**models, "reference": reference(models["target"], [QUESTION], [], tiny_qwen.images(2))}


@pytest.mark.parametrize("case", ["m", "mt", "mtp-dynamic", "eagle3", "eagle3-whole"])
def test_compiled_decoding_is_the_targets_own(qwen, qwen3_one_layer, case):
    """``--compile`` over M-RoPE: the compiled steps get the (3, 1, n) positions the eager ones get, padding
    included (a padded step continues every axis), for a draft model's chain, for batched rows' mixture chain (one
    graph, reading each row's positions from its origin, its δ added, and the write pointer) and for batched rows
    (a pooled one among them) drafting a dynamic tree (each row's own δ); Qwen3-VL, whose prompt also feeds
    DeepStack features,
    eager. The target's tokens hold whatever the draft does, so the drafts themselves are compared with an eager
    run's, block by block. One family, of one layer: each family compiles its own graphs, seconds each per layer."""
    models = qwen3_one_layer
    assert all(compile_blocker(qwen[family]["target"].model) is None for family in FAMILIES)  # --compile is not refused
    name, options = {"m": ("m", {}), "mt": ("mt", {}), "mtp-dynamic": ("mtp", DYNAMIC), "eagle3": ("eagle3", {}),
                     "eagle3-whole": ("eagle3", {})}[case]
    vocab = models["target"].vocab_size if case == "eagle3-whole" else None  # draft ids == target ids: no scatter
    turns = {}
    for kv in ("dynamic", "compiled"):
        drafter = (HeadDrafter(models["target"], random_eagle3(models["target"], draft_vocab=vocab))
                   if name == "eagle3" else name)
        decoder = speculative_decoder(models["target"], drafter, models["draft"], gamma=3, max_new_tokens=MAX_NEW,
                                      kv=kv, **options)
        turns[kv] = decoder.generate(tiny_qwen.images(2), [QUESTION]).turns[0]
    assert turns["compiled"].token_ids == models["reference"]
    assert [b.draft for b in turns["compiled"].blocks] == [b.draft for b in turns["dynamic"].blocks]
    if name == "eagle3":  # the target's step returns the inputs of the head's layers; the head's chain is one graph
        head = decoder.drafter.head
        steps = {"target": compiled_forward(models["target"].model, "target", head.layers_read).graphs,
                 "head chain": decoder.drafter.chain}
    else:
        steps = {role: compiled_forward(model, role).graphs  # the one the decoder used: one per model and process
                 for model, role in ((models["target"].model, "target"), (models["draft"].model, "draft"))}
        if name == "mt":
            steps["rows' chain"] = decoder.drafter.rows.chain
    for role, graphs in steps.items():
        assert graphs.failed is None and graphs.traced, f"the {role}'s steps ran eager"


@pytest.mark.parametrize("family", FAMILIES)
def test_two_turns_equal_generate(qwen, family):
    models = qwen[family]
    target = models["target"]
    decoder = speculative_decoder(target, "m", models["draft"], gamma=4, max_new_tokens=MAX_NEW)
    first, second = decoder.generate(tiny_qwen.images(2), [QUESTION, FOLLOW_UP]).turns
    assert first.token_ids == reference(target, [QUESTION], [], tiny_qwen.images(2))
    assert second.token_ids == reference(target, [QUESTION, FOLLOW_UP], [first.text], tiny_qwen.images(2))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("drafter", ["ar", "m", "t", "tabed", "p", "ssd", "eagle"])
def test_an_image_in_the_second_turn_keeps_the_targets_own_output(qwen, family, drafter, monkeypatch):
    """The new image's tokens take the positions the whole prompt's ``get_rope_index`` gives them, and the text
    after it the new offset; only the new part is fed (the first turn's image stays cached)."""
    models = qwen[family]
    target = models["target"]
    fed_after = []
    original = CachedModel._images_after

    def spy(self, *args):
        found = original(self, *args)
        fed_after.append(found is not None)
        return found

    monkeypatch.setattr(CachedModel, "_images_after", spy)
    chosen = HeadDrafter(target, random_head(target, drafter)) if drafter == "eagle" else drafter
    images = tiny_qwen.images(2)  # of different sizes
    mine, own = image_in_second_turn(target, chosen, models["draft"], images[:1], images[1:],
                                     build={"ssd_layer": 1} if drafter == "ssd" else None)
    assert mine == own
    assert any(fed_after)


def test_sampling_keeps_the_target_distribution(qwen):
    """m over Qwen2.5-VL with two images of different sizes, γ = 2: the first two sampled tokens of ENGINE_RUNS
    seeded runs against the target's exact distribution from its own uncached forwards."""
    models = qwen["qwen2_5_vl"]
    target, images = models["target"], tiny_qwen.images(2)
    joint = exact_joint(target, params=PARAMS, images=images)
    decoder = SpeculativeDecoder(target, build_drafter("m", target, models["draft"]), gamma=2, max_new_tokens=3,
                                 sampling=PARAMS)
    counts, _ = sampled_pairs(decoder, ENGINE_RUNS, images=images)
    assert chi_square_p_value(counts, joint, ENGINE_RUNS) > 1e-3


# --------------------------------------------------------------------------- the offset is what makes it right


def uncached_logits(target, ids, vision) -> torch.Tensor:
    """The model's own logits for every position of ``ids`` (a prompt and what follows it), in one forward
    from position 0 with the prompt's images: positions as the model itself computes them."""
    types = vision.get("mm_token_type_ids")
    extra = {} if types is None else {"mm_token_type_ids": torch.nn.functional.pad(types, (0, len(ids) - types.shape[1]))}
    with torch.no_grad():
        return uncached_forward(target.model, ids, {**vision, **extra}).logits[0]


def later_logits(runner, target, images, after=(17, 30, 9)) -> tuple[torch.Tensor, torch.Tensor]:
    """(cached, uncached) logits of three tokens fed after a prompt with ``images``, through ``runner``."""
    prompt = process(target.processor, render_prompt(target.processor, [QUESTION], [], len(images)), images)
    runner.logits(prompt.ids, vision=prompt.vision, prompt_len=len(prompt.ids))
    ids = prompt.ids + list(after)
    cached = runner.logits(ids, keep=len(after), vision=prompt.vision, prompt_len=len(prompt.ids))
    return cached, uncached_logits(target, ids, prompt.vision)[-len(after):]


@pytest.mark.parametrize("family", FAMILIES)
def test_later_positions_read_the_prompts_offset(qwen, monkeypatch, family):
    """Tokens fed after an image prompt get the model's own logits; with δ dropped they don't."""
    from mmspec_cli.decoding.kv import CachedModel

    target = qwen[family]["target"]
    cached, own = later_logits(CachedModel(target.model, "target", target.image_token_id), target, tiny_qwen.images(2))
    assert torch.allclose(cached, own, atol=1e-9)
    monkeypatch.setattr(families.QwenVLFamily, "positions", lambda self, offset=0: MRopePositions(0))
    cached, own = later_logits(CachedModel(target.model, "target", target.image_token_id), target, tiny_qwen.images(2))
    assert not torch.allclose(cached, own, atol=1e-3)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_stale_offset_from_an_earlier_request_is_never_used(qwen, monkeypatch, family):
    """One runner, an image request, then a text-only one: the model's own logits; wrong when the first
    request's offset is kept (as the model object's own ``rope_deltas`` would be)."""
    from mmspec_cli.decoding.kv import CachedModel

    target = qwen[family]["target"]
    runner = CachedModel(target.model, "target", target.image_token_id)
    later_logits(runner, target, tiny_qwen.images(2))
    cached, own = later_logits(runner, target, [])
    assert torch.allclose(cached, own, atol=1e-9)

    kept: list[int] = []
    real = families.QwenVLFamily.positions

    def stale(self, offset=0):
        if offset:
            kept[:] = [offset]
        return real(self, kept[0] if kept else offset)

    monkeypatch.setattr(families.QwenVLFamily, "positions", stale)
    runner = CachedModel(target.model, "target", target.image_token_id)
    later_logits(runner, target, tiny_qwen.images(2))
    cached, own = later_logits(runner, target, [])
    assert not torch.allclose(cached, own, atol=1e-3)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_later_turns_new_image_gets_the_whole_prompts_positions(qwen, monkeypatch, family):
    """A runner holding turn 1 (an image, the question, an answer) is fed turn 2's new image and question only,
    and gives the logits of one uncached forward over turn 2's prompt; with the new part at plain positions after
    the held ones (what the new image does to the positions ignored), it does not."""
    from mmspec_cli.decoding.kv import CachedModel

    target = qwen[family]["target"]
    processor, images, answer = target.processor, tiny_qwen.images(2), [17, 30, 9]
    first = process(processor, render_prompt(processor, [QUESTION], [], [1]), images[:1])
    second = process(processor, render_prompt(processor, [QUESTION, FOLLOW_UP], [target.tokenizer.decode(answer)],
                                              [1, 1]), images)

    def turn_two() -> tuple[torch.Tensor, torch.Tensor]:
        runner = CachedModel(target.model, "target", target.image_token_id)
        runner.logits(first.ids + answer, vision=first.vision, prompt_len=len(first.ids))
        monkeypatch.setattr(CachedModel, "reset", lambda self: pytest.fail("turn 1 was fed again"))
        cached = runner.logits(second.ids, keep=5, vision=second.vision, prompt_len=len(second.ids))
        monkeypatch.undo()
        return cached, uncached_logits(target, second.ids, second.vision)[-5:]

    cached, own = turn_two()
    assert torch.allclose(cached, own, atol=1e-9)
    real = families.QwenVLFamily.prompt_positions

    def plain_after_the_first(self, model, ids, vision, device):
        positions, offset = real(self, model, ids[:len(first.ids)], vision, device)
        if len(ids) == len(first.ids):
            return positions, offset
        return torch.cat([positions, MRopePositions(offset).chain(len(first.ids), len(ids) - len(first.ids),
                                                                  device)], dim=-1), offset

    monkeypatch.setattr(families.QwenVLFamily, "prompt_positions", plain_after_the_first)
    cached, own = turn_two()
    assert not torch.allclose(cached, own, atol=1e-7)  # float64: the right positions agree to 1e-9


def test_dropping_the_offset_changes_the_output(qwen, refs, monkeypatch):
    """End to end on Qwen3-VL (whose tiny output depends on it visibly): without δ, not the target's tokens."""
    monkeypatch.setattr(families.QwenVLFamily, "positions", lambda self, offset=0: MRopePositions(0))
    assert first_turn(qwen["qwen3_vl"]["target"], "ar", None, tiny_qwen.images(2)).token_ids != refs["qwen3_vl", 2]


def test_select_layer_reads_a_qwen_targets_layers_at_its_own_positions(qwen, tmp_path):
    """``select-layer`` runs the target over each turn's prompt and answer at explicit M-RoPE positions (the
    prompt's from ``get_rope_index``, the answer's after its offset): left to the model, the prompt's token types
    did not cover the answer and the forward failed. Two images, one of them brought by the second question."""
    target = qwen["qwen2_vl"]["target"]
    profile = write_profile(tmp_path / "p.yaml", target.name, qwen["qwen2_vl"]["draft"].name, max_new_tokens=6)
    for i, image in enumerate(tiny_qwen.images(2)):
        image.save(tmp_path / f"img{i}.png")
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps({"id": "s", "images": ["img0.png"], "category": "c",
                                    "turns": [QUESTION, {"question": FOLLOW_UP, "images": ["img1.png"]}]}) + "\n")
    result = CliRunner().invoke(app, ["select-layer", str(manifest), "--profile", profile, "--json"])
    assert result.exit_code == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["samples"] == 1 and out["positions"] > 6 and len(out["layers"]) == out["layers_total"] // 2


# --------------------------------------------------------------------------- refusals


def test_a_qwen_target_with_a_llava_draft_is_refused(qwen, tiny_models):
    with pytest.raises(ModelLoadError, match="target's image placeholder token id"):
        check_compatible(qwen["qwen2_vl"]["target"], tiny_models["target"])


def test_pooled_rows_need_a_forward_that_takes_precomputed_image_features(qwen, monkeypatch):
    models = qwen["qwen2_vl"]
    assert rows_module.takes_encoder_outputs(models["draft"].model)  # transformers 5.24's forward takes them
    build_drafter("mp", models["target"], models["draft"])
    monkeypatch.setattr(rows_module, "takes_encoder_outputs", lambda model: False)  # an older forward
    with pytest.raises(ModelLoadError, match=r"pooled drafting \(p\) with a Qwen2VLForConditionalGeneration draft "
                                             r"needs a transformers whose forward takes precomputed image features"):
        build_drafter("mp", models["target"], models["draft"])


def test_the_profiles_pixel_bounds_set_each_images_vision_tokens_and_the_output_stays_the_targets(qwen):
    """``max_pixels`` from the profile reaches the image processor: the 100x80 image, 12 merged tokens at the tiny
    family's defaults, is scaled to one 28x28 block; decoding over that prompt is still the target's own."""
    family = "qwen2_5_vl"
    default = qwen[family]["target"]
    bounded = load_model(ModelSpec(model=default.name, dtype="float64", device="cpu", max_pixels=2 * 28 * 28),
                         "target")
    image = tiny_qwen.images(1)

    def vision_tokens(loaded):
        return process(loaded.processor, render_prompt(loaded.processor, [QUESTION], [], 1), image).ids.count(
            tiny_qwen.IMAGE_ID)

    assert (vision_tokens(default), vision_tokens(bounded)) == (12, 1)
    assert first_turn(bounded, "m", qwen[family]["draft"], image).token_ids == reference(bounded, [QUESTION], [], image)


def test_images_too_big_for_the_context_name_their_tokens_and_the_max_pixels_that_fits(qwen):
    """A huge image under a large ``max_pixels`` fills the context: the line says how many tokens the image took
    and which ``max_pixels`` fits (not "shorten the question"), and that bound does fit."""
    family = "qwen2_vl"
    path = qwen[family]["target"].name
    huge = [Image.new("RGB", (1400, 1400), (200, 30, 30))]
    loose = load_model(ModelSpec(model=path, dtype="float64", device="cpu", max_pixels=1400 * 1400), "target")
    with pytest.raises(InputError, match=r"^the prompt is \d+ tokens \(2500 for its image, \d+ for the text\) .*; set "
                                         r"target.max_pixels in the profile to (\d+) or less \(the image then takes "
                                         r"at most \d+ tokens\), or pass a smaller image$") as refused:
        first_turn(loose, "ar", None, huge)
    bound = int(re.search(r"max_pixels in the profile to (\d+)", str(refused.value))[1])
    fitting = load_model(ModelSpec(model=path, dtype="float64", device="cpu", max_pixels=bound), "target")
    assert first_turn(fitting, "ar", None, huge).token_ids


def test_a_draft_sharing_the_targets_processor_bounds_its_own_copy(qwen):
    target = qwen["qwen2_vl"]["target"]
    spec = ModelSpec(model=target.name, max_pixels=2 * 28 * 28)
    bounded = with_pixel_bounds(target.processor, spec, "draft", shared=target.processor)
    assert bounded is not target.processor and bounded.image_processor is not target.processor.image_processor
    assert bounded.image_processor.size["longest_edge"] == 2 * 28 * 28
    assert target.processor.image_processor.size["longest_edge"] == (tiny_qwen.MAX_SIDE_PATCHES * 28) ** 2


def test_pixel_bounds_on_a_fixed_size_image_processor_are_refused(tiny_dirs):
    with pytest.raises(ModelLoadError, match=r"target.min_pixels/max_pixels: .* does not resize to a pixel range"):
        load_model(ModelSpec(model=tiny_dirs["target"], dtype="float64", device="cpu", max_pixels=10000), "target")


def test_an_image_the_processor_cannot_resize_is_one_line(qwen):
    target = qwen["qwen2_vl"]["target"]
    text = render_prompt(target.processor, [QUESTION], [], 1)
    with pytest.raises(InputError, match=r"could not prepare the images \(3000x10 pixels\): absolute aspect ratio "
                                         r"must be smaller than 200.*; crop, pad or resize the image"):
        process(target.processor, text, [Image.new("RGB", (3000, 10))])


def test_a_video_file_is_refused(tmp_path):
    from mmspec_cli.models.images import load_image

    video = tmp_path / "clip.mp4"
    video.write_bytes(b"\x00\x00\x00\x18ftypmp42")
    with pytest.raises(InputError, match="video input is not supported yet"):
        load_image(video)


@pytest.mark.parametrize("family", FAMILIES)
def test_an_eagle3_head_trains_on_the_layer_inputs_and_positions_it_drafts_from(qwen, family):
    """``train-head eagle3``'s reader and the drafter's feature track hold the same rows for the same turn: the inputs
    of the head's layers (on Qwen3-VL, a layer's input holds the DeepStack features added at image slots, which
    ``output_hidden_states`` does not) and the M-RoPE positions each token was fed at."""
    from mmspec_cli.training.answers import Answer
    from mmspec_cli.training.corpus import Conversation
    from mmspec_cli.training.eagle3 import eagle3_reader
    from mmspec_cli.training.sequences import Turn
    from tests.helpers import after_block, begin_turn

    target = qwen[family]["target"]
    images = tiny_qwen.images(1)
    text = render_prompt(target.processor, [QUESTION], [], 1)
    answer = reference(target, [QUESTION], [], images, max_new_tokens=6)
    head = random_eagle3(target)
    turn = Turn(Conversation("c", (QUESTION,), (), lambda: images), Answer("c", 0, text, answer, False))
    trained_on = eagle3_reader(head.layers_read)(target, turn)
    decoder = speculative_decoder(target, HeadDrafter(target, head))
    begin_turn(decoder, text, images)
    prompt = process(target.processor, text, images)
    after_block(decoder, prompt, answer)  # the target holds the prompt and the answer but its last token
    track = decoder.cached_target.features
    held = len(track)
    assert held == len(trained_on.ids) - 1
    torch.testing.assert_close(trained_on.features[:held].cpu(), track.hidden.float().cpu(), rtol=0, atol=1e-6)
    assert torch.equal(trained_on.positions[:held].cpu(), track.positions.cpu())
