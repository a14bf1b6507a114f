"""Quantized targets (bitsandbytes on the CPU): what is guaranteed, and why.

LLM.int8 computes in floating point the columns where any row of a call has an outlier (|x| > 6 by default), for
every row of that call: a token verified beside others can round differently from the same token run alone, as
``generate`` runs it. mmspec loads an 8-bit target without outlier columns (``TARGET_INT8_THRESHOLD``), so every row
is quantized on its own and speculative decoding gives the quantized target's own output.

The tiny target here has outliers on purpose (its language model's norms scaled ×5 on four channels: activations
above 6, as real models of 7B parameters and more have); a plain tiny model has none, and any threshold would pass.
Measured when written, with bitsandbytes' default threshold (6.0): ``m`` differs from the target's ``generate`` on the
one-image case below (2 of the 4 first-turn questions; ``ar`` never, it verifies one token at a time).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("bitsandbytes")

from mmspec_cli.models import loading  # noqa: E402
from mmspec_cli.models.profiles import ModelSpec  # noqa: E402
from tests import tiny  # noqa: E402
from tests.helpers import QUESTION, own_generate, speculative_decoder  # noqa: E402

OUTLIER_SCALE = 5.0


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """An 8-bit target with activation outliers (float32 before quantizing), and a float32 draft close to it."""
    root = tmp_path_factory.mktemp("quantized")
    tokenizer = tiny.train_tokenizer()
    processor = tiny.make_processor(tokenizer)
    target = tiny.make_model(len(tokenizer), seed=0, hidden=64, layers=2)
    with torch.no_grad():
        for name, weight in target.named_parameters():
            if "language_model" in name and "layernorm" in name:
                weight[:4].mul_(OUTLIER_SCALE)
    draft = tiny.perturbed_copy(target, 0.05, seed=1)
    target_dir = tiny.save(target.to(torch.float32), processor, root / "target")
    draft_dir = tiny.save(draft.to(torch.float32), processor, root / "draft")
    return {"target": loading.load_model(ModelSpec(model=target_dir, dtype="float32", device="cpu",
                                                   quantization="8bit"), "target"),
            "draft": loading.load_model(ModelSpec(model=draft_dir, dtype="float32", device="cpu"), "draft")}


def test_an_8bit_target_has_no_outlier_columns_and_a_draft_keeps_the_default():
    target = loading._quantization_config("8bit", torch.float32, "target")
    draft = loading._quantization_config("8bit", torch.float32, "draft")
    assert target.load_in_8bit and target.llm_int8_threshold == loading.TARGET_INT8_THRESHOLD == 0.0
    assert draft.load_in_8bit and draft.llm_int8_threshold == 6.0


@pytest.mark.parametrize("drafter", ["ar", "m", "tabed"])
def test_speculative_decoding_gives_the_8bit_targets_own_output(quantized, drafter):
    target, draft = quantized["target"], quantized["draft"]
    for question in (QUESTION, "how many shapes are there?"):
        images = tiny.images(1)
        turn = speculative_decoder(target, drafter, draft, gamma=3).generate(images, [question]).turns[0]
        assert turn.token_ids == own_generate(target, [question], [], 1, images), (drafter, question)
