"""mmspec's demo target and EAGLE-3 heads in SpecForge's layout, served by vLLM (CPU build), checked for losslessness.

Skipped unless MMSPEC_ENGINES=1 (they take minutes and a second venv, built on first use, about 10 minutes)::

    MMSPEC_ENGINES=1 python -m pytest tests/engines -s

What runs: the demo target's language model is written as a plain Llama folder (llama_folder.py) and, because
vLLM's CPU attention refuses head_dim 36, re-written with head_dim 64 computing the same function; random EAGLE-3
heads are written for it (random_head.py); vllm_run.py runs vLLM in .venv-vllm through a subprocess. Greedy
outputs of vLLM without speculation, vLLM with each head, and transformers' ``generate`` must all be equal.

``test_trained_eagle3_head_in_vllm_and_mmspec`` (check_eagle3.py) takes a TRAINED mmspec EAGLE-3 head (the shipped
``demo-eagle3``, or the folder in ``MMSPEC_EAGLE3_HEAD``; skipped when absent), exports it with ``mmspec export-head
--to vllm``, pads it and the target to head_dim 64, and checks that vLLM with it, vLLM without it and mmspec with
the original head give the same tokens, with vLLM's acceptance counters beside mmspec's τ. Its JSON report is
written to ``MMSPEC_ENGINES_REPORT`` when that is set.
Collection imports nothing heavy (no torch, no vllm): everything runs inside the tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
DEMO_TARGET = REPO / "mmspec_cli" / "shipped" / "demo-target"
SHIPPED_EAGLE3 = REPO / "mmspec_cli" / "shipped" / "demo-eagle3"
MAX_TOKENS, SPEC_TOKENS = 40, 3

pytestmark = [
    pytest.mark.skipif(os.environ.get("MMSPEC_ENGINES") != "1",
                       reason="engine checks: MMSPEC_ENGINES=1 python -m pytest tests/engines -s"),
    pytest.mark.timeout(3600),
]


@pytest.fixture(scope="module")
def vllm_python():
    sys.path.insert(0, str(HERE))
    from vllm_env import ensure_venv

    return ensure_venv(REPO / ".venv-vllm")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Llama folders of the demo target (head_dim 36 and 64), heads, prompts and transformers' greedy outputs."""
    sys.path.insert(0, str(HERE))
    import torch
    from llama_folder import check_same_outputs, demo_prompts, greedy, pad_head_dim, write_language_model
    from random_head import write_random_head
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("engines")
    prompts = demo_prompts(n=3, length=20)
    (root / "prompts.json").write_text(json.dumps(prompts))
    llama36 = write_language_model(DEMO_TARGET, root / "demo-llama", dtype="float32")
    hf = check_same_outputs(DEMO_TARGET, llama36, prompts, MAX_TOKENS)  # LLaVA == its Llama folder
    llama64 = pad_head_dim(llama36, root / "demo-llama64", 64)
    model = AutoModelForCausalLM.from_pretrained(llama64, dtype=torch.float32).eval()
    assert greedy(model, prompts, MAX_TOKENS) == hf
    heads = [write_random_head(llama64, root / "head-random", draft_vocab=600),
             write_random_head(llama64, root / "head-263", keep_ids=[263])]  # always drafts 263, a frequent token
    return {"root": root, "prompts": root / "prompts.json", "hf": hf, "llama36": llama36, "llama64": llama64,
            "heads": heads}


def vllm_run(python, target, heads, prompts, out):
    cmd = [str(python), str(HERE / "vllm_run.py"), "--target", str(target), "--head", *map(str, heads or ["none"]),
           "--prompts", str(prompts), "--max-tokens", str(MAX_TOKENS), "--spec-tokens", str(SPEC_TOKENS),
           "--dtype", "float32", "--out", str(out)]
    subprocess.run(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=1800)
    result = json.loads(Path(out).read_text())
    print(json.dumps({name: {k: v for k, v in c.items() if k != "outputs"} for name, c in result["configs"].items()}))
    return result


def test_head_dim_36_is_refused_or_exact(vllm_python, folders):
    """vLLM 0.32's CPU attention takes head sizes 32, 64, 80, ...: the demo target as is (36) fails at the first step.
    Should a later vLLM accept it, its outputs must then equal transformers'."""
    result = vllm_run(vllm_python, folders["llama36"], None, folders["prompts"], folders["root"] / "r36.json")
    base = result["configs"]["base"]
    if "error" in base:
        assert "Unsupported CPU attention configuration: head_dim=36" in base["error"], base["error"]
    else:
        assert base["outputs"] == folders["hf"]


def test_eagle3_heads_are_lossless(vllm_python, folders):
    result = vllm_run(vllm_python, folders["llama64"], folders["heads"], folders["prompts"],
                      folders["root"] / "r64.json")
    configs = result["configs"]
    assert set(configs) == {"base", "eagle3:head-random", "eagle3:head-263"}
    for name, conf in configs.items():
        assert "error" not in conf, (name, conf["error"])
        assert conf["outputs"] == folders["hf"], name
    decode_steps = sum(len(out) - 1 for out in folders["hf"])  # the first token comes from the prefill
    for name in ("eagle3:head-random", "eagle3:head-263"):
        spec = configs[name]["spec"]
        accepted = spec["accepted_tokens"]
        assert spec["draft_tokens"] == SPEC_TOKENS * spec["drafts"]
        assert sum(spec["accepted_per_pos"]) == accepted
        assert spec["drafts"] + accepted == decode_steps  # each step emits its accepted drafts plus one token
    # the one-token head is accepted exactly where the target's next token is 263 (and never twice: no "263 263")
    follows = sum(out[1:].count(263) for out in folders["hf"])
    assert follows > 0 and configs["eagle3:head-263"]["spec"]["accepted_per_pos"] == [follows, 0, 0]
    assert configs["eagle3:head-random"]["spec"]["accepted_tokens"] == 0  # (measured; a random head is never right)


def test_trained_eagle3_head_in_vllm_and_mmspec(vllm_python, tmp_path):
    """check_eagle3.py: 5 demo-story questions, 64 tokens, K = 3; tokens equal in vLLM (with and without the
    exported head) and mmspec (original head); vLLM's counters equal mmspec's run aligned to vLLM's steps."""
    head = Path(os.environ.get("MMSPEC_EAGLE3_HEAD") or SHIPPED_EAGLE3)
    if not (head / "config.json").is_file():
        pytest.skip(f"no EAGLE-3 head at {head}: train the shipped one (scripts/train_demo_heads.py) or set "
                    f"MMSPEC_EAGLE3_HEAD=DIR")
    sys.path.insert(0, str(HERE))
    from check_eagle3 import run_check, table

    report = run_check(head, tmp_path / "eagle3")
    print(json.dumps(report, indent=1))
    print(table(report))
    if os.environ.get("MMSPEC_ENGINES_REPORT"):
        Path(os.environ["MMSPEC_ENGINES_REPORT"]).write_text(json.dumps(report, indent=1))
    assert not report["failures"], report["failures"]
