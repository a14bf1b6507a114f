"""Position ids: the one place that says at which positions a model reads the tokens it is fed.

Every forward of the decoding loop passes explicit position ids (and, over a static cache, the
cache's own pointer decides where the keys and values are written: :mod:`mmspec_cli.decoding.kv_state`);
``train-head`` reads whole sequences from position 0, where the model's own default is the same.
A model family with other positions supplies its own :class:`Positions`
(:mod:`mmspec_cli.models.families` says which): Qwen-VL's 3-D M-RoPE ids, :class:`MRopePositions`.

- A chain of ``n`` tokens fed after ``start`` real positions reads positions ``start .. start+n-1``.
- A tree node at depth ``d`` (0 for the root's children) fed after ``start`` real positions reads
  ``start + d``: each branch computes what it would compute alone (SpecInfer; Medusa).
- M-RoPE (Qwen2-VL §2.1): after the prompt's last image every token reads ``index + δ`` on all three
  axes (temporal, height, width), where δ, the prompt's rope offset, is what transformers'
  ``get_rope_index`` returns for the prompt (negative: an image's tokens span fewer positions than
  there are tokens). So a chain reads ``start + i + δ`` and a tree node ``start + d + δ``.
"""

from __future__ import annotations

from typing import Any

import torch


class Positions:
    """1-D positions, the same on every rotary axis: the LLaVA families' language models."""

    #: Whether a chain's positions are the indices its cache writes them at, as a model computes them itself when
    #: given none (transformers' decoders: ``arange(n) + cache.get_seq_length()``), so that a chain fed after the
    #: whole state may pass ``position_ids=None`` (in a compiled graph, read from the cache's write pointer).
    follows_cache = True

    def chain(self, start: int, n: int, device: Any = None) -> torch.Tensor:
        """(1, n) position ids of ``n`` tokens fed after ``start`` positions."""
        return torch.arange(start, start + n, device=device)[None]

    def tree(self, start: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
        """(B, n) position ids of tree nodes at ``depths`` (n,) fed after ``start`` (B, 1) real positions per row."""
        return start + depths[None, :]


TEXT_POSITIONS = Positions()


class MRopePositions(Positions):
    """Qwen-VL's M-RoPE position ids (3, B, n) after a prompt whose rope offset is ``offset`` (δ): one number,
    or (B, 1), one per row of a batch (batched draft rows; then only :meth:`tree` applies)."""

    follows_cache = False  # offset by δ, on three axes

    def __init__(self, offset: int | torch.Tensor = 0):
        self.offset = offset if isinstance(offset, torch.Tensor) else int(offset)

    def chain(self, start: int, n: int, device: Any = None) -> torch.Tensor:
        """(3, 1, n): ``start + offset + i`` on each of the three axes."""
        return super().chain(start + self.offset, n, device)[None].expand(3, -1, -1)

    def tree(self, start: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
        """(3, B, n): ``start + offset + depth`` on each axis (on ``start``'s device)."""
        offset = self.offset.to(start.device) if isinstance(self.offset, torch.Tensor) else self.offset
        return super().tree(start + offset, depths)[None].expand(3, -1, -1)
