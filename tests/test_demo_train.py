"""The demo trainer: examples learn only the answers, training lowers the loss, and the saved
half-precision models load back through mmspec's loader and decode losslessly."""

from __future__ import annotations

import pytest
import torch

from mmspec_cli.demo import tasks
from mmspec_cli.demo.scenes import COLOURS, KINDS, Scene, Shape, render
from mmspec_cli.demo.training.train import (IGNORE, ModelSize, build_model, build_processor, cell_labels, encode,
                                            freeze_vision, language_model_parameters, length_grouped_batches,
                                            pretrain_vision, save_half, train)
from mmspec_cli.drafters import build_drafter
from mmspec_cli.decoding.engine import SpeculativeDecoder
from mmspec_cli.models.loading import load_model
from mmspec_cli.models.profiles import ModelSpec
from mmspec_cli.models.prompts import render_prompt, text_only_ids
from tests.helpers import own_generate

IMAGE, PATCH = 32, 8


def test_examples_learn_only_the_answer_and_eos():
    samples = tasks.training_corpus(20, seed=0)
    processor = build_processor(samples, vocab_size=400, image_size=IMAGE, patch_size=PATCH)
    sample = next(s for s in samples if len(s.turns) == 2)
    first, second = encode(processor, sample, IMAGE)
    for example, answer in ((first, sample.answers[0]), (second, sample.answers[1])):
        learned = [t for t, label in zip(example.input_ids, example.labels) if label != IGNORE]
        assert processor.tokenizer.decode(learned, skip_special_tokens=True).strip() == answer
        assert learned[-1] == processor.tokenizer.eos_token_id
    assert len(second.input_ids) > len(first.input_ids)  # the second turn sees the first answer
    assert first.pixel_values.shape == (len(sample.images), 3, IMAGE, IMAGE)


def test_training_lowers_the_loss_and_the_saved_pair_decodes_losslessly(tmp_path):
    torch.set_num_threads(1)
    samples = tasks.training_corpus(24, seed=1)
    processor = build_processor(samples, vocab_size=400, image_size=IMAGE, patch_size=PATCH)
    vocab = len(processor.tokenizer)
    target = build_model(ModelSize(64, 2, 4, 32, 1), vocab, IMAGE, PATCH, seed=0)
    draft = build_model(ModelSize(16, 1, 2, 32, 1), vocab, IMAGE, PATCH, seed=1)
    assert language_model_parameters(draft) * 4 < language_model_parameters(target)
    examples = [e for s in samples for e in encode(processor, s, IMAGE)]
    losses = train(target, examples, steps=30, batch_size=4, lr=3e-3, seed=0, pad_id=3)
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5
    train(draft, [e for s in samples if len(s.images) <= 2 for e in encode(processor, s, IMAGE)],
          steps=5, batch_size=4, lr=3e-3, seed=0, pad_id=3)
    save_half(target, processor, tmp_path / "target")
    save_half(draft, processor, tmp_path / "draft")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "target" / "model.safetensors"), "pt") as weights:
        assert {weights.get_tensor(k).dtype for k in weights.keys()} == {torch.float16}  # half precision on disk
    loaded = {r: load_model(ModelSpec(model=str(tmp_path / r), dtype="float64", device="cpu"), r)
              for r in ("target", "draft")}
    assert next(loaded["target"].model.parameters()).dtype == torch.float64  # float16 on disk, loaded as asked
    t = loaded["target"]
    sample = tasks.suite("demo-single", 1)[0]

    images = [render(scene, IMAGE) for scene in sample.images]
    ref = own_generate(t, sample.questions[:1], [], 1, images, 16)
    out = SpeculativeDecoder(t, build_drafter("tabed", t, loaded["draft"]), gamma=3, max_new_tokens=16).generate(
        images, sample.questions[:1])
    assert out.turns[0].token_ids == ref


