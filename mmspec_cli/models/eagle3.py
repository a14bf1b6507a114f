"""EAGLE-3's draft head (Li et al. 2025, arXiv 2503.01840): the network, its rotary positions and its draft vocabulary.

The network (EAGLE's ``traineagle3/cnets.py``, SpecForge's ``llama3_eagle.py``; ``shared/notes`` §A):

- **Fused feature** of token t: the target's residual stream at the INPUT of three decoder layers (by default
  2, L//2 and L − 3 of L), concatenated and mapped by ``fc`` (3·H_target → H, no bias).
- **Layer input** of entry t: the pair (e_{t+1}, x_t), the head's own input embedding of the NEXT token (a frozen
  copy of the target's; at an image slot the embedding of the placeholder id, as vLLM and SpecForge feed it) and
  the hidden stream x_t: the fused feature when the entry stands for a verified token, the head's own output at
  the parent entry (before the final norm) when it stands for a drafted one.
- **One decoder layer** (``midlayer``): attention over ``cat(input_layernorm(e), hidden_norm(x))`` (q/k/v take
  2·H), with the raw x as the residual; then ``post_attention_layernorm``, the SiLU MLP and a second residual.
- **Output**: h_t (the layer's output, fed on as the next entry's x); logits ``lm_head(norm(h_t))`` over the
  *draft vocabulary*: draft id i is target id ``i + d2t[i]``; ``t2d`` marks the target ids kept.

The entry at token t runs at the target's own position of t (M-RoPE's three rows for Qwen-VL targets, with the
target's sections, interleaved for Qwen3-VL), and a drafted entry at its parent's position + 1, as vLLM's proposer
runs it. An entry's output predicts token t + 2.

Parameter names are SpecForge's and SGLang's (``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``), so
such checkpoints load with no renaming; ``embed_tokens`` is never saved (it is the target's, copied at load).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from mmspec_cli.choices import EAGLE3
from mmspec_cli.models.head_folders import plain_rope
from mmspec_cli.models.parts import with_cache

KIND = EAGLE3
DEFAULT_DRAFT_VOCAB = 32000  # EAGLE's and SpecForge's draft_vocab_size


def default_layers(layers: int) -> tuple[int, int, int]:
    """EAGLE-3's target layers whose inputs are fused: (2, L//2, L − 3), vLLM's default too (shared/notes §A1, B6).
    A target of fewer than six layers has no three distinct such layers; there each id is clamped into
    [0, L − 1] (a head for it trains and drafts in mmspec; vLLM needs six layers or more)."""
    return tuple(min(max(k, 0), layers - 1) for k in (2, layers // 2, layers - 3))


def mrope_rows(half: int, sections: Sequence[int] | None, interleaved: bool) -> torch.Tensor | None:
    """Which of M-RoPE's position rows (0 temporal, 1 height, 2 width) drives each of a head dimension's ``half``
    rotary frequencies; None for 1-D rope.

    Sectioned (Qwen2-VL, Qwen2.5-VL: ``apply_multimodal_rotary_pos_emb``): the first ``sections[0]`` frequencies
    follow row 0, the next ``sections[1]`` row 1, the rest row 2. Interleaved (Qwen3-VL's
    ``apply_interleaved_mrope``): row 0 everywhere, then frequencies 1, 4, 7, ... (``sections[1]`` of them) row 1
    and 2, 5, 8, ... (``sections[2]``) row 2."""
    if not sections:
        return None
    rows = torch.zeros(half, dtype=torch.long)
    if interleaved:
        rows[1:3 * sections[1]:3] = 1
        rows[2:3 * sections[2]:3] = 2
        return rows
    start = 0
    for row, width in enumerate(sections):
        rows[start:start + width] = row
        start += width
    return rows


def rotary_angles(inv_freq: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """θ = position · inverse frequency (RoFormer Eq. 15), per frequency: positions (B, n), or M-RoPE's (3, B, n)
    with ``rows`` (:func:`mrope_rows`) picking the row each frequency reads. Returns (B, n, half)."""
    freqs = positions[..., None].float() * inv_freq.float()  # (B, n, half) or (3, B, n, half)
    if positions.dim() == 2:
        return freqs
    if rows is None:  # M-RoPE positions for a 1-D rope: the temporal row (what vLLM gives such a draft)
        return freqs[0]
    pick = torch.nn.functional.one_hot(rows.to(positions.device), positions.shape[0]).T.to(freqs.dtype)  # (3, half)
    return (freqs * pick[:, None, None, :]).sum(0)


class Eagle3Rotary(nn.Module):
    """cos and sin of a head's rotary embedding (B, n, head_dim) at 1-D or M-RoPE positions."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        base = LlamaRotaryEmbedding(config)  # its inverse frequencies and scaling, from the config's rope settings
        self.register_buffer("inv_freq", base.inv_freq, persistent=False)
        self.scaling = base.attention_scaling
        rows = mrope_rows(len(base.inv_freq), getattr(config, "mrope_section", None),
                          bool(getattr(config, "mrope_interleaved", False)))
        self.register_buffer("rows", rows if rows is not None else torch.zeros(0, dtype=torch.long),
                             persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = rotary_angles(self.inv_freq, positions, self.rows if len(self.rows) else None)
        emb = torch.cat([angles, angles], dim=-1)
        return (emb.cos() * self.scaling).to(x.dtype), (emb.sin() * self.scaling).to(x.dtype)


class Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer: attention reads the normed pair ``[e, x]`` (2·H wide), the residual is the raw x."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        hidden = config.hidden_size
        self.self_attn = LlamaAttention(config, layer_idx=0)
        attn = self.self_attn
        bias = bool(config.attention_bias)
        attn.q_proj = nn.Linear(2 * hidden, config.num_attention_heads * attn.head_dim, bias=bias)
        attn.k_proj = nn.Linear(2 * hidden, config.num_key_value_heads * attn.head_dim, bias=bias)
        attn.v_proj = nn.Linear(2 * hidden, config.num_key_value_heads * attn.head_dim, bias=bias)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)

    def forward(self, inputs: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None,
                cache=None) -> torch.Tensor:
        """(B, n, 2H) pairs ``cat(e, x)`` -> (B, n, H)."""
        embeds, residual = inputs.chunk(2, dim=-1)
        normed = torch.cat([self.input_layernorm(embeds), self.hidden_norm(residual)], dim=-1)
        attended, _ = self.self_attn(normed, position_embeddings=rope, attention_mask=mask, **with_cache(cache))
        hidden = residual + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Head(nn.Module):
    """An EAGLE-3 head over a target whose layer config is ``config`` (hidden size, heads, rope; ``vocab_size`` the
    target's), reading the inputs of the target's ``layers`` (each ``target_hidden`` wide), drafting over
    ``draft_vocab`` tokens."""

    kind = KIND
    sees_images = False

    def __init__(self, config: LlamaConfig, layers: Sequence[int], draft_vocab: int,
                 target_hidden: int | None = None):
        super().__init__()
        config._attn_implementation = "sdpa"
        hidden = config.hidden_size
        self.config = config
        self.layers_read = tuple(int(k) for k in layers)
        self.target_hidden = target_hidden or hidden
        self.draft_vocab = int(draft_vocab)
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden)
        self.embed_tokens.weight.requires_grad_(False)  # a frozen copy of the target's
        self.fc = nn.Linear(len(self.layers_read) * self.target_hidden, hidden, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, self.draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.t2d[:self.draft_vocab] = True
        self.rotary = Eagle3Rotary(config)

    @property
    def input_width(self) -> int:
        """The width of a layer input, the pair ``cat(e, x)``."""
        return 2 * self.config.hidden_size

    def set_vocabulary(self, kept: Sequence[int]) -> None:
        """The draft vocabulary: ``kept`` target ids (ascending, ``draft_vocab`` of them) -> ``d2t`` and ``t2d``."""
        ids = torch.tensor(sorted(int(t) for t in kept), dtype=torch.long, device=self.d2t.device)
        if len(ids) != self.draft_vocab:
            raise ValueError(f"{len(ids)} token ids for a draft vocabulary of {self.draft_vocab}")
        self.d2t.copy_(ids - torch.arange(self.draft_vocab, device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    @property
    def target_ids(self) -> torch.Tensor:
        """(draft_vocab,) the target id of each draft id."""
        return self._vocabulary()[0]

    @property
    def whole_vocabulary(self) -> bool:
        """Whether the draft vocabulary is the target's whole vocabulary in order (draft id i is target id i)."""
        return self._vocabulary()[1]

    def _vocabulary(self) -> tuple[torch.Tensor, bool]:
        """(target ids, whole vocabulary), worked out once per content of ``d2t`` (its tensor and version: loading
        replaces it, :meth:`set_vocabulary` writes it), not at every draft step (a host sync on a GPU)."""
        key = (id(self.d2t), self.d2t._version, self.d2t.device)
        if getattr(self, "_vocabulary_key", None) != key:
            with torch.inference_mode(False):  # kept: usable outside inference mode too (training, tests)
                ids = torch.arange(self.draft_vocab, device=self.d2t.device) + self.d2t
            self._vocabulary_cache = (ids, self.draft_vocab == self.config.vocab_size and not bool(self.d2t.any()))
            self._vocabulary_key = key
        return self._vocabulary_cache

    def fuse(self, embeds: torch.Tensor, features: torch.Tensor, glob: torch.Tensor | None = None) -> torch.Tensor:
        """Layer inputs ``cat(e, fc(f))`` of verified tokens: ``features`` the target's layer inputs (3·H_target wide).
        ``glob`` is a ViSpec notion, unused here."""
        return torch.cat([embeds, self.fc(features)], dim=-1)

    def feed_own(self, embeds: torch.Tensor, hidden: torch.Tensor, glob: torch.Tensor | None = None) -> torch.Tensor:
        """Layer inputs ``cat(e, h)`` of drafted tokens, each with its parent's output h (H wide, no ``fc``)."""
        return own_pair(embeds, hidden)

    def body(self, inputs: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
             cache=None) -> torch.Tensor:
        """The layer over (B, n, 2H) inputs at ``positions`` ((B, n), or M-RoPE's (3, B, n)) -> (B, n, H)."""
        return layer_pass(self.midlayer, self.rotary, inputs, positions, mask, cache)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., H) outputs -> (..., draft_vocab) logits."""
        return self.lm_head(self.norm(hidden))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., H) outputs -> logits over the TARGET's vocabulary: the draft logits at their target ids, −∞
        elsewhere, so that a softmax gives the proposal over the target's tokens (0 outside the draft vocabulary)."""
        draft = self.draft_logits(hidden)
        return draft if self.whole_vocabulary else full_vocabulary(draft, self.target_ids, self.config.vocab_size)


def own_pair(embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """:meth:`Eagle3Head.feed_own`, for a compiled step that must not hold the head itself."""
    return torch.cat([embeds, hidden], dim=-1)


def layer_pass(layer: nn.Module, rotary: nn.Module, inputs: torch.Tensor, positions: torch.Tensor,
               mask: torch.Tensor | None, cache=None) -> torch.Tensor:
    """:meth:`Eagle3Head.body` from its parts."""
    return layer(inputs, rotary(inputs, positions), mask, cache)


def full_vocabulary(draft_logits: torch.Tensor, target_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Draft-vocabulary logits (..., D) scattered into the target's vocabulary (..., V), −∞ at every other id
    (vLLM's ``Eagle3LlamaForCausalLM.compute_logits`` does the same)."""
    full = draft_logits.new_full((*draft_logits.shape[:-1], vocab_size), float("-inf"))
    full[..., target_ids] = draft_logits
    return full


def draft_vocabulary(counts: dict[int, int], size: int, vocab_size: int) -> tuple[list[int], float]:
    """EAGLE-3's draft vocabulary: the ``size`` most frequent answer tokens (ties: the smaller id), ascending, and the
    share of answer tokens they cover. Fewer distinct tokens than ``size``: the smallest unseen ids fill it (as
    SpecForge pads), covering nothing more."""
    ranked = sorted(counts, key=lambda t: (-counts[t], t))[:size]
    chosen = set(ranked)
    filler = (t for t in range(vocab_size) if t not in chosen)
    while len(chosen) < size:
        chosen.add(next(filler))
    total = sum(counts.values())
    covered = sum(counts[t] for t in ranked)
    return sorted(chosen), (covered / total if total else 0.0)


def head_config(text_config: Any, vocab_size: int) -> LlamaConfig:
    """The layer config of a new EAGLE-3 head for a target whose language model's config is ``text_config``: its
    hidden size, heads, MLP width, norm epsilon and rope settings, one layer, no attention bias (EAGLE-3's layer has
    none, whatever the target's), and the target's M-RoPE sections (``mrope_section``, ``mrope_interleaved``: Qwen3-VL)
    kept as attributes of their own, so that the head runs at the target's own positions
    (:class:`Eagle3Rotary`)."""
    fields = {k: v for k, v in text_config.to_dict().items()
              if k not in ("architectures", "model_type", "layer_types", "attention_bias", "mlp_bias",
                           "transformers_version", "dtype", "torch_dtype")}
    rope = fields.get("rope_parameters") or fields.get("rope_scaling")
    sections, interleaved = None, False
    if isinstance(rope, dict):
        sections = rope.get("mrope_section")
        interleaved = bool(rope.get("mrope_interleaved", False))
        for key in ("rope_parameters", "rope_scaling"):
            if key in fields:
                fields[key] = plain_rope(rope)
    fields.update(num_hidden_layers=1, vocab_size=vocab_size, attention_bias=False, mlp_bias=False,
                  tie_word_embeddings=False)
    config = LlamaConfig(**fields)
    config.mrope_section = list(sections) if sections else None
    config.mrope_interleaved = interleaved
    return config
