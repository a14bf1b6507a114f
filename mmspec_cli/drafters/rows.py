"""Several prompt rows of ONE draft model, run as one batch (IbED Alg. 1, TABED Alg. 1).

Each ensemble member is a row. Rows differ only in their prompt (the row's *prefix*: how the
images are shown to the draft); everything after it, the generated tokens and later turns'
text, is the same for all rows ("shared" tokens). Prefixes are left-padded to a common length
with an attention mask, and each row gets its own positions, so every draft step is one
forward for all rows and each row computes what it would compute alone. Rolling back
after verification rolls all rows' caches back together (one :class:`~mmspec_cli.decoding.kv_state.KVState`).

How a row's images enter depends on the draft's family (:mod:`mmspec_cli.models.families`):

- LLaVA-1.5 drafts get embeddings (``inputs_embeds``): text embeddings with each image's
  placeholder positions filled by its projected vision features, optionally average-pooled
  in their 2-D patch grid first (pooled drafting, TABED §6.1). This uses the model's own
  vision tower, projector and embedding table; nothing in transformers is patched.
- Qwen-VL drafts get the left-padded ids with every image row's processor tensors concatenated
  (``pixel_values``, ``image_grid_thw``): the model's own forward embeds them (Qwen3-VL's DeepStack
  included), at each row's own M-RoPE positions (``get_rope_index`` per row), and every later
  position of a row adds that row's rope offset. A batch holding a pooled row gets every image's features
  encoded here instead (:func:`encoded_row_images`, the pooled rows' pooled in their own merged grid), which
  the model's forward places itself (``mm_encoder_outputs``).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from mmspec_cli.decoding.compiled import CompiledGraphs, CompiledStep, compiled_chain, compiled_forward
from mmspec_cli.decoding.inference import inference
from mmspec_cli.decoding.kv import common_prefix_length, same_tensors, to_model
from mmspec_cli.decoding.kv_state import HeldState, KVState, StaticPool, static_pool
from mmspec_cli.decoding.sampling import working_dtype
from mmspec_cli.decoding.tree import PendingTree
from mmspec_cli.errors import ModelLoadError
from mmspec_cli.models.families import family_of
from mmspec_cli.models.parts import text_decoder, with_cache
from mmspec_cli.drafters.single import fit_vocab
from mmspec_cli.drafters.weights import mixture


@dataclass(frozen=True)
class Row:
    """One member's prompt: ids (image placeholders already sized for ``pool``) and its image tensors
    (the processor's: ``pixel_values``, and ``image_grid_thw`` for Qwen-VL)."""

    ids: list[int]
    vision: dict[str, torch.Tensor] = field(default_factory=dict)
    pool: int = 1  # kernel of the 2-D average pooling of vision features; 1 = none

    @property
    def pixel_values(self) -> torch.Tensor | None:
        return self.vision.get("pixel_values")


def llava_parts(model):
    """(vision tower, projector) of a LLaVA-1.5-style draft, refused with a clear line otherwise."""
    inner = getattr(model, "model", model)
    tower = getattr(inner, "vision_tower", None)
    projector = getattr(inner, "multi_modal_projector", None)
    layer = getattr(model.config, "vision_feature_layer", None)
    if model.config.model_type != "llava" or tower is None or projector is None or not isinstance(layer, int):
        raise ModelLoadError(
            f"batched ensemble and pooled drafting need a LLaVA-1.5-style draft (LlavaForConditionalGeneration, "
            f"one vision feature layer) or a Qwen-VL one; got {type(model).__name__}; "
            f"use a single drafter such as m or t"
        )
    return tower, projector


def image_features(model, pixel_values: torch.Tensor, pool: int = 1) -> torch.Tensor:
    """Projected vision features (n_images, tokens, H), pooled with a ``pool``×``pool`` kernel.

    LLaVA's own path (vision tower, select layer and strategy, projector), with the pooling
    inserted before the projector: 576 patch tokens (24×24) -> 144 with kernel 2. A side the
    kernel does not divide keeps its edge: windows there average the patches they cover
    (``ceil_mode``), so 3×3 -> 2×2 with kernel 2 and no patch is dropped.
    """
    tower, projector = llava_parts(model)
    config = model.config
    hidden = tower(pixel_values.to(model.device, model.dtype), output_hidden_states=True,
                   return_dict=True).hidden_states[config.vision_feature_layer]  # (n, 1+P, C)
    if config.vision_feature_select_strategy == "default":
        hidden = hidden[:, 1:]  # drop CLS: (n, P, C)
    if pool > 1:
        n, patches, channels = hidden.shape
        side = math.isqrt(patches)
        grid = hidden.transpose(1, 2).reshape(n, channels, side, side)  # (n, C, s, s)
        hidden = F.avg_pool2d(grid, kernel_size=pool, ceil_mode=True).flatten(2).transpose(1, 2)  # (n, P/pool², C)
    return projector(hidden)


def pooled_token_count(tokens_per_image: int, pool: int) -> int:
    side = math.isqrt(tokens_per_image)
    return (-(-side // pool)) ** 2  # ceil(side / pool) squared, as avg_pool2d(ceil_mode=True)


def row_embeddings(model, row: Row, image_token_id: int | None) -> torch.Tensor:
    """(L, H) input embeddings of one row, image placeholders replaced by vision features."""
    ids = torch.tensor(row.ids, dtype=torch.long, device=model.device)
    embeds = model.get_input_embeddings()(ids)  # (L, H)
    if row.pixel_values is not None and image_token_id is not None:
        features = image_features(model, row.pixel_values, row.pool).reshape(-1, embeds.shape[-1])
        slots = ids == image_token_id
        if int(slots.sum()) != features.shape[0]:
            raise ValueError(f"{int(slots.sum())} image placeholders but {features.shape[0]} image features")
        embeds = embeds.masked_scatter(slots[:, None], features.to(embeds.dtype))
    return embeds


def additive_step_mask(mask: torch.Tensor, fresh: int, dtype: torch.dtype) -> torch.Tensor:
    """The 4-D additive mask (B, 1, fresh, L) for the last ``fresh`` positions of a padded 2-D ``mask`` (B, L).

    0 where a query may attend (a real key at or before it), the dtype's minimum elsewhere;
    transformers passes a prepared 4-D mask to eager and sdpa attention as it is.
    """
    if fresh == 1:  # the last position sees every real key: only the padding is hidden (a decode step's case)
        hidden = (mask == 0)[:, None, None, :]  # (B, 1, 1, L)
        return torch.zeros(hidden.shape, dtype=dtype, device=mask.device).masked_fill(hidden, torch.finfo(dtype).min)
    length = mask.shape[1]
    queries = torch.arange(length - fresh, length, device=mask.device)[:, None]  # (fresh, 1)
    causal = torch.arange(length, device=mask.device)[None, :] <= queries  # (fresh, L)
    allowed = mask.bool()[:, None, None, :] & causal  # (B, 1, fresh, L)
    return torch.zeros(allowed.shape, dtype=dtype, device=mask.device).masked_fill(~allowed, torch.finfo(dtype).min)


def _images(row: Row) -> dict[str, torch.Tensor]:
    """A row's image tensors in the form ``kv.same_tensors`` compares (empty for text rows)."""
    return dict(row.vision) if row.pixel_values is not None else {}


def check_row_images(model, pooled: bool) -> None:
    """Refuse, in one line, a draft whose images batched rows can't feed: rows need a LLaVA-1.5-style draft or a
    Qwen-VL one; pooled Qwen-VL rows hand the model their pooled image features (``mm_encoder_outputs``), which
    its forward must take."""
    if not family_of(model).model_embeds_row_images:
        llava_parts(model)
    elif pooled and not takes_encoder_outputs(model):
        raise ModelLoadError(f"pooled drafting (p) with a {type(model).__name__} draft needs a transformers whose "
                             f"forward takes precomputed image features (mm_encoder_outputs; 5.24 does): upgrade "
                             f"transformers, or use m, t, c or an ensemble of them")


def takes_encoder_outputs(model) -> bool:
    """Whether a Qwen-VL model's forward takes precomputed image features (``mm_encoder_outputs``: transformers
    5.24 does), which pooled rows hand it."""
    return "mm_encoder_outputs" in inspect.signature(type(model.model).forward).parameters


def encoded_row_images(model, rows: Sequence[Row]) -> Any:
    """The vision encoder's output for every image of ``rows``, in row order, as a Qwen-VL model's forward computes
    it from their pixels (``get_image_features``), with each pooled row's images pooled in their merged grid
    (``QwenVLFamily.pool_image_features``; Qwen3-VL's DeepStack features alike): a batch holding a pooled row
    hands the model this as ``mm_encoder_outputs``, and the model places and adds the features itself."""
    family = family_of(model)
    seen = [r for r in rows if r.pixel_values is not None]
    grids = torch.cat([r.vision["image_grid_thw"] for r in seen])
    kernels = [r.pool for r in seen for _ in range(r.vision["image_grid_thw"].shape[0])]
    out = model.model.get_image_features(pixel_values=to_model(torch.cat([r.pixel_values for r in seen]), model),
                                         image_grid_thw=grids.to(model.device), return_dict=True)

    def pooled(features: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [family.pool_image_features(f, g, k) if k > 1 else f for f, g, k in zip(features, grids, kernels,
                                                                                      strict=True)]

    out.pooler_output = pooled(out.pooler_output)
    if getattr(out, "deepstack_features", None) is not None:
        out.deepstack_features = [pooled(layer) for layer in out.deepstack_features]
    return out


class BatchedRows:
    """The KV cache of a batch of rows: left-padded prefixes, then shared tokens fed to all rows.

    At a turn's start, :meth:`begin` and :meth:`logits` keep what an earlier turn left (the one prefix
    search); in a block, :meth:`extend` and :meth:`rollback` speak in lengths.

    Which keys a row sees is kept as the additive mask a decode step passes, ``keys`` (B, 1, 1, width): 0 at the
    row's real positions held (its prefix after the left padding, then the shared tokens), the dtype's minimum
    elsewhere. Feeding shares one more column, rolling back hides columns again: a step slices the buffer instead
    of building a mask from the 2-D one, and a row's position is its ``origin`` (minus its padding) plus the
    column it is fed at."""

    def __init__(self, model, image_token_id: int | None, kv: str = "dynamic"):
        self.model = model
        self.device, self.dtype = model.device, model.dtype  # transformers finds both from the parameters: each call
        self.attention = model.config._attn_implementation
        self.image_token_id = image_token_id
        self.family = family_of(model)
        self.positions = self.family.positions()  # after the prefixes: each row's rope offset (B, 1) for M-RoPE
        self.prefixes: list[list[int]] = []
        self.pixels: list[dict[str, torch.Tensor]] = []  # each prefix's image tensors
        self.rows: list[Row] = []  # the rows of the last prefill (a static state lost to another batch: re-fed)
        self.shared: list[int] = []  # shared tokens whose keys/values are in the cache
        self.kv = "dynamic"
        self.holding = HeldState(model.config, None, "draft")  # a static state: the pool of the rows' batch width
        self.compiled: CompiledStep | None = None
        self.chain: CompiledGraphs | None = None  # a greedy mixture chain in one graph (rows_step)
        self.use_kv(kv)
        self.length = 0  # columns held: the padded prefixes and the shared tokens
        self.keys = torch.zeros(0, 1, 1, 0, dtype=self.dtype)  # (B, 1, 1, width) additive: which keys each row sees
        self.origin = torch.zeros(0, 1, dtype=torch.long)  # (B, 1) minus each row's left padding: position = origin + column
        self.chain_origin = self.origin  # the positions at origin (rope offset added; M-RoPE's (3, B, 1)): rows_step's
        self.depths: dict[int, torch.Tensor] = {}  # arange(n) on the model's device, per n fed
        self.last_logits: torch.Tensor | None = None
        self.prefix_logits: torch.Tensor | None = None
        self.tree: PendingTree | None = None  # a token tree fed after the shared tokens, not settled yet

    @property
    def width(self) -> int:
        return len(self.prefixes)

    @property
    def state(self) -> KVState:
        """The rows' KV state (:class:`~mmspec_cli.decoding.kv_state.HeldState`'s)."""
        return self.holding.state

    @property
    def mask(self) -> torch.Tensor:
        """(B, length) 1 at each row's real positions held, 0 at its left padding."""
        return (self.keys[:, 0, 0, :self.length] == 0).long()

    def _key_mask(self, width: int) -> torch.Tensor:
        """The additive mask (B, 1, 1, ``width``) of a step feeding one position (fed already shown): a view of
        ``keys``, which a static state's capacity makes exactly as wide (so the view is the whole buffer, and a compiled
        step's ``contiguous()`` copies nothing)."""
        if self.keys.shape[-1] != width if self.state.static else self.keys.shape[-1] < width:
            self._resize(width if self.state.static else max(width, 2 * self.keys.shape[-1]))
        return self.keys if self.keys.shape[-1] == width else self.keys[..., :width]

    @torch.inference_mode(False)  # a normal tensor: rolling back (outside a forward) writes into it
    def _resize(self, width: int) -> None:
        grown = torch.full((self.width, 1, 1, width), torch.finfo(self.dtype).min, dtype=self.dtype,
                           device=self.device)
        kept = min(self.keys.shape[-1], width)
        grown[..., :kept] = self.keys[..., :kept]
        self.keys = grown

    def _show(self, fed: int) -> None:
        """``fed`` more shared columns, seen by every row."""
        if self.keys.shape[-1] < self.length + fed:
            self._resize(max(self.length + fed, 2 * self.keys.shape[-1]))
        self.keys[..., self.length:self.length + fed] = 0
        self.length += fed

    def _hide_padding(self, mask: torch.Tensor) -> None:
        """Hide each row's left padding (0 in the 2-D ``mask``)."""
        self.keys[:, 0, 0, :mask.shape[1]].masked_fill_(mask == 0, torch.finfo(self.dtype).min)

    def _hide(self, length: int) -> None:
        """Hold only the first ``length`` columns (all of them when ``length`` is more)."""
        length = min(length, self.length)
        self.keys[..., length:self.length] = torch.finfo(self.dtype).min
        self.length = length

    def _arange(self, n: int) -> torch.Tensor:
        depths = self.depths.get(n)
        if depths is None:
            depths = self.depths[n] = torch.arange(n, device=self.device)
        return depths

    def use_kv(self, kv: str) -> None:
        """Keep the rows' KV state as ``kv`` says (``kv.KV_KINDS``): static, and compiled, when the target's is.
        A static state is one per model and batch width in this process (``kv_state.static_pool``)."""
        if kv != self.kv:
            self.kv = kv
            self.compiled = compiled_forward(self.model, "draft") if kv == "compiled" else None
            self.chain = compiled_chain(self.model, "mixture chain", self.compiled, lambda: rows_step(self.model)) \
                if kv == "compiled" else None
            self.prefixes = []  # the next begin prefills into the new state

    def _pool(self, width: int) -> StaticPool | None:
        """The static pool of this model for a batch of ``width`` rows; None for a dynamic state."""
        return None if self.kv == "dynamic" else static_pool(self.model, f"rows{width}")

    def _owned(self, after: int = 1) -> bool:
        """At a turn's start: whether the state still holds these rows (a static state another batch of rows used
        since does not), with room for ``after`` more positions. In a block: :meth:`_still_held`."""
        return not self.width or self.holding.at_turn_start(self.state.length + after)

    def _still_mine(self, after: int = 1) -> bool:
        """:meth:`_owned`; when not, the rows are prefilled again (their shared tokens are then fed anew)."""
        mine = self._owned(after)
        if not mine:
            self._prefill(self.rows)
        return mine

    def _still_held(self) -> None:
        """In a block: the state must still hold these rows (``HeldState.in_block``)."""
        if self.width:
            self.holding.in_block(self.state.length + 1)

    def reserve(self, after: int) -> None:
        """Room in a static state for ``after`` more positions than the rows hold (at the start of a turn)."""
        self._still_mine(after)  # claimed with that room

    def begin(self, rows: Sequence[Row]) -> list[int]:
        """Use these rows' prompts; returns the shared tokens that must precede the generated ones.

        When every new prompt extends its row's old prefix by the same tokens (a later turn of
        the same conversation), the cached prefixes are kept and those tokens become shared.
        Otherwise the batch is prefilled anew.
        """
        self._drop_tree()
        same_images = all(same_tensors(_images(r), old) for r, old in zip(rows, self.pixels))
        if len(rows) == self.width and self.width and same_images and self._owned():
            tails = [r.ids[len(h):] for r, h in zip(rows, self.prefixes) if r.ids[: len(h)] == h]
            if len(tails) == self.width and all(t == tails[0] for t in tails) and self.image_token_id not in tails[0]:
                return list(tails[0])
        self._prefill(rows)
        return []

    @inference
    def _prefill(self, rows: Sequence[Row]) -> None:
        length = max(len(r.ids) for r in rows)
        mask = torch.zeros(len(rows), length, dtype=torch.long, device=self.model.device)  # (B, L)
        for b, r in enumerate(rows):
            mask[b, length - len(r.ids):] = 1
        positions, offsets = self.family.batch_positions(self.model, [(r.ids, self._laid_out(r)) for r in rows],
                                                         length, self.model.device)  # each row counts from 0
        self.positions = self.family.positions(offsets.to(self.device))  # added to the origins, on their device
        if self.family.model_embeds_row_images:
            inputs = self._model_inputs(rows, length)
        else:
            inputs = {"inputs_embeds": self._embeddings(rows, length)}
        self.holding.use(self._pool(len(rows)))
        self.holding.restart(length)
        self.prefixes = [list(r.ids) for r in rows]
        self.rows = list(rows)
        self.pixels = [_images(r) for r in rows]
        self.shared = []
        self.keys = torch.zeros(len(rows), 1, 1, 0, dtype=self.dtype, device=self.device)
        self.length = 0
        self._show(length)
        self._hide_padding(mask)
        self.origin = torch.tensor([[len(r.ids) - length] for r in rows], device=self.device)  # (B, 1) -padding
        self.chain_origin = self.positions.tree(self.origin, self._arange(1)).contiguous()
        self.prefix_logits = self._forward(length, positions=positions, mask=mask, **inputs)
        self.last_logits = self.prefix_logits

    def _embeddings(self, rows: Sequence[Row], length: int) -> torch.Tensor:
        """(B, L, H) left-padded input embeddings, images filled in by mmspec (LLaVA-1.5 drafts, pooled rows)."""
        embeds = [row_embeddings(self.model, r, self.image_token_id) for r in rows]
        batch = torch.zeros(len(rows), length, embeds[0].shape[-1], dtype=embeds[0].dtype, device=self.model.device)
        for b, e in enumerate(embeds):
            batch[b, length - e.shape[0]:] = e
        return batch

    def _laid_out(self, row: Row) -> dict[str, torch.Tensor]:
        """The image tensors a row's positions follow: a pooled Qwen-VL row's images as their pooled grid."""
        images = _images(row)
        if row.pool > 1 and "image_grid_thw" in images:
            return {"image_grid_thw": self.family.pooled_grid(images["image_grid_thw"], row.pool)}
        return images

    def _model_inputs(self, rows: Sequence[Row], length: int) -> dict[str, Any]:
        """Left-padded ids (B, L) with the image rows' tensors concatenated, for the model's own forward to embed;
        with a pooled row among them, every row's image features, encoded and pooled here (``encoded_row_images``)."""
        ids = torch.zeros(len(rows), length, dtype=torch.long, device=self.model.device)  # padding: masked
        for b, r in enumerate(rows):
            ids[b, length - len(r.ids):] = torch.tensor(r.ids, dtype=torch.long)
        if any(r.pool > 1 and r.pixel_values is not None for r in rows):
            return {"input_ids": ids, "mm_encoder_outputs": {"image": encoded_row_images(self.model, rows)}}
        images: dict[str, list[torch.Tensor]] = {}
        for r in rows:
            for key in ("pixel_values", "image_grid_thw"):
                if key in _images(r):
                    images.setdefault(key, []).append(r.vision[key])
        return {"input_ids": ids, **{k: to_model(torch.cat(v), self.model) for k, v in images.items()}}

    def _forward(self, fresh: int, positions: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                 **inputs) -> torch.Tensor:
        """Feed ``fresh`` new positions (ids or embeddings), shown already, to every row; last-position logits (B, V).
        ``positions`` and the 2-D ``mask``: given at a prefill; after it each row counts its own tokens (plus its
        rope offset), and sees the columns ``keys`` shows."""
        if positions is None:
            start = self.origin + (self.length - fresh)  # (B, 1) real positions before: all but the padding
            positions = self.positions.tree(start, self._arange(fresh))  # (B, n) or (3, B, n), on the device
        state = self.state
        if not (state.static or (self.shared and self.attention in ("sdpa", "eager"))):
            mask = self.mask if mask is None else mask  # 2-D: the model makes it causal (a prefill, other attention)
        elif fresh == 1:
            mask = self._key_mask(state.mask_width(1))  # a decode step sees every column shown: a view, no mask built
        else:  # the last ``fresh`` columns causal among themselves
            mask = state.fit_mask(additive_step_mask(self.mask if mask is None else mask, fresh, self.dtype))
        if self.compiled is not None and "input_ids" in inputs and "pixel_values" not in inputs \
                and "mm_encoder_outputs" not in inputs:
            compiled = self.compiled(state, inputs["input_ids"], positions, mask)
            if compiled is not None:
                return compiled[0][:, -1]
        state.room_for(fresh)
        out = self.model(attention_mask=mask, position_ids=positions, **with_cache(state.cache),
                         use_cache=True, logits_to_keep=1, **inputs)
        state.wrote(fresh)
        return out.logits[:, -1]

    def rollback(self, keep: int) -> None:
        """Keep the prefixes and the first ``keep`` shared tokens in the cache and the mask."""
        if keep >= len(self.shared) and self.tree is None:  # nothing to drop
            return
        self._drop_tree()
        self.last_logits = None  # they were the logits after what goes
        prefix_len = self.length - len(self.shared)
        self.state.rollback(prefix_len + keep)
        self._hide(prefix_len + keep)
        del self.shared[keep:]

    @inference
    def logits(self, shared: Sequence[int]) -> torch.Tensor:
        """At a turn's start: next-token logits (B, V) of every row after its prefix and ``shared`` (the shared tokens
        an earlier turn left are kept as far as they agree)."""
        self._drop_tree()
        self._still_mine()
        keep = common_prefix_length(self.shared, shared)
        if keep == len(shared):  # nothing new to feed
            if keep == len(self.shared) and self.last_logits is not None:
                return self.last_logits
            if keep == 0:
                self.rollback(0)
                self.last_logits = self.prefix_logits
                return self.prefix_logits
            keep -= 1  # re-feed the last token to get its logits
        self.rollback(keep)
        return self.extend(shared[keep:])

    @inference
    def extend(self, tokens: Sequence[int]) -> torch.Tensor:
        """In a block: feed ``tokens`` to every row after the shared tokens held; the last one's logits (B, V)."""
        self._still_held()
        self._drop_tree()
        fresh = list(tokens)
        self._show(len(fresh))
        self.shared.extend(fresh)
        ids = torch.tensor([fresh] * self.width, dtype=torch.long, device=self.device)  # (B, n)
        self.last_logits = self._forward(len(fresh), input_ids=ids)
        return self.last_logits

    @property
    def held(self) -> int:
        """Shared tokens held."""
        return len(self.shared)

    @inference
    def run_chain(self, first: tuple[torch.Tensor, torch.Tensor] | None, lead: list[int] | None, steps: int,
                  weights: torch.Tensor, vocab: int) -> tuple[list[int], torch.Tensor] | None:
        """In a block: a greedy chain of ``steps`` tokens in ONE compiled graph of :func:`rows_step`, from ``first``
        (the mixture after the shared tokens held, and the member distributions it mixes), or from feeding ``lead``
        (the verified tokens not held yet) first: the lead and every token but the last are fed to every row,
        the state's write pointers moved by the graph. The tokens and the member distributions (steps, B, vocab)
        each was chosen from; None (nothing fed) when it can't: not compiled, a tree pending, the state not
        allocated yet, or compiling failed."""
        if self.chain is None or self.tree is not None:
            return None
        self._still_held()
        state = self.state
        if not state.allocated:
            return None
        fed = steps - 1 + (0 if lead is None else len(lead))
        state.room_for(fed)
        keys = self._key_mask(state.capacity)  # (B, 1, 1, capacity): the buffer itself, the columns each row sees
        leading = None if lead is None else torch.tensor(lead, device=self.device)
        # no positions: each step reads its own from the state's write pointer and the rows' origins
        out = self.chain(first, leading, keys, None, steps, state.cache, weights.to(self.device), vocab,
                         self.chain_origin)
        if out is None:
            state.rollback(state.length)  # the pointers back where they were, whatever the failed call wrote
            return None
        tokens = out[0].tolist()
        state.wrote(fed)  # the graph moved the write pointers itself
        if lead is not None:
            self.shared.extend(lead)
        self.shared.extend(tokens[:-1])
        self._show(fed)
        self.last_logits = None  # the graph kept no logits
        if self.chain.device.type == "cuda":  # a CUDA graph's outputs are overwritten by its next replay
            return tokens, out[1].clone()
        return tokens, out[1]  # a CPU graph allocates its outputs at every call

    # ----------------------------------------------------------------- token trees (tree.PendingTree)

    @inference
    def tree_logits(self, tokens: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """Feed tree nodes (the same tokens to every row) after the shared tokens; logits (B, n, V).

        Each node sees its row's real prefix positions and its own ancestors; its position is
        the row's own token count plus its depth, so every row computes what it would alone.
        """
        if self.tree is None:
            self.tree = PendingTree(base=self.length)
        nodes = self.tree.add(tokens, parents)
        state = self.state
        mask, positions = self.tree.inputs(nodes, self.dtype, self.device, prefix=self.mask,
                                           positions=self.positions,
                                           width=state.mask_width(len(nodes)))  # (B, 1, n, W), (B, n)
        ids = torch.tensor([list(tokens)] * self.width, dtype=torch.long, device=self.device)  # (B, n)
        compiled = self.compiled(state, ids, positions, mask) if self.compiled is not None else None
        if compiled is not None:
            return compiled[0]  # (B, n, V)
        state.room_for(len(nodes))
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, **with_cache(state.cache),
                         use_cache=True, logits_to_keep=0)
        state.wrote(len(nodes))
        return out.logits  # (B, n, V)

    @inference
    def keep_path(self, nodes: Sequence[int]) -> None:
        """Settle the tree: the entries of ``nodes`` (one path) become shared tokens of every row."""
        if self.tree is None:
            return
        kept = self.tree.settle(self.state, nodes)
        self._show(len(kept))
        self.shared = self.shared + kept
        self.last_logits = None  # the logits after the kept path were not computed
        self.tree = None

    def _drop_tree(self) -> None:
        if self.tree is not None:
            self.tree.drop(self.state)
            self.tree = None


def rows_step(model) -> Callable:
    """A batch of member rows' draft step as one function of the draft model's parts, for the compiled chain
    (:func:`~mmspec_cli.decoding.compiled.compiled_chain`): every row is fed the same tokens (n,), seeing its own
    unpadded prefix, the shared tokens and the tokens before it: the additive mask the step-by-step rows pass, the
    rows' ``keys`` (B, 1, 1, capacity; the carry) with the slots this step writes (from the cache's write pointer on)
    shown causally. Each row reads its own positions, ``origin`` (its positions' origin: (B, 1), or M-RoPE's
    (3, B, 1)) plus the write pointer, as the step-by-step rows compute them. The rows' softmax after the last
    token (TABED's q_k at T = 1) is mixed with ``weights`` (:func:`~mmspec_cli.drafters.weights.mixture`). The
    proposal is (mixture (V,), q_k (B, V)): the chain chooses the mixture's argmax and keeps q_k."""
    decoder, embed, lm_head = text_decoder(model), model.get_input_embeddings(), model.get_output_embeddings()

    def step(tokens, keys, position, cache, weights, vocab, origin):  # position: None, the chain passes none
        n, rows, capacity = tokens.shape[0], keys.shape[0], keys.shape[-1]
        pointer = cache.layers[0].cumulative_length
        written = torch.arange(capacity, device=keys.device) - pointer  # a slot's place among the n written now
        depth = torch.arange(n, device=keys.device)
        own = (written >= 0) & (written <= depth[:, None])  # (n, capacity): each token sees those before it
        mask = keys.expand(rows, 1, n, capacity).masked_fill(own, 0)  # (B, 1, n, capacity)
        ids = tokens.reshape(1, n).expand(rows, n)
        hidden = decoder(inputs_embeds=embed(ids), position_ids=origin + pointer + depth, attention_mask=mask,
                         **with_cache(cache), use_cache=True).last_hidden_state
        logits = fit_vocab(lm_head(hidden)[:, -1], vocab)  # (B, V)
        q_k = torch.softmax(logits.to(working_dtype(logits)), dim=-1)
        return (mixture(q_k, weights), q_k), keys.masked_fill(own[-1], 0)

    return step
