"""The target's own features at every position its cache holds, for draft heads (EAGLE, ViSpec).

A head reads, per position, the target's last hidden state (after its final norm: what feeds
its LM head) and its input embedding (the projector output at image slots). Both come from ONE
forward hook on the target's language decoder, registered once per model: it reads the
decoder's ``inputs_embeds`` argument and its ``last_hidden_state`` output. Nothing in
transformers is patched, and a forward of the target computes nothing extra.

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
    """The hook's last reading of one model: (input embeddings, last hidden states), each (n, H)."""

    def __init__(self, decoder: torch.nn.Module):
        self.latest: tuple[torch.Tensor, torch.Tensor] | None = None
        self.decoder = decoder
        decoder.register_forward_hook(self._read, with_kwargs=True)

    def _read(self, module, args, kwargs, output) -> None:
        embeds = kwargs.get("inputs_embeds")
        if embeds is None:  # a decoder called with token ids embeds them itself
            ids = kwargs.get("input_ids", args[0] if args else None)
            embeds = module.embed_tokens(ids)
        hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
        self.latest = (embeds[0].detach(), hidden[0].detach())

    def take(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.latest is None:
            raise RuntimeError("the target ran no forward since the feature tap was read")
        latest, self.latest = self.latest, None
        return latest


_TAPS: "weakref.WeakKeyDictionary[Any, _Tap]" = weakref.WeakKeyDictionary()


def tap_for(model: Any) -> _Tap:
    """The one tap of ``model`` (registered on first use)."""
    if model not in _TAPS:
        _TAPS[model] = _Tap(text_decoder(model))
    return _TAPS[model]


class FeatureTrack:
    """Input embeddings and last hidden states (after the final norm) of the cached positions, (len, H) each.

    The rows live in two preallocated buffers that double when full, so a long turn appends in
    amortised O(1) per position instead of re-copying every row (``torch.cat``); :attr:`embeds` and
    :attr:`hidden` are views of the held rows.
    """

    def __init__(self, model: Any):
        self.tap = tap_for(model)
        self._embeds: torch.Tensor | None = None  # (capacity, H)
        self._hidden: torch.Tensor | None = None
        self.length = 0
        self._tree: list[tuple[torch.Tensor, torch.Tensor]] = []  # rows of fed tree nodes, in feeding order

    def __len__(self) -> int:
        return self.length

    @property
    def embeds(self) -> torch.Tensor | None:
        return None if self._embeds is None else self._embeds[:self.length]

    @property
    def hidden(self) -> torch.Tensor | None:
        return None if self._hidden is None else self._hidden[:self.length]

    def clear(self) -> None:
        self.length = 0
        self._tree = []

    def crop(self, length: int) -> None:
        self._tree = []
        self.length = min(self.length, length)

    def extend(self) -> None:
        """Append every row of the (eager) forward that just ran (the positions it fed, in order)."""
        self._append(*self.tap.take())

    def append_rows(self, embeds: torch.Tensor, hidden: torch.Tensor) -> None:
        """Append rows a compiled forward returned (a forward hook does not run inside a compiled graph)."""
        self._append(embeds, hidden)

    def hold_tree(self) -> None:
        """Keep the rows of the tree nodes the (eager) forward that just ran fed, until :meth:`settle_tree`."""
        self.hold_tree_rows(*self.tap.take())

    def hold_tree_rows(self, embeds: torch.Tensor, hidden: torch.Tensor) -> None:
        """Keep these tree nodes' rows (in feeding order) until :meth:`settle_tree`."""
        self._tree.extend(zip(embeds, hidden))

    def settle_tree(self, fed_nodes: Sequence[int]) -> None:
        """Append the rows of these fed tree nodes (the accepted path's, in order); forget the rest."""
        rows = [self._tree[node] for node in fed_nodes]
        self._tree = []
        if rows:
            self._append(torch.stack([e for e, _ in rows]), torch.stack([h for _, h in rows]))

    def drop_tree(self) -> None:
        self._tree = []

    def _append(self, embeds: torch.Tensor, hidden: torch.Tensor) -> None:
        needed = self.length + hidden.shape[0]
        if self._hidden is None or needed > self._hidden.shape[0]:
            capacity = max(needed, 2 * (0 if self._hidden is None else self._hidden.shape[0]), 64)
            grown_e = embeds.new_empty(capacity, embeds.shape[-1])
            grown_h = hidden.new_empty(capacity, hidden.shape[-1])
            if self.length:
                grown_e[:self.length] = self._embeds[:self.length]
                grown_h[:self.length] = self._hidden[:self.length]
            self._embeds, self._hidden = grown_e, grown_h
        self._embeds[self.length:needed] = embeds
        self._hidden[self.length:needed] = hidden
        self.length = needed
