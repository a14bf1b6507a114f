"""The mmspec side of the vision-language engine check (tests/engines/vl/check_qwen25vl_eagle3.py), in every run.

The check itself needs vLLM's own venv and runs when asked (``MMSPEC_ENGINES=1``, tests/engines/vl/README.md). What
it records of mmspec's decoding reaches into the head drafter (its forward, its logits), so a change there can break
it where no run of the suite looks: that happened once (a forward that took a mask, a first draft's logits that the
recorder missed), and the check stopped with a traceback before it wrote its report. Here its mmspec functions run
on a tiny Qwen2.5-VL (float64, sharpened) with a random EAGLE-3 head, as the check runs them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mmspec_cli.models.eagle3_files import save_eagle3
from mmspec_cli.models.loading import load_model
from mmspec_cli.models.profiles import ModelSpec
from tests import tiny_qwen
from tests.test_eagle3 import random_eagle3

ENGINES = Path(__file__).resolve().parent / "engines"


@pytest.fixture(scope="module")
def check(tmp_path_factory):
    """The check module with a tiny Qwen2.5-VL target, a random EAGLE-3 head saved for it, and two eval prompts."""
    import sys

    sys.path[:0] = [str(ENGINES), str(ENGINES / "vl")]  # the check imports its helpers lazily from there
    import check_qwen25vl_eagle3 as module

    root = tmp_path_factory.mktemp("vl-check")
    tokenizer = tiny_qwen.train_tokenizer()
    folder = tiny_qwen.save(tiny_qwen.make_model("qwen2_5_vl", len(tokenizer), seed=0),
                            tiny_qwen.make_processor("qwen2_5_vl", tokenizer), root / "target")
    target = load_model(ModelSpec(model=folder, dtype="float64", device="cpu"), "target")
    save_eagle3(random_eagle3(target), root / "head", folder, dtype=torch.float64)
    lines = []
    for i, image in enumerate(tiny_qwen.images(2)):
        image.save(root / f"img{i}.png")
        lines.append(json.dumps({"id": f"s{i}", "images": [f"img{i}.png"], "turns": ["what is in the image?"]}))
    (root / "eval.jsonl").write_text("\n".join(lines) + "\n")
    prompts = module.eval_prompts(target, root / "eval.jsonl")
    yield {"module": module, "target": target, "head": root / "head", "prompts": prompts}
    del sys.path[:2]


def test_the_aligned_run_records_the_heads_logits_of_every_draft(check):
    """Each block of the run aligned to vLLM's steps holds one top-5 per drafted token, the first included, whose
    best id is the token drafted there (greedy); the plain run gives transformers' greedy output."""
    module, target, prompts = check["module"], check["target"], check["prompts"]
    reference = module.reference(target, prompts)
    runs = module.mmspec_runs(target, check["head"], prompts, [tokens[0] for tokens in reference])
    assert [run["outputs"] for run in runs["plain"]] == reference
    blocks = [block for aligned in runs["aligned"] for block in aligned["blocks"]]
    assert blocks and any(len(block["draft"]) == module.K for block in blocks)
    for block in blocks:
        assert len(block["top5"]) == len(block["draft"])
        assert [top["ids"][0] for top in block["top5"]] == block["draft"]


def test_a_draft_that_differs_at_the_last_position_is_reported_not_a_traceback(check):
    """first_draft_difference over a vLLM trace that differs from the aligned run at its last draft position: the
    step and the position, with mmspec's logit gap to vLLM's pick."""
    module, target, prompts = check["module"], check["target"], check["prompts"]
    runs = module.mmspec_runs(target, check["head"], prompts[:1], [module.reference(target, prompts[:1])[0][0]])
    aligned = runs["aligned"][0]
    block = next(b for b in aligned["blocks"] if len(b["draft"]) == module.K)
    step = aligned["blocks"].index(block)
    last = module.K - 1
    other = block["top5"][last]["ids"][1]  # the head's second choice there
    proposals = [{"drafts": [b["draft"] if b is not block else b["draft"][:last] + [other]], "top5": b["top5"]}
                 for b in aligned["blocks"]]
    found = module.first_draft_difference({"proposals": proposals}, aligned)
    assert (found["step"], found["draft_position"], found["vllm"][last]) == (step, last, other)
    assert found["mmspec_gap_to_vllm_pick"] >= 0


def test_the_heads_prompt_positions_are_its_m_rope_rows(check):
    """head_positions: the three M-RoPE rows the head's first forward of a turn runs the prompt at, one entry per
    prompt token but the last (fed with the first generated token)."""
    module, target, prompts = check["module"], check["target"], check["prompts"]
    from mmspec_cli.models.head_files import load_head

    rows = module.head_positions(target, load_head(str(check["head"]), "eagle3", None, target), prompts[0])
    assert len(rows) == 3 and all(len(row) == len(prompts[0]["ids"]) - 1 for row in rows)
