"""Draft-length schedules: how many tokens γ the drafter proposes in each block.

- ``constant``: γ every block (the default; TABED, IbED).
- ``heuristic``: transformers' assisted-generation rule (``num_assistant_tokens_schedule=
  "heuristic"``): +2 after a block whose draft was accepted in full, −1 otherwise. Here it
  starts each turn at the profile's γ and stays within [1, γ_max] with γ_max = the profile's
  γ, so under ``heuristic`` ``decoding.gamma`` is the most a block drafts (``fastvlm`` grows
  beyond it). (transformers has no upper bound and keeps the length across calls.)
- ``fastvlm``: FastVLM Eq. (5), a draft length that grows with the context length,
      d(t) = d(0) + ⌊10 · σ(0.01 · (t − ⌊N/2⌋))⌋,
  where t is the current context length (prompt plus generated tokens: FastVLM counts the
  t-th generation step as having t − 1 context tokens), N the model's maximum sequence
  length (the target's ``max_position_embeddings``), and d(0) = the profile's γ (the paper
  sets d(0) = 5, so d ∈ {5, …, 15}). d is in [d(0), d(0) + 10]. For LLaVA-1.5 (N = 4096) the
  sigmoid is below 0.1 while t < ~1830, so short answers draft d(0) (+0) tokens per block.

The schedule functions are pure; :class:`GammaSchedule` holds a turn's state. The engine
still cuts the scheduled length so that ``max_new_tokens`` is exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mmspec_cli.choices import SCHEDULES
from mmspec_cli.errors import InputError


def heuristic_next(gamma: int, drafted: int, accepted: int, gamma_max: int) -> int:
    """transformers' heuristic: γ + 2 after a full accept, else γ − 1; clamped to [1, γ_max].

    A block that drafted nothing (γ cut to 0 at ``max_new_tokens``) leaves γ as it is.
    """
    if drafted == 0:
        return gamma
    step = 2 if accepted == drafted else -1
    return max(1, min(gamma_max, gamma + step))


def sigmoid(x: float) -> float:
    """1 / (1 + e^−x), without overflow for large |x|."""
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    z = math.exp(x)
    return z / (1.0 + z)


def fastvlm_length(d0: int, t: int, n: int) -> int:
    """FastVLM Eq. (5): d(t) = d0 + ⌊10 · σ(0.01 · (t − ⌊N/2⌋))⌋ for context length t, max length N."""
    return d0 + math.floor(10 * sigmoid(0.01 * (t - n // 2)))


def check_schedule(name: str) -> str:
    if name not in SCHEDULES:
        raise InputError(f"unknown gamma schedule '{name}'; use one of {', '.join(SCHEDULES)}")
    return name


@dataclass
class GammaSchedule:
    """A turn's draft length under schedule ``name``; ``gamma`` is γ (d(0) for fastvlm, γ_max for heuristic)."""

    name: str
    gamma: int
    max_length: int = 4096  # N of FastVLM Eq. (5): the target's maximum sequence length

    def __post_init__(self) -> None:
        check_schedule(self.name)
        self.current = self.gamma

    def length(self, context: int) -> int:
        """γ for the next block, with ``context`` tokens (prompt + generated) before it."""
        if self.name == "fastvlm":
            return fastvlm_length(self.gamma, context, self.max_length)
        return self.current

    def update(self, drafted: int, accepted: int) -> None:
        """Learn from the block just verified (only ``heuristic`` does)."""
        if self.name == "heuristic":
            self.current = heuristic_next(self.current, drafted, accepted, self.gamma)
