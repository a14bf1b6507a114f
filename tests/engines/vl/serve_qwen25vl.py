"""A tiny random Qwen2.5-VL served by vLLM's CPU build, with and without a random EAGLE-3 head, checked against
transformers' own greedy ``generate`` on the same image and prompt.

Runs in mmspec's venv (transformers, torch, the repository's tests/ on the path); vLLM runs in its own venv,
one child process per configuration, through ``--vllm-python``::

    python tests/engines/vl/vl_env.py       # the vLLM venv, once (see vl_env.py)
    .venv/bin/python tests/engines/vl/serve_qwen25vl.py --vllm-python .venv-vllm-vl/bin/python \\
        [--work /tmp/qwen25vl-vllm] [--max-tokens 32] [--spec-tokens 3]

Steps: (1) build and save the target (text: 8 layers, hidden 256, 4 heads of 64, 2 KV heads, M-RoPE sections
[8, 12, 12]; a 2-block vision tower), its tokenizer, image processor and chat template, a random EAGLE-3 head in
SpecForge's layout, one image and the chat prompt; (2) transformers' greedy ``generate`` (``max_new_tokens``,
no EOS stop) with the smallest top-1/top-2 logit gap along the way; (3) ``vllm.LLM.generate`` with
``multi_modal_data={"image": image}``, greedy, ``ignore_eos``, without and with
``speculative_config={"method": "eagle3", ...}``: the random head ("eagle3", never accepted) and a head whose draft
vocabulary is the reference output's most frequent token ("eagle3-fixed", accepted in part); (4) the comparison: vLLM's prompt token ids against the HF
processor's, and each output against transformers'. Writes ``result.json`` in the work folder; exits 0 when
every output matches.

The vLLM venv needs a torchvision that loads: vLLM's qwen2_vl.py imports ``smart_resize`` from transformers'
``image_processing_qwen2_vl``, which imports ``torchvision.transforms.v2.functional``, and transformers builds the
Qwen2.5-VL processor only with its (torchvision) video processor. vl_env.py builds such a venv (README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
TEXT = dict(hidden=256, layers=8, heads=4, kv_heads=2, head_dim=64, mrope_section=[8, 12, 12])
IMAGE_SIZE = (112, 84)  # multiples of 28: 8 x 6 patches of 14, 4 x 3 = 12 merged image tokens, no resize
QUESTION = "what is in the image?"


# ---------------------------------------------------------------- (1) build, in mmspec's venv
def make_image():
    from PIL import Image

    w, h = IMAGE_SIZE
    img = Image.new("RGB", (w, h), (220, 30, 30))
    for x in range(w):
        for y in range(0, h, 7):
            img.putpixel((x, (y + x) % h), ((x * 9) % 256, (y * 13) % 256, 255 - (x * 5) % 256))
    return img


def make_target(vocab_size: int, seed: int = 2, std: float = 0.06, sharpen: float = 16.0):
    """A random float32 Qwen2.5-VL; every matrix drawn with ``std`` and a sharpened LM head. The defaults give a
    greedy output that mixes runs of one token with varied ones (so a head that always drafts that token is
    accepted in part), and a top-1/top-2 logit gap of at least 0.6 along the reference output."""
    import torch
    import transformers

    from tests.tiny_qwen import EOS_ID, IMAGE_ID, PAD_ID, VIDEO_ID, VISION_END_ID, VISION_START_ID

    t = TEXT
    text = dict(vocab_size=vocab_size, hidden_size=t["hidden"], intermediate_size=2 * t["hidden"],
                num_hidden_layers=t["layers"], num_attention_heads=t["heads"], num_key_value_heads=t["kv_heads"],
                head_dim=t["head_dim"], max_position_embeddings=2048,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": t["mrope_section"]},
                bos_token_id=None, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    vision = dict(depth=2, hidden_size=64, num_heads=2, intermediate_size=128, out_hidden_size=t["hidden"],
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3, window_size=56,
                  fullatt_block_indexes=[1])
    config = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE_ID,
                                           video_token_id=VIDEO_ID, vision_start_token_id=VISION_START_ID,
                                           vision_end_token_id=VISION_END_ID, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).to(torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=g) * std)
        model.get_output_embeddings().weight.mul_(sharpen)
    model.generation_config.eos_token_id = EOS_ID
    model.generation_config.pad_token_id = PAD_ID
    model.generation_config.bos_token_id = None
    return model


def write_head(target_config: dict, out: Path, draft_vocab: int, seed: int = 1, keep_ids=None) -> None:
    """A random EAGLE-3 head in SpecForge's layout for the target's text model, M-RoPE as ``rope_scaling``;
    ``keep_ids`` fixes its draft vocabulary (``[t]``: a head that always drafts ``t``)."""
    sys.path.insert(0, str(ROOT / "tests" / "engines"))
    from random_head import random_head_tensors
    from safetensors.torch import save_file

    text = target_config["text_config"]
    rope = text.get("rope_parameters") or {}
    config = {k: text[k] for k in ("hidden_act", "rms_norm_eps", "max_position_embeddings", "vocab_size",
                                   "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                                   "hidden_size", "eos_token_id", "pad_token_id")}
    if keep_ids is not None:
        draft_vocab = len(keep_ids)
    config.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
                  draft_vocab_size=draft_vocab, tie_word_embeddings=False, torch_dtype="float32",
                  rope_theta=rope.get("rope_theta", 10000.0),
                  rope_scaling={"type": "mrope", "mrope_section": rope["mrope_section"]})
    out.mkdir(parents=True, exist_ok=True)
    save_file(random_head_tensors(config, seed, keep_ids=keep_ids), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))


def build(work: Path, draft_vocab: int) -> dict:
    sys.path.insert(0, str(ROOT))
    from tests.tiny_qwen import make_processor, save, train_tokenizer

    tok = train_tokenizer(400)
    processor = make_processor("qwen2_5_vl", tok)
    model = make_target(len(tok))
    target = work / "target"
    save(model, processor, target)
    write_head(json.loads((target / "config.json").read_text()), work / "head", draft_vocab)
    image = make_image()
    image.save(work / "image.png")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return {"target": str(target), "heads": {"eagle3": str(work / "head")}, "image": str(work / "image.png"), "prompt": prompt,
            "model": model, "processor": processor}


# ---------------------------------------------------------------- (2) transformers' greedy generate
def reference(built: dict, max_tokens: int) -> dict:
    import torch
    from PIL import Image

    model, processor = built["model"], built["processor"]
    image = Image.open(built["image"]).convert("RGB")
    inputs = processor(text=[built["prompt"]], images=[image], return_tensors="pt")
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_tokens, min_new_tokens=0, do_sample=False,
                             eos_token_id=None, output_scores=True, return_dict_in_generate=True)
    n = inputs["input_ids"].shape[1]
    gaps = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
    return {"prompt_token_ids": inputs["input_ids"][0].tolist(), "outputs": out.sequences[0, n:].tolist(),
            "min_top2_gap": round(min(gaps), 4), "generate_s": round(time.perf_counter() - t0, 2),
            "image_grid_thw": inputs["image_grid_thw"].tolist()}


# ---------------------------------------------------------------- (3) vLLM, in its own venv
def vllm_child(args) -> dict:
    from PIL import Image
    from vllm import LLM, SamplingParams

    spec = None
    if args.config != "base":
        spec = {"method": "eagle3", "model": args.head, "num_speculative_tokens": args.spec_tokens}
    t0 = time.perf_counter()
    llm = LLM(model=args.target, dtype="float32", enforce_eager=True, max_model_len=1024, seed=0,
              disable_log_stats=False, speculative_config=spec, limit_mm_per_prompt={"image": 1, "video": 0})
    t1 = time.perf_counter()
    image = Image.open(args.image).convert("RGB")
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    res = llm.generate([{"prompt": args.prompt, "multi_modal_data": {"image": image}}], params, use_tqdm=False)
    t2 = time.perf_counter()
    spec_counts = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode_num_") and hasattr(m, "value"):
            spec_counts[m.name.removeprefix("vllm:spec_decode_num_")] = spec_counts.get(m.name, 0) + m.value
    import vllm
    import torch

    return {"vllm_version": vllm.__version__, "torch": torch.__version__,
            "prompt_token_ids": list(res[0].prompt_token_ids), "outputs": list(res[0].outputs[0].token_ids),
            "text": res[0].outputs[0].text, "start_s": round(t1 - t0, 2), "generate_s": round(t2 - t1, 2),
            "spec": spec_counts, "speculative_config": spec}


def run_vllm(vllm_python: str, built: dict, config: str, args, work: Path) -> dict:
    out = work / f"vllm-{config}.json"
    out.unlink(missing_ok=True)
    cmd = [vllm_python, os.path.abspath(__file__), "--child", config, "--target", built["target"],
           "--head", built["heads"].get(config, "none"), "--image", built["image"], "--prompt", built["prompt"],
           "--max-tokens", str(args.max_tokens), "--spec-tokens", str(args.spec_tokens), "--out", str(out)]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    t0 = time.perf_counter()
    log = work / f"vllm-{config}.log"
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    wall = round(time.perf_counter() - t0, 2)
    if rc != 0 or not out.exists():
        errors = [ln.strip() for ln in log.read_text().splitlines() if "Error" in ln or "Exception" in ln]
        return {"error": errors[-1] if errors else f"exit code {rc}", "log": str(log), "wall_s": wall}
    return json.loads(out.read_text()) | {"wall_s": wall}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vllm-python", default=str(Path(__file__).resolve().parents[3] / ".venv-vllm-vl" / "bin" / "python"))
    p.add_argument("--work", type=Path, default=Path("/tmp/qwen25vl-vllm"))
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--spec-tokens", type=int, default=3)
    p.add_argument("--draft-vocab", type=int, default=256)
    p.add_argument("--configs", nargs="+", default=["base", "eagle3", "eagle3-fixed"],
                   help="base: no speculation; eagle3: the random head; eagle3-fixed: a head that always drafts "
                        "the reference output's most frequent token (accepted in part)")
    p.add_argument("--child", help=argparse.SUPPRESS)  # internal: one vLLM configuration, in the vLLM venv
    for name in ("target", "head", "image", "prompt", "out"):
        p.add_argument(f"--{name}", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        args.config = args.child
        Path(args.out).write_text(json.dumps(vllm_child(args)))
        return 0

    args.work.mkdir(parents=True, exist_ok=True)
    built = build(args.work, args.draft_vocab)
    result = {"reference": reference(built, args.max_tokens), "configs": {}}
    ref = result["reference"]
    fixed = max(set(ref["outputs"]), key=ref["outputs"].count)
    write_head(json.loads((args.work / "target" / "config.json").read_text()), args.work / "head-fixed", 0,
               keep_ids=[fixed])
    built["heads"]["eagle3-fixed"] = str(args.work / "head-fixed")
    result["fixed_draft_token"] = fixed
    print("transformers", json.dumps({k: v for k, v in ref.items()}), flush=True)
    ok = True
    for config in args.configs:
        r = run_vllm(args.vllm_python, built, config, args, args.work)
        if "error" not in r:
            r["prompt_matches"] = r["prompt_token_ids"] == ref["prompt_token_ids"]
            r["outputs_match"] = r["outputs"] == ref["outputs"]
            r["first_mismatch"] = next((i for i, (a, b) in enumerate(zip(r["outputs"], ref["outputs"])) if a != b),
                                       None)
        ok = ok and r.get("outputs_match", False)
        result["configs"][config] = r
        print(config, json.dumps({k: v for k, v in r.items() if k not in ("prompt_token_ids",)}), flush=True)
    (args.work / "result.json").write_text(json.dumps(result, indent=1))
    print("all outputs match transformers" if ok else "MISMATCH or error", "->", args.work / "result.json")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
