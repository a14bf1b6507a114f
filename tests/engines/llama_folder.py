"""Write the language model of a LLaVA checkpoint as a plain ``LlamaForCausalLM`` folder.

vLLM's CPU build cannot run LLaVA targets here (its multimodal registry needs torchvision), but a LLaVA's language
model is an ordinary Llama: same weights under other names. This module copies those weights into a folder that any
engine loads as ``LlamaForCausalLM`` (config = the LLaVA text config), plus the target's tokenizer files.

Runs in mmspec's venv (torch, transformers, safetensors only)::

    .venv/bin/python tests/engines/llama_folder.py mmspec_cli/shipped/demo-target /tmp/demo-llama [--check]

``--pad-head-dim 64`` writes the same function with head_dim 64 (vLLM's CPU attention refuses the demo's 36).
``--tiny-head-dim 32`` instead writes a random 8-layer Llama with that head_dim and the target's tokenizer.
``--check`` compares greedy ``generate`` of the LLaVA model and of the Llama folder on a few text-only prompts.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

# LLaVA checkpoints name the language model either way (transformers < 4.52 and >= 4.52 layouts).
_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model.",
             "language_model.lm_head.": "lm_head.", "lm_head.": "lm_head."}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "special_tokens_map.json", "generation_config.json")


def _rename(name: str) -> str | None:
    for old, new in _PREFIXES.items():
        if name.startswith(old):
            return new + name[len(old):]
    return None  # vision tower, projector


def write_language_model(target_dir, out_dir, dtype: str | None = None) -> Path:
    """Write ``out_dir`` (config.json, model.safetensors, tokenizer files) from the LLaVA folder ``target_dir``."""
    target_dir, out_dir = Path(target_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = json.loads((target_dir / "config.json").read_text())
    text = dict(config["text_config"])
    text.update(architectures=["LlamaForCausalLM"], model_type="llama",
                dtype=dtype or text.get("dtype") or config.get("dtype", "float32"))
    text.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", False))

    tensors = {}
    for file in sorted(target_dir.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for name in f.keys():
                new = _rename(name)
                if new is not None:
                    tensors[new] = f.get_tensor(name)
    if dtype:
        tensors = {k: v.to(getattr(torch, dtype)) for k, v in tensors.items()}
    if text["tie_word_embeddings"]:
        tensors.pop("lm_head.weight", None)  # tied: the loader takes it from embed_tokens
    elif "lm_head.weight" not in tensors:
        raise ValueError(f"{target_dir}: no lm_head weight and embeddings are not tied")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(text, indent=2))

    for name in _TOKENIZER_FILES:
        if (target_dir / name).exists():
            shutil.copy(target_dir / name, out_dir / name)
    tok_config = target_dir / "tokenizer_config.json"
    if tok_config.exists():
        tok = json.loads(tok_config.read_text())
        tok.pop("processor_class", None)  # a Llama folder has no processor
        tok.pop("image_token", None)
        (out_dir / "tokenizer_config.json").write_text(json.dumps(tok, indent=2))
    return out_dir


def _padder(heads: int, kv_heads: int, d: int, head_dim: int):
    """A function (tensor name, weight) -> the weight for ``head_dim`` (see :func:`pad_head_dim`)."""
    keep = torch.cat([torch.arange(d // 2), head_dim // 2 + torch.arange(d // 2)])  # where old dims go

    def pad_rows(w, n_heads, scale=1.0):  # (n_heads*d, in) -> (n_heads*head_dim, in)
        out = w.new_zeros(n_heads, head_dim, w.shape[1])
        out[:, keep] = w.view(n_heads, d, -1) * scale
        return out.reshape(n_heads * head_dim, -1)

    def pad(name: str, w: torch.Tensor) -> torch.Tensor:
        if name.endswith("q_proj.weight"):
            return pad_rows(w.float(), heads, (head_dim / d) ** 0.5).to(w.dtype)
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            return pad_rows(w, kv_heads)
        if name.endswith("o_proj.weight"):
            return pad_rows(w.t(), heads).t()
        if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
            raise ValueError(f"{name}: attention biases are not padded here")
        return w

    return pad


def _padded_config(config: dict, head_dim: int) -> tuple[dict, int]:
    """``config`` for ``head_dim`` (rope theta^(D/d), both the ``rope_parameters`` and a legacy top-level
    ``rope_theta`` when present) and the old head_dim d."""
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    d = config.get("head_dim") or hidden // heads
    rope = dict(config.get("rope_parameters") or {"rope_theta": config.get("rope_theta", 10000.0)})
    if rope.get("rope_type", "default") != "default" or head_dim % 2 or head_dim < d or d % 2:
        raise ValueError("only default RoPE, and an even head_dim not below the current (even) one")
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0)) ** (head_dim / d)
    rope["rope_theta"] = theta
    out = dict(config, head_dim=head_dim, rope_parameters=rope)
    if "rope_theta" in config:
        out["rope_theta"] = theta
    return out, d


def _pad_folder(src, out_dir, head_dim: int, copy: tuple[str, ...] = (), dtype: torch.dtype | None = None) -> Path:
    """config.json and model.safetensors of ``src`` padded to ``head_dim`` (floating tensors cast to ``dtype`` first,
    when given), plus the files ``copy``."""
    src, out_dir = Path(src), Path(out_dir)
    config = json.loads((src / "config.json").read_text())
    padded, d = _padded_config(config, head_dim)
    pad = _padder(config["num_attention_heads"], config["num_key_value_heads"], d, head_dim)

    def cast(w):
        return w.to(dtype) if dtype is not None and w.is_floating_point() else w

    with safe_open(src / "model.safetensors", "pt") as f:
        tensors = {name: pad(name, cast(f.get_tensor(name))).contiguous() for name in f.keys()}
    if dtype is not None:
        for key in ("dtype", "torch_dtype"):
            if key in padded:
                padded[key] = str(dtype).removeprefix("torch.")
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(padded, indent=2))
    for name in copy:
        if (src / name).exists():
            shutil.copy(src / name, out_dir / name)
    return out_dir


def pad_head_dim(llama_dir, out_dir, head_dim: int = 64) -> Path:
    """Rewrite a Llama folder with a larger ``head_dim`` that computes the same function (up to rounding).

    vLLM's CPU attention only takes some head sizes (32, 64, 80, ...); the demo target has 36. Each head's q/k/v rows
    are zero-padded, keeping the two rotary halves (dims i and i + d/2 rotate together) at i and i + D/2; ``rope_theta``
    becomes theta^(D/d) so the kept dims rotate at the same frequencies; q is scaled by sqrt(D/d) so that the
    1/sqrt(head_dim) softmax scale is unchanged; the padded value dims meet zero columns of o_proj.
    """
    return _pad_folder(llama_dir, out_dir, head_dim, _TOKENIZER_FILES + ("tokenizer_config.json",))


def pad_eagle3_head_dim(head_dir, out_dir, head_dim: int = 64, dtype: torch.dtype | None = torch.float32) -> Path:
    """The same rewrite for an EAGLE-3 head folder (SpecForge's/vLLM's layout, e.g. from ``mmspec export-head --to
    vllm``): ``midlayer.self_attn.{q,k,v}_proj`` rows padded per head (they read 2·H inputs, unchanged),
    ``o_proj``'s input columns padded, q scaled by sqrt(D/d), rope theta^(D/d); every other tensor and config key
    (``d2t``, ``t2d``, ``eagle_aux_hidden_state_layer_ids``, the ``mmspec`` block) as it is. A head of a target
    padded with :func:`pad_head_dim` to the same ``head_dim`` then rotates at the target's frequencies again.
    Floating weights are cast to ``dtype`` (float32) BEFORE padding: heads are saved in float16, and q's sqrt(D/d)
    scale would round in float16; both engines run the head in the target's float32 anyway."""
    return _pad_folder(head_dir, out_dir, head_dim, dtype=dtype)


