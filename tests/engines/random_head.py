"""Write a random EAGLE-3 head in SpecForge's checkpoint layout for a Llama target folder.

The layout is what SpecForge's ``save_pretrained`` writes and what vLLM (``method: "eagle3"``) and SGLang load:
config.json with ``architectures: ["LlamaForCausalLMEagle3"]`` and ``draft_vocab_size``; tensors ``fc.weight``
(H, 3H), ``midlayer.self_attn.{q,k,v}_proj.weight`` taking 2H inputs, ``midlayer.self_attn.o_proj.weight``,
``midlayer.mlp.{gate,up,down}_proj.weight``, ``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight``,
``norm.weight``, ``lm_head.weight`` (draft_vocab, H), ``d2t`` (int64, target = draft + d2t[draft]) and ``t2d`` (bool
mask over the target vocabulary). No ``embed_tokens``: engines take the target's.

Runs in mmspec's venv (torch + safetensors)::

    .venv/bin/python tests/engines/random_head.py /tmp/demo-llama /tmp/demo-head [--draft-vocab 600] [--seed 0]
    .venv/bin/python tests/engines/random_head.py /tmp/demo-llama /tmp/head-263 --keep-ids 263   # always drafts 263
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

_COPIED = ("hidden_act", "rms_norm_eps", "max_position_embeddings", "vocab_size", "bos_token_id", "eos_token_id",
           "pad_token_id", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
           "hidden_size", "rope_parameters", "rope_theta", "rope_scaling")


def head_config(target_config: dict, draft_vocab: int) -> dict:
    config = {k: target_config[k] for k in _COPIED if k in target_config}
    config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope:
        config.setdefault("rope_theta", rope["rope_theta"])  # legacy key, as SpecForge's exporter mirrors it
    config.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
                  draft_vocab_size=draft_vocab, tie_word_embeddings=False, dtype="float32", torch_dtype="float32")
    return config


def random_head_tensors(config: dict, seed: int = 0, std: float = 0.05, keep_ids=None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, inter, vocab, dv = (config["hidden_size"], config["intermediate_size"], config["vocab_size"],
                           config["draft_vocab_size"])
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]

    def rand(*shape):
        return torch.randn(*shape, generator=g) * std

    t = {"fc.weight": rand(h, 3 * h),
         "midlayer.self_attn.q_proj.weight": rand(q, 2 * h),
         "midlayer.self_attn.k_proj.weight": rand(kv, 2 * h),
         "midlayer.self_attn.v_proj.weight": rand(kv, 2 * h),
         "midlayer.self_attn.o_proj.weight": rand(h, q),
         "midlayer.mlp.gate_proj.weight": rand(inter, h),
         "midlayer.mlp.up_proj.weight": rand(inter, h),
         "midlayer.mlp.down_proj.weight": rand(h, inter),
         "norm.weight": torch.ones(h),
         "lm_head.weight": rand(dv, h)}
    for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        t[f"midlayer.{name}.weight"] = torch.ones(h)
    # draft vocabulary: a random sorted subset of the target's ids (EAGLE keeps the most frequent ones, sorted)
    kept = torch.randperm(vocab, generator=g)[:dv] if keep_ids is None else torch.tensor(keep_ids)
    kept = kept.sort().values
    t["d2t"] = kept - torch.arange(dv)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    t["t2d"] = t2d
    return t


def write_random_head(target_dir, out_dir, draft_vocab: int | None = None, seed: int = 0, keep_ids=None) -> Path:
    """Write the head; ``keep_ids`` fixes the draft vocabulary (e.g. ``[263]``: a head that always drafts 263)."""
    target_dir, out_dir = Path(target_dir), Path(out_dir)
    target_config = json.loads((target_dir / "config.json").read_text())
    draft_vocab = len(keep_ids) if keep_ids is not None else draft_vocab or target_config["vocab_size"]
    config = head_config(target_config, draft_vocab)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = random_head_tensors(config, seed, keep_ids=keep_ids)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("target", help="a LlamaForCausalLM folder (e.g. from llama_folder.py)")
    p.add_argument("out")
    p.add_argument("--draft-vocab", type=int, default=None, help="default: the target's whole vocabulary")
    p.add_argument("--keep-ids", type=int, nargs="+", help="the draft vocabulary (default: random ids)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    print(write_random_head(a.target, a.out, a.draft_vocab, a.seed, a.keep_ids))
