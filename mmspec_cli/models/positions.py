"""Position ids: the one place that says at which positions a model reads the tokens it is fed.

Every forward of the decoding loop passes explicit position ids (and, over a static cache, the
cache's own pointer decides where the keys and values are written: :mod:`mmspec_cli.decoding.kv_state`);
``train-head`` reads whole sequences from position 0, where the model's own default is the same.
A model family with other positions (Qwen-VL's 3-D M-RoPE ids, next) supplies its own
:class:`Positions`; :func:`positions_for` picks it.

- A chain of ``n`` tokens fed after ``start`` real positions reads positions ``start .. start+n-1``.
- A tree node at depth ``d`` (0 for the root's children) fed after ``start`` real positions reads
  ``start + d``: each branch computes what it would compute alone (SpecInfer; Medusa).
"""

from __future__ import annotations

from typing import Any

import torch


class Positions:
    """1-D positions, the same on every rotary axis: the LLaVA families' language models."""

    def chain(self, start: int, n: int, device: Any = None) -> torch.Tensor:
        """(1, n) position ids of ``n`` tokens fed after ``start`` positions."""
        return torch.arange(start, start + n, device=device)[None]

    def tree(self, start: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
        """(B, n) position ids of tree nodes at ``depths`` (n,) fed after ``start`` (B, 1) real positions per row."""
        return start + depths[None, :]


TEXT_POSITIONS = Positions()


def positions_for(model: Any) -> Positions:
    """The position function of ``model``'s family (every family mmspec loads today reads 1-D positions)."""
    return TEXT_POSITIONS