def write_tiny_llama(out_dir, tokenizer_from=None, head_dim: int = 32, hidden: int = 128, layers: int = 8,
                     vocab: int = 1200, seed: int = 0) -> Path:
    """A random ``LlamaForCausalLM`` folder (4 heads, 2 KV heads, tied embeddings, init std 0.1), float32.

    For head dimensions vLLM's CPU attention supports (32, 64, 80, ...), unlike the demo target's 36. The tokenizer
    files are copied from ``tokenizer_from`` (e.g. the demo target), whose vocabulary should be ``vocab``.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    out_dir = Path(out_dir)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=int(2.75 * hidden), head_dim=head_dim,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                         max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                         pad_token_id=3, initializer_range=0.1)  # 0.02 gives one repeated token
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out_dir)
    if tokenizer_from:
        tok = Path(tokenizer_from)
        for name in _TOKENIZER_FILES + ("tokenizer_config.json",):
            if (tok / name).exists() and name != "generation_config.json":
                shutil.copy(tok / name, out_dir / name)
    return out_dir


def greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """New token ids of greedy ``generate`` for each prompt (batch size 1, stops at EOS like vLLM)."""
    outs = []
    for ids in prompts:
        x = torch.tensor([ids])
        with torch.no_grad():
            y = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                               do_sample=False, num_beams=1)
        outs.append(y[0, len(ids):].tolist())
    return outs


def check_same_outputs(target_dir, llama_dir, prompts, max_new_tokens=40, dtype=torch.float32):
    """Greedy outputs of the LLaVA model and of the Llama folder; raises if they differ."""
    from transformers import AutoModelForCausalLM, LlavaForConditionalGeneration

    llava = LlavaForConditionalGeneration.from_pretrained(target_dir, dtype=dtype).eval()
    llama = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=dtype).eval()
    a, b = greedy(llava, prompts, max_new_tokens), greedy(llama, prompts, max_new_tokens)
    if a != b:
        raise AssertionError(f"LLaVA and Llama greedy outputs differ:\n{a}\n{b}")
    return a


def demo_prompts(n: int = 3, length: int = 20, vocab: int = 1200, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of ``length`` token ids: BOS then ids away from the special ones (0-4 incl. the image token)."""
    g = torch.Generator().manual_seed(seed)
    return [[1] + torch.randint(10, vocab, (length - 1,), generator=g).tolist() for _ in range(n)]


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("target")
    p.add_argument("out")
    p.add_argument("--dtype", default=None, help="cast the weights (e.g. float32); default: keep the target's")
    p.add_argument("--check", action="store_true", help="compare greedy generate of both models")
    p.add_argument("--tiny-head-dim", type=int, help="instead: write a random tiny Llama with this head_dim to OUT, "
                                                      "with TARGET's tokenizer")
    p.add_argument("--pad-head-dim", type=int, help="write the same model with this head_dim (see pad_head_dim)")
    args = p.parse_args()
    if args.tiny_head_dim:
        print(write_tiny_llama(args.out, args.target, head_dim=args.tiny_head_dim))
        raise SystemExit
    if args.pad_head_dim:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            pad_head_dim(write_language_model(args.target, tmp, args.dtype), args.out, args.pad_head_dim)
    else:
        write_language_model(args.target, args.out, args.dtype)
    print(args.out)
    if args.check:
        print(json.dumps(check_same_outputs(args.target, args.out, demo_prompts())))
