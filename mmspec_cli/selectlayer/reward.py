"""Choosing the draft depth n of self-speculative drafting: FastVLM App. A.4, as pure functions.

For each candidate layer l ≤ L/2 the confidence is
    C_l = mean over generated positions of  max_v softmax(LM head(final norm(h_l)))_v,
with h_l the target's hidden state after layer l; the reward is
    r_l = C_l − λ·l,  λ = 1/L by default (the per-layer cost of the decoder),
and the chosen layer is n = argmax_l r_l (ties: the shallower layer, which drafts faster).
Model code lives in :mod:`mmspec_cli.selectlayer.calibration`; this module only does the arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import torch

from mmspec_cli.errors import InputError
from mmspec_cli.decoding.sampling import working_dtype


def default_lambda(total_layers: int) -> float:
    """FastVLM's λ = 1/L."""
    return 1.0 / total_layers


def check_lambda(value: float) -> float:
    if not math.isfinite(value) or value < 0:
        raise InputError(f"--lambda: expected a number >= 0 (the reward's cost per layer; default 1/L), got {value}")
    return value


def candidate_layers(total_layers: int, max_layer: int | None = None) -> list[int]:
    """l = 1..⌊L/2⌋ (FastVLM's [L/2]), or 1..max_layer; every l must leave a layer to verify with (l ≤ L−1)."""
    top = total_layers // 2 if max_layer is None else max_layer
    if not 1 <= top <= total_layers - 1:
        raise InputError(f"--max-layer: expected an integer between 1 and {total_layers - 1} "
                         f"(the target has {total_layers} decoder layers), got {top}")
    return list(range(1, top + 1))


def rewards(confidences: Mapping[int, float], lam: float) -> dict[int, float]:
    """FastVLM App. A.4: r_l = C_l − λ·l for every layer l with a confidence."""
    return {layer: c - lam * layer for layer, c in confidences.items()}


def choose_layer(reward: Mapping[int, float]) -> int:
    """n = argmax_l r_l; on a tie the shallower layer."""
    return min(reward, key=lambda layer: (-reward[layer], layer))


def ranked_layers(reward: Mapping[int, float], k: int) -> list[int]:
    """The ``k`` layers with the highest reward, best first."""
    return sorted(reward, key=lambda layer: (-reward[layer], layer))[:k]


def max_confidence_sums(hidden_states: Sequence[torch.Tensor], positions: torch.Tensor, layers: Sequence[int],
                        norm: Callable[[torch.Tensor], torch.Tensor],
                        head: Callable[[torch.Tensor], torch.Tensor]) -> dict[int, float]:
    """Σ over ``positions`` of max softmax(head(norm(h_l))) for each l in ``layers``.

    hidden_states: the model's (L+1)-tuple of (1, S, H) tensors, [0] the embeddings and [l] the
    output of layer l (transformers applies the final norm to the last one itself, so no layer
    L is taken here). positions: (P,) indices of the positions that predict generated tokens.
    """
    sums = {}
    for layer in layers:
        logits = head(norm(hidden_states[layer][0, positions]))  # (P, V)
        probs = torch.softmax(logits.to(working_dtype(logits)), dim=-1)  # (P, V)
        sums[layer] = float(probs.max(dim=-1).values.sum())
    return sums
