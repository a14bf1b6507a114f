"""Trained draft heads that read the target's own hidden states: EAGLE-2's head and ViSpec's.

The network (ViSpec's ``cnets``; EAGLE's head is the same without the vision parts):

- **Inputs of entry p** (a *pair*): the target's last hidden state f_p (after its final norm,
  what feeds its LM head) and the input embedding e_{p+1} of the NEXT position (the one-position
  shift). At image slots e is the target's own input embedding there: the projector output.
- **Fusion:** ``fc(cat(e, f))`` with ``fc = Linear(2H, H)``; ``vispec`` first passes f through
  ``img_fc(cat(f, g))`` with the image's global feature g (zero before the first image).
- **Body:** one decoder layer of the target's shape (transformers' ``LlamaDecoderLayer``, its
  input norm replaced by the identity), then the TARGET's LM head (shared, never copied). A head whose
  config says ``qkv_bias: true`` (ViSpec's published Qwen2.5-VL heads, and mmspec's own heads for targets
  whose attention has q/k/v biases, as Qwen2's does) has transformers' ``Qwen2DecoderLayer`` instead:
  the same layer with biases on q, k and v (none on o).
- **Vision adaptor (vispec):** ``num_q`` learnable queries cross-attend over one image's projector
  outputs (:class:`ImageAdaptor`; with ``qkv_bias`` its k and v projections have biases too). The
  first ``num_q − 1`` outputs stand in the sequence where the image was, at the positions of its last
  slots, without ``fc``; the last output is g.

An entry's output h_p approximates f_{p+1}, so ``lm_head(h_p)`` predicts token p+2; drafting
feeds h back as the next entry's f. :func:`head_sequence` lays a sequence of pairs out as
entries (shared by inference and training, so both see the same layout).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import LlamaConfig, Qwen2Config
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

from mmspec_cli.models.parts import with_cache

#: The kinds of head this module builds, EAGLE-2's and ViSpec's (EAGLE-3's is ``models/eagle3.py``; all three:
#: ``choices.HEAD_KINDS``)
DRAFT_HEAD_KINDS = ("eagle", "vispec")
DEFAULT_NUM_Q = 2  # ViSpec's code (the paper says 1); published checkpoints don't store it
#: LlamaConfig keys a Qwen2 layer has no use for (its q/k/v biases are fixed, o has none, the MLP has none)
LLAMA_ONLY = ("model_type", "architectures", "transformers_version", "attention_bias", "mlp_bias", "pretraining_tp",
              "layer_types", "qkv_bias")


def has_qkv_bias(config: LlamaConfig) -> bool:
    """Whether a head of ``config`` has biases on q/k/v (``qkv_bias`` in its config.json, as ViSpec's Qwen heads)."""
    return bool(getattr(config, "qkv_bias", False))


def decoder_parts(config: LlamaConfig) -> tuple[nn.Module, nn.Module]:
    """The head's decoder layer and its rotary embedding, from transformers: Llama's, or Qwen2's (q/k/v biases, no
    o bias) when ``config`` has ``qkv_bias``. The Qwen2 layer attends over the whole head sequence (no sliding window)."""
    if not has_qkv_bias(config):
        return LlamaDecoderLayer(config, layer_idx=0), LlamaRotaryEmbedding(config)
    fields = {k: v for k, v in config.to_dict().items() if k not in LLAMA_ONLY}
    fields.update(num_hidden_layers=1, use_sliding_window=False)
    qwen = Qwen2Config(**fields)  # head_dim rides along as an extra key, which Qwen2Attention reads
    qwen._attn_implementation = "sdpa"
    return Qwen2DecoderLayer(qwen, layer_idx=0), Qwen2RotaryEmbedding(qwen)


class ImageAdaptor(nn.Module):
    """ViSpec's vision adaptor: ``num_q`` learnable queries attend (non-causal, one head group per
    attention head) over an image's projector outputs; no norm, no FFN, no positions."""

    def __init__(self, hidden: int, heads: int, num_q: int, bias: bool = False):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.q = nn.Parameter(torch.randn(num_q, heads, self.head_dim) * self.head_dim ** -0.5)
        self.k_proj = nn.Linear(hidden, hidden, bias=bias)
        self.v_proj = nn.Linear(hidden, hidden, bias=bias)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        """(m, H) projector outputs of one image -> (num_q, H)."""
        m = image.shape[0]
        keys = self.k_proj(image).view(m, self.heads, self.head_dim).transpose(0, 1)  # (heads, m, d)
        values = self.v_proj(image).view(m, self.heads, self.head_dim).transpose(0, 1)
        queries = self.q.to(image.dtype).transpose(0, 1)  # (heads, num_q, d)
        out = torch.nn.functional.scaled_dot_product_attention(queries, keys, values)  # (heads, num_q, d)
        return self.o_proj(out.transpose(0, 1).reshape(-1, self.heads * self.head_dim))


class DraftHead(nn.Module):
    """One draft head (``kind`` eagle or vispec) over a target of ``config``'s shape.

    Parameter names follow ViSpec's published checkpoints (``embed_tokens``, ``fc``, ``img_fc``,
    ``imadpt``, ``layers.0``), so those load with no renaming: 17 tensors for a LLaVA vispec head, 22 with
    ``qkv_bias`` (the published Qwen2.5-VL heads, e.g. ``JLKang/ViSpec-Qwen2.5-VL-7B-Instruct``: the five more
    are ``layers.0.self_attn.{q,k,v}_proj.bias`` and ``imadpt.{k,v}_proj.bias``).
    """

    def __init__(self, config: LlamaConfig, kind: str, num_q: int = DEFAULT_NUM_Q):
        super().__init__()
        if kind not in DRAFT_HEAD_KINDS:
            raise ValueError(f"unknown head kind {kind!r}")
        config._attn_implementation = "sdpa"
        self.config, self.kind, self.num_q = config, kind, num_q
        hidden = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden)
        self.embed_tokens.weight.requires_grad_(False)  # a frozen copy of the target's
        self.fc = nn.Linear(2 * hidden, hidden, bias=True)
        layer, rotary = decoder_parts(config)
        layer.input_layernorm = nn.Identity()  # the fused input is not normed (ViSpec, EAGLE)
        self.layers = nn.ModuleList([layer])
        self.rotary = rotary
        if kind == "vispec":
            self.img_fc = nn.Linear(2 * hidden, hidden)
            with torch.no_grad():  # [I | 0], bias 0: starts as the identity on f
                self.img_fc.weight.zero_()
                self.img_fc.weight[:, :hidden].copy_(torch.eye(hidden))
                self.img_fc.bias.zero_()
            self.imadpt = ImageAdaptor(hidden, config.num_attention_heads, num_q, bias=has_qkv_bias(config))

    @property
    def sees_images(self) -> bool:
        return self.kind == "vispec"

    @property
    def input_width(self) -> int:
        """The width of a layer input (the fused pair)."""
        return self.fc.out_features

    def feed_own(self, embeds: torch.Tensor, hidden: torch.Tensor, glob: torch.Tensor | None) -> torch.Tensor:
        """Layer inputs of drafted tokens, each with its parent's output h as its feature: fused as the target's are."""
        return self.fuse(embeds, hidden, glob)

    def fuse(self, embeds: torch.Tensor, features: torch.Tensor, glob: torch.Tensor | None) -> torch.Tensor:
        """The layer input of text pairs: ``fc(cat(e, f))``, or ``fc(cat(e, img_fc(cat(f, g))))`` (vispec)."""
        return fuse(self.fc, self.img_fc if self.sees_images else None, embeds, features, glob)

    def compress(self, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One image's projector outputs (m, H) -> its compressed tokens (num_q − 1, H) and g (H,)."""
        out = self.imadpt(image)
        return out[:-1], out[-1]

    def body(self, inputs: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache=None) -> torch.Tensor:
        """The decoder layer over (B, n, H) inputs at ``positions`` (B, n); ``mask`` additive (B, 1, n, seen)."""
        return layer_step(self.layers[0], self.rotary, inputs, positions, mask, cache)


def fuse(fc: nn.Module, img_fc: nn.Module | None, embeds: torch.Tensor, features: torch.Tensor,
         glob: torch.Tensor | None) -> torch.Tensor:
    """:meth:`DraftHead.fuse` from the head's parts (``img_fc`` None for eagle), for a compiled step that must not
    hold the head itself."""
    if img_fc is not None:
        g = torch.zeros_like(features) if glob is None else glob.expand_as(features)
        features = img_fc(torch.cat([features, g], dim=-1))
    return fc(torch.cat([embeds, features], dim=-1))


def layer_step(layer: nn.Module, rotary: nn.Module, inputs: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
               cache=None) -> torch.Tensor:
    """A head's decoder ``layer`` with its ``rotary`` embedding over (B, n, H) inputs (:meth:`DraftHead.body`)."""
    rope = rotary(inputs, positions)
    return layer(inputs, attention_mask=mask, position_ids=positions, **with_cache(cache),
                 use_cache=cache is not None, position_embeddings=rope)


@dataclass
class HeadSequence:
    """Pairs laid out as head entries: layer ``inputs`` (n, H) at ``positions`` (n,); ``pairs[i]`` the pair
    entry i stands for; ``predicts[i]`` whether its output is a next-token prediction (a text pair, not
    a compressed image token); ``glob`` the global feature in force after the last entry."""

    inputs: torch.Tensor
    positions: list[int]
    pairs: list[int]
    predicts: list[bool]
    glob: torch.Tensor | None


def image_runs(ids: Sequence[int], image_token_id: int | None, prompt_len: int) -> list[tuple[int, int]]:
    """[start, stop) of each run of image slots among the first ``prompt_len`` ids (slots after the
    prompt are ordinary tokens). Two images with no text between them are one run."""
    runs: list[tuple[int, int]] = []
    if image_token_id is None:
        return runs
    p = 0
    while p < prompt_len:
        if ids[p] == image_token_id:
            start = p
            while p < prompt_len and ids[p] == image_token_id:
                p += 1
            runs.append((start, p))
        else:
            p += 1
    return runs


def head_sequence(head: DraftHead, ids: Sequence[int], features: torch.Tensor, embeds: torch.Tensor,
                  first: int, image_token_id: int | None, prompt_len: int,
                  glob: torch.Tensor | None = None, offset: int = 0,
                  runs: list[tuple[int, int]] | None = None) -> HeadSequence:
    """Entries for pairs ``first .. len(ids) − 2``: pair p = (f_p, e_{p+1}).

    ``runs``: the prompt's :func:`image_runs`, when the caller knows them already (a drafter computes them once a
    turn: then only ``len(ids)`` is read of ``ids``).

    ``features`` (len(ids) − 1 − offset, H) the target's f_p and ``embeds`` (len(ids) − offset, H) its input
    embeddings e_p (projector outputs at image slots), both from position ``offset`` ≤ ``first`` on (a
    drafter passes only the rows it has not fed yet). ``eagle`` gets every pair. ``vispec`` replaces the pairs of each
    image run [s, t) in the prompt by the run's ``num_q − 1`` compressed tokens at positions t − num_q + 1
    .. t − 1, and feeds g of the latest image into every later text pair (``glob`` before ``first``).
    """
    last = len(ids) - 2
    if runs is None:
        runs = image_runs(ids, image_token_id, prompt_len)
    runs = runs if head.sees_images else []
    rows: list[torch.Tensor] = []
    positions: list[int] = []
    pairs: list[int] = []
    predicts: list[bool] = []
    p = first
    while p <= last:
        run = next(((s, t) for s, t in runs if s <= p < t), None)
        if run is None:
            stop = next((s for s, _ in runs if s > p), last + 1)
            stop = min(stop, last + 1)
            g = None if glob is None else glob[None]
            rows.append(head.fuse(embeds[p + 1 - offset:stop + 1 - offset], features[p - offset:stop - offset], g))
            positions += list(range(p, stop))
            pairs += list(range(p, stop))
            predicts += [True] * (stop - p)
            p = stop
            continue
        s, t = run
        compressed, glob = head.compress(embeds[s - offset:t - offset])
        count = min(len(compressed), t - s)
        kept = list(range(t - count, t))
        rows.append(compressed[len(compressed) - count:])
        positions += kept
        pairs += kept
        predicts += [False] * count
        p = t
    inputs = (rows[0] if len(rows) == 1 else torch.cat(rows)) if rows else features.new_zeros(0, head.input_width)
    return HeadSequence(inputs, positions, pairs, predicts, glob)


def causal_mask(new: int, seen: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive mask (1, 1, new, seen + new): every new entry sees the ``seen`` cached ones and the new ones up to itself."""
    if new == 1:  # one entry sees everything: a draft step's case
        return torch.zeros(1, 1, 1, seen + 1, dtype=dtype, device=device)
    allowed = torch.ones(new, seen + new, dtype=torch.bool, device=device)
    allowed[:, seen:] = torch.tril(allowed[:, seen:])
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)[None, None]
