"""Rolling a KV cache back: the two moves every cache in mmspec makes, through transformers' ``Cache`` API.

- :func:`crop_to` drops every position from ``length`` on (a rejected draft's tail) with
  ``Cache.crop``.
- :func:`keep_positions` keeps a prefix plus chosen later positions (a token tree's accepted
  path): those entries are copied to follow the prefix, then the rest is cropped.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import Cache


def crop_to(cache: Cache, length: int) -> None:
    """Keep the first ``length`` positions of every layer (``Cache.crop`` takes a negative count)."""
    excess = cache.get_seq_length() - length
    if excess > 0:
        cache.crop(-excess)


def keep_positions(cache: Cache, start: int, positions: Sequence[int]) -> None:
    """Keep cache positions [0, start) followed by ``positions`` (ascending, all >= start); drop the rest.

    The moved entries are copied into place (their values are unchanged), then the cache is
    cropped with ``Cache.crop``.
    """
    positions = list(positions)
    if positions and positions != list(range(start, start + len(positions))):
        for layer in cache.layers:
            index = torch.tensor(positions, device=layer.keys.device)
            layer.keys[..., start:start + len(positions), :] = layer.keys.index_select(-2, index)
            layer.values[..., start:start + len(positions), :] = layer.values.index_select(-2, index)
    crop_to(cache, start + len(positions))
