"""The target's own features at every position its cache holds, for draft heads (EAGLE, ViSpec).

An EAGLE-2 or ViSpec head reads, per position, the target's last hidden state (after its final norm: what feeds
its LM head) and its input embedding (the projector output at image slots). Both come from ONE
forward hook on the target's language decoder, registered once per model: it reads the
decoder's ``inputs_embeds`` argument and its ``last_hidden_state`` output. An EAGLE-3 head reads instead the
residual stream at the input of a few decoder layers (``layers``), concatenated: one forward pre-hook per such
layer reads its ``hidden_states`` argument. Nothing in transformers is patched, and a forward of the target
computes nothing extra: the hooks keep references, read when a head takes them. Every row also keeps the position
ids it was fed at ((rows, n): 1, or M-RoPE's 3), which an EAGLE-3 head runs its entries at.

:class:`FeatureTrack` keeps those rows aligned with a :class:`~mmspec_cli.decoding.kv.CachedModel`'s
``ids``: the cached model crops, clears and extends it exactly as it does its KV cache, and for
a token tree holds the rows of every fed node until the accepted path is known.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from mmspec_cli.models.parts import text_decoder


class _Tap:
    """The hooks' last reading of one model: (input embeddings, features), each (n, ·): the last hidden states, or
    the inputs of ``layers`` concatenated. The hooks only keep references; embedding token ids and concatenating
    the layers' inputs wait for :meth:`take`, so a forward nobody reads (another drafter's, once a head has run on
    this model) costs nothing more."""

    def __init__(self, decoder: torch.nn.Module, layers: tuple[int, ...] = ()):
        self.latest: tuple[Any, ...] | None = None  # (decoder, inputs_embeds or None, input ids, feature parts)
        self.layers = layers
        self.inputs: dict[int, torch.Tensor] = {}
        self.decoder = decoder
        for k in layers:
            decoder.layers[k].register_forward_pre_hook(self._reader_of(k), with_kwargs=True)
        decoder.register_forward_hook(self._read, with_kwargs=True)

    def _reader_of(self, k: int):
        def read(module, args, kwargs) -> None:
            self.inputs[k] = args[0] if args else kwargs["hidden_states"]
        return read

    def _read(self, module, args, kwargs, output) -> None:
        embeds = kwargs.get("inputs_embeds")
        ids = None if embeds is not None else kwargs.get("input_ids", args[0] if args else None)
        if self.layers:
            parts = [self.inputs[k] for k in self.layers]  # an id may repeat (a target of few layers)
            self.inputs = {}
        else:
            parts = [output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]]
        self.latest = (module, embeds, ids, parts)

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.latest is None:
            raise RuntimeError("the target ran no forward since the feature tap was read")
        (module, embeds, ids, parts), self.latest = self.latest, None
        if embeds is None:  # a decoder called with token ids embeds them itself
            embeds = module.embed_tokens(ids)
        features = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        return embeds[0].detach(), features[0].detach()


_TAPS: "weakref.WeakKeyDictionary[Any, dict[tuple[int, ...], _Tap]]" = weakref.WeakKeyDictionary()


def tap_for(model: Any, layers: tuple[int, ...] = ()) -> _Tap:
    """The one tap of ``model`` reading ``layers``' inputs (none: its last hidden states), registered on first use."""
    taps = _TAPS.setdefault(model, {})
    if layers not in taps:
        taps[layers] = _Tap(text_decoder(model), layers)
    return taps[layers]


class FeatureTrack:
    """Input embeddings, features (the last hidden states after the final norm, or the inputs of ``layers``) and
    position ids of the cached positions: (len, H), (len, F) and (len, R) (R = 1, or 3 for M-RoPE).

    The rows live in preallocated buffers that double when full, so a long turn appends in amortised O(1) per
    position instead of re-copying every row (``torch.cat``); :attr:`embeds`, :attr:`hidden` and :attr:`positions`
    are views of the held rows.
    """

    def __init__(self, model: Any, layers: tuple[int, ...] = ()):
        self.layers = tuple(layers)
        self.tap = tap_for(model, self.layers)
        self._rows: list[torch.Tensor] | None = None  # embeds (capacity, H), hidden (capacity, F), positions (capacity, R)
        self.length = 0
        self._tree: list[tuple[torch.Tensor, ...]] = []  # rows of fed tree nodes, in feeding order

    def __len__(self) -> int:
        return self.length

    def _held(self, which: int) -> torch.Tensor | None:
        return None if self._rows is None else self._rows[which][:self.length]

    @property
    def embeds(self) -> torch.Tensor | None:
        return self._held(0)

    @property
    def hidden(self) -> torch.Tensor | None:
        return self._held(1)

    @property
    def positions(self) -> torch.Tensor | None:
        """(len, R) the position ids each held row was fed at."""
        return self._held(2)

    def clear(self) -> None:
        self.length = 0
        self._tree = []

    def crop(self, length: int) -> None:
        self._tree = []
        self.length = min(self.length, length)

    def extend(self, positions: torch.Tensor) -> None:
        """Append every row of the (eager) forward that just ran (the positions it fed, in order, at ``positions``:
        (1, n), or M-RoPE's (3, 1, n))."""
        self._append(*self.tap.take(), positions)

    def append_rows(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> None:
        """Append rows a compiled forward returned (a forward hook does not run inside a compiled graph)."""
        self._append(embeds, hidden, positions)

    def hold_tree(self, positions: torch.Tensor) -> None:
        """Keep the rows of the tree nodes the (eager) forward that just ran fed, until :meth:`settle_tree`."""
        self.hold_tree_rows(*self.tap.take(), positions)

    def hold_tree_rows(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> None:
        """Keep these tree nodes' rows (in feeding order) until :meth:`settle_tree`."""
        self._tree.extend(zip(embeds, hidden, position_rows(positions)))

    def settle_tree(self, fed_nodes: Sequence[int]) -> None:
        """Append the rows of these fed tree nodes (the accepted path's, in order); forget the rest."""
        rows = [self._tree[node] for node in fed_nodes]
        self._tree = []
        if rows:
            self._grow(*(torch.stack(part) for part in zip(*rows)))

    def drop_tree(self) -> None:
        self._tree = []

    def _append(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor) -> None:
        self._grow(embeds, hidden, position_rows(positions))

    def _grow(self, *parts: torch.Tensor) -> None:
        needed = self.length + parts[0].shape[0]
        if self._rows is None or needed > self._rows[0].shape[0]:
            capacity = max(needed, 2 * (0 if self._rows is None else self._rows[0].shape[0]), 64)
            grown = [part.new_empty(capacity, part.shape[-1]) for part in parts]
            if self.length:
                for new, old in zip(grown, self._rows):
                    new[:self.length] = old[:self.length]
            self._rows = grown
        for buffer, part in zip(self._rows, parts):
            buffer[self.length:needed] = part
        self.length = needed


def position_rows(positions: torch.Tensor) -> torch.Tensor:
    """Position ids as a forward takes them, (1, n) or M-RoPE's (3, 1, n), as (n, R): one row per position."""
    return positions.reshape(-1, positions.shape[-1]).T


def position_ids(rows: torch.Tensor) -> torch.Tensor:
    """:func:`position_rows` undone: (n, R) rows as the (1, n), or M-RoPE's (3, 1, n), a forward takes."""
    return rows.T if rows.shape[-1] == 1 else rows.T[:, None, :]
