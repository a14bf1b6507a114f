"""The demo trainer: examples learn only the answers, training lowers the loss, and the saved
half-precision models load back through mmspec's loader and decode losslessly."""

from __future__ import annotations

import torch

from mmspec_cli.demo import tasks
from mmspec_cli.demo.scenes import render
from mmspec_cli.demo.train import (
    IGNORE,
    ModelSize,
    build_model,
    build_processor,
    encode,
    language_model_parameters,
    save_half,
    train,
)
from mmspec_cli.drafters import build_drafter
from mmspec_cli.engine import SpeculativeDecoder
from mmspec_cli.models import load_model
from mmspec_cli.profiles import ModelSpec
from mmspec_cli.prompts import render_prompt

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
    text = render_prompt(t.processor, sample.questions[:1], [], 1)
    inputs = t.processor(images=[images], text=text, return_tensors="pt")
    ref = t.model.generate(**inputs, do_sample=False, max_new_tokens=16)[0, inputs["input_ids"].shape[1]:].tolist()
    out = SpeculativeDecoder(t, build_drafter("tabed", t, loaded["draft"]), gamma=3, max_new_tokens=16).generate(
        images, sample.questions[:1])
    assert out.turns[0].token_ids == ref