def test_length_grouped_batches_cover_an_epoch_and_cut_the_padding():
    import random

    rng = random.Random(5)
    lengths = [rng.choice((40, 60, 90, 250)) + rng.randrange(10) for _ in range(1000)]

    def padded(batches):
        return sum(len(b) * max(lengths[i] for i in b) for b in batches)

    grouped = length_grouped_batches(lengths, 16, random.Random(0), group=10)
    plain = length_grouped_batches(lengths, 16, random.Random(0), group=None)
    for batches in (grouped, plain):
        assert sorted(i for b in batches for i in b) == list(range(1000))  # each index once per epoch
        assert all(1 <= len(b) <= 16 for b in batches)
    assert padded(grouped) < 0.7 * padded(plain)  # random batches: one long row pads the other fifteen
    assert grouped == length_grouped_batches(lengths, 16, random.Random(0), group=10)  # deterministic
    assert all(lengths[a] <= lengths[b] for batch in grouped for a, b in zip(batch, batch[1:]))  # a sorted run
    first_rows = [b[0] for b in grouped[:20]]
    assert len({lengths[i] // 100 for i in first_rows}) > 1  # batch order is shuffled, not sorted overall


def test_text_only_examples_are_what_the_text_drafter_sees():
    samples = tasks.training_corpus(20, seed=2)
    processor = build_processor(samples, vocab_size=400, image_size=IMAGE, patch_size=PATCH)
    sample = next(s for s in samples if len(s.images) == 2)
    (example,) = encode(processor, sample, IMAGE, text_only=True)[:1]
    assert example.pixel_values is None
    prompt = render_prompt(processor, sample.questions[:1], [], 2)
    tokenizer = processor.tokenizer
    expected_prompt = text_only_ids(tokenizer, prompt, tokenizer.convert_tokens_to_ids(processor.image_token), 2)
    n = len(expected_prompt)
    assert example.input_ids[:n] == expected_prompt and set(example.labels[:n]) == {IGNORE}
    assert tokenizer.decode(example.input_ids[n:], skip_special_tokens=True).strip() == sample.answers[0]


def test_cell_labels_give_every_patch_its_cell_and_shape():
    shape = Shape("circle", "blue", "large", 5)
    labels = cell_labels(Scene((shape,)), grid=6)  # 2x2 patches per cell
    assert labels.shape == (36, 4)
    cells = labels[:, 3].reshape(6, 6)
    assert cells[0, 0] == 0 and cells[1, 1] == 0 and cells[2, 4] == 5 and cells[5, 5] == 8
    inside = [(r * 6 + c) for r in (2, 3) for c in (4, 5)]
    assert labels[inside, :3].tolist() == [[list(COLOURS).index("blue") + 1, KINDS.index("circle") + 1, 2]] * 4
    assert int((labels[:, 0] > 0).sum()) == 4  # every other patch is empty
    with pytest.raises(ValueError, match="multiple of 3"):
        cell_labels(Scene(()), grid=4)


def test_vision_pretraining_learns_what_and_where():
    torch.set_num_threads(1)
    processor = build_processor(tasks.training_corpus(10, seed=3), vocab_size=300, image_size=48, patch_size=16)
    model = build_model(ModelSize(32, 1, 2, 64, 2), len(processor.tokenizer), 48, 16, seed=0)
    accuracy = pretrain_vision(model, processor.image_processor, steps=80, batch_size=16, lr=3e-3, seed=0,
                               render_size=48)
    assert accuracy > 0.6  # of patches with colour, kind, size and cell all right (chance: far below 1%)
    freeze_vision(model)
    assert not any(p.requires_grad for p in model.model.vision_tower.parameters())
    assert all(p.requires_grad for p in model.model.multi_modal_projector.parameters())


def test_the_draft_sees_stories_only_as_text_and_first_turns_only_keep_images():
    from dataclasses import replace

    from mmspec_cli.demo.training.build import BuildPlan, draft_corpus

    samples = [tasks.make_sample(f, s) for f in ("single", "followup", "story", "pair") for s in range(2)]
    processor = build_processor(samples, vocab_size=400, image_size=IMAGE, patch_size=PATCH)
    encoded = [encode(processor, s, IMAGE) for s in samples]
    plan = replace(BuildPlan(), image_size=IMAGE, patch_size=PATCH, render_size=IMAGE, draft_text_only_share=1.0,
                   draft_multimodal_turns="all")
    every_turn = draft_corpus(plan, processor, samples, encoded)
    first_only = draft_corpus(replace(plan, draft_multimodal_turns="first"), processor, samples, encoded)
    stories = {len(e.input_ids) for s, per in zip(samples, encoded) if s.family == "story" for e in per}
    for corpus in (every_turn, first_only):
        assert all(e.pixel_values is None or e.pixel_values.shape[0] <= 2 for e in corpus)
        assert not stories & {len(e.input_ids) for e in corpus if e.pixel_values is not None}
    with_images = lambda corpus: sum(e.pixel_values is not None for e in corpus)  # noqa: E731
    assert with_images(every_turn) == 8 and with_images(first_only) == 6  # 6 samples; 2 followups have 2 turns
    assert len(every_turn) - with_images(every_turn) == 10  # text-only copies of every turn, stories included
    only_images = replace(plan, draft_text_sees_all_families=False)
    assert len(draft_corpus(only_images, processor, samples, encoded)) - with_images(every_turn) == 8


def test_retraining_only_the_draft_gives_the_draft_of_a_full_build(tmp_path, monkeypatch):
    from dataclasses import replace

    from safetensors.torch import load_file

    from mmspec_cli.demo.training.build import BuildPlan, Stage, build

    plan = replace(BuildPlan(), corpus_size=24, vocab_size=400, render_size=48, threads=1,
                   target=ModelSize(32, 1, 2, 32, 1), draft=ModelSize(16, 1, 2, 32, 1),
                   vision=Stage(3, 4, 3e-3), target_stage=Stage(4, 4, 3e-3), draft_stage=Stage(6, 4, 3e-3),
                   length_group=2)
    corpus = tasks.training_corpus(plan.corpus_size, seed=plan.seed, weights=dict(plan.family_weights))
    assert any(s.family == "story" for s in corpus)  # a sample the draft-only run encodes without pixels
    build(tmp_path / "full", plan, log=lambda line: None)
    import mmspec_cli.demo.training.build as build_module

    with_pixels = []

    def counting_encode(processor, sample, image_size, text_only=False):
        with_pixels.append(not text_only and len(sample.images) > 0)
        return encode(processor, sample, image_size, text_only)

    monkeypatch.setattr(build_module, "encode", counting_encode)
    build(tmp_path / "draft-only", plan, log=lambda line: None, target_from=tmp_path / "full")
    small = sum(len(s.images) <= plan.draft_max_images for s in corpus)
    assert sum(with_pixels) == small < len(corpus)  # the stories were not encoded with their images
    full = load_file(str(tmp_path / "full" / "demo-draft" / "model.safetensors"))
    again = load_file(str(tmp_path / "draft-only" / "demo-draft" / "model.safetensors"))
    assert full.keys() == again.keys()
    assert all(torch.equal(full[k], again[k]) for k in full)
    assert not (tmp_path / "draft-only" / "demo-target").exists()
