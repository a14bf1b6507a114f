"""Typed statistics of a decoding run, with the definitions the README gives under "Definitions".

- block: one draft phase plus one target verification call (the first block of a turn
  also prefills the prompt in that same target call, as Hugging Face assisted generation does);
- block efficiency τ = tokens emitted / target calls = mean(accepted + 1), in [1, γ+1];
- acceptance rate = accepted draft tokens / drafted tokens (undefined for ``ar``: None);
- expected speedup, TABED Eq. (1): τ / (γ·c + 1), with c = T_q / T_p the latency ratio.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class RunStats:
    new_tokens: int
    blocks: int
    drafted: int
    accepted: int
    wall_s: float

    @property
    def block_efficiency(self) -> float:
        return self.new_tokens / self.blocks if self.blocks else 0.0

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def as_dict(self) -> dict:
        """The ``stats`` object of ``--json`` output."""
        return {
            "new_tokens": self.new_tokens,
            "blocks": self.blocks,
            "block_efficiency": self.block_efficiency,
            "acceptance_rate": self.acceptance_rate,
            "wall_s": self.wall_s,
            "tokens_per_s": self.tokens_per_s,
        }

    @staticmethod
    def total(parts: Iterable["RunStats"]) -> "RunStats":
        parts = list(parts)
        fields = {k: sum(getattr(p, k) for p in parts) for k in asdict(RunStats(0, 0, 0, 0, 0.0))}
        return RunStats(**fields)


def expected_speedup(block_efficiency: float, gamma: int, latency_ratio: float) -> float:
    """TABED Eq. (1): the walltime speedup SD should give, τ / (γ·c + 1)."""
    return block_efficiency / (gamma * latency_ratio + 1.0)
