"""Ensemble drafting maths: mixtures and TABED's weight policies. Pure functions of tensors.

Notation (TABED §5.1, Alg. 1): m members with next-token distributions q_k; a weight
vector w on the simplex gives the mixture q_w = Σ_k w_k q_k (IbED Alg. 1 uses w = 1/m).
TABED picks, at the start of each block, w* from candidates W_t by their error over the
verified history (positions t' the target has verified, where p_t' and every q_k,t' are known):
  soft labels: e^j = Σ_t' D(p_t', q_{w_j,t'}), D = KL(p‖q) or TVD   (TABED §5.1)
  hard labels: matches^j = Σ_t' [argmax q_{w_j,t'} = y_t'], y the token the target kept.
The evidence for every candidate is accumulated right after each verification
(:class:`Evidence`), so choosing weights costs O(#candidates) per block.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from mmspec_cli.decoding.sampling import argmax_ids
from mmspec_cli.models.profiles import EnsembleSpec

KL_FLOOR = 1e-10  # q_w is floored here inside log so that KL stays finite where q_w = 0


def mixture(member_probs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """q_w = Σ_k w_k q_k. member_probs: (..., m, V); weights: (m,) -> (..., V)."""
    return torch.matmul(weights.to(member_probs), member_probs)


def simplex_grid(members: int, steps: int) -> torch.Tensor:
    """All weight vectors with entries in {0, 1/steps, ..., 1} summing to 1: (C, members).

    For two members this is TABED App. B.2's W_t = [1 - j/n, j/n], j = 0..n.
    """
    points = [c for c in itertools.product(range(steps + 1), repeat=members) if sum(c) == steps]
    return torch.tensor(points, dtype=torch.float64) / steps


def candidate_mixtures(member_q: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """Every candidate's mixture at every position: member_q (n, m, V), candidates (C, m) -> (n, C, V)."""
    return torch.matmul(candidates.to(member_q), member_q)


def candidate_errors(p: torch.Tensor, mixed: torch.Tensor, distance: str) -> torch.Tensor:
    """Soft-label error D(p, q_w) of each candidate mixture at each position.

    p: (n, V) target distributions; mixed: (n, C, V) from :func:`candidate_mixtures`. Returns (n, C).
    """
    target = p.to(mixed)[:, None, :]  # (n, 1, V)
    if distance == "tvd":
        return 0.5 * (target - mixed).abs().sum(-1)
    if distance == "kl":  # Σ p log p - Σ p log q_w
        return entropy_term(target[:, 0]) - mixed.clamp_min(KL_FLOOR).log_().mul_(target).sum(-1)  # (n, C)
    raise ValueError(f"unknown distance {distance!r}")


def entropy_term(p: torch.Tensor) -> torch.Tensor:
    """Σ_v p_v log p_v over the last axis, keeping it (..., 1), with 0 log 0 = 0: ``xlogy(p, p)`` summed, up to the
    rounding of the log (torch's vectorised one and ``xlogy``'s differ by an ulp on some values), the NaN of 0 · log 0
    replaced, which this CPU computes about 2.5x faster than ``xlogy`` (a probability is never infinite, so nothing
    else is replaced; a NaN probability still makes the cross term NaN)."""
    return (p * p.log()).nan_to_num_(nan=0.0).sum(-1, keepdim=True)


def candidate_matches(mixed: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Hard-label hits: whether argmax of each candidate mixture equals the kept token. (n, C) float."""
    return (argmax_ids(mixed) == labels.to(mixed.device)[:, None]).to(torch.float64)


class Evidence:
    """Per-candidate error sums over the last ``window`` verified positions (None = all).

    Keeps one row of (soft error, hard hit) per position in a ring buffer of ``window`` rows
    when the window is finite, or running sums otherwise.
    """

    def __init__(self, n_candidates: int, window: int | None):
        self.window = window
        self.rows: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.soft = torch.zeros(n_candidates, dtype=torch.float64)
        self.hits = torch.zeros(n_candidates, dtype=torch.float64)
        self.count = 0

    def add(self, errors: torch.Tensor, hits: torch.Tensor | None) -> None:
        """errors, hits: (n, C) for n newly verified positions (hits None when no policy reads them)."""
        errors = errors.detach().to("cpu", torch.float64)
        if self.window is None:  # running sums: one addition per block
            self.soft += errors.sum(0)
            if hits is not None:
                self.hits += hits.detach().to("cpu", torch.float64).sum(0)
            self.count += errors.shape[0]
            return
        hits = torch.zeros_like(errors) if hits is None else hits.detach().to("cpu", torch.float64)
        for e, h in zip(errors, hits):
            self.soft += e
            self.hits += h
            self.count += 1
            self.rows.append((e, h))
            if len(self.rows) > self.window:
                old_e, old_h = self.rows.pop(0)
                self.soft -= old_e
                self.hits -= old_h
                self.count -= 1


def best_candidate(soft: torch.Tensor, hits: torch.Tensor, labels: str) -> int:
    """TABED Alg. 1 line 3: argmin of soft error, or argmax of hard hits with ties broken by soft error."""
    if labels == "soft":
        return int(torch.argmin(soft))
    top = hits == hits.max()
    return int(torch.argmin(torch.where(top, soft, torch.full_like(soft, float("inf")))))


def softmax_weights(errors: torch.Tensor, tau: float) -> torch.Tensor:
    """TABED App. B.2 (MTCP*): w = softmax([1/e_1, ..., 1/e_m] / τ)."""
    inverse = 1.0 / errors.to(torch.float64).clamp_min(1e-6)
    return torch.softmax(inverse / tau, dim=0)


def adaboost_weights(error_rates: torch.Tensor, vocab_size: int, c: float = 1.0) -> torch.Tensor:
    """TABED Eq. (2): w_m = ln(1/ε_m - 1) + C·ln(K - 1), K the vocabulary size.

    ε is clamped to [1e-6, 1 - 1e-6]; a member whose score is negative (worse than chance
    in the multi-class sense) gets weight 0; the scores are normalised to the simplex
    (equal weights if none is positive).
    """
    eps = error_rates.to(torch.float64).clamp(1e-6, 1 - 1e-6)
    scores = torch.log(1.0 / eps - 1.0) + c * torch.log(torch.tensor(vocab_size - 1.0, dtype=torch.float64))
    scores = scores.clamp_min(0.0)
    total = scores.sum()
    return scores / total if total > 0 else torch.full_like(scores, 1.0 / len(scores))


def random_simplex_point(members: int, generator: torch.Generator) -> torch.Tensor:
    """A uniform draw from the simplex (Dirichlet(1, ..., 1)): the Random^{MT} ablation."""
    e = -torch.log(torch.rand(members, generator=generator, dtype=torch.float64).clamp_min(1e-12))
    return e / e.sum()


class WeightPolicy:
    """Chooses the block's weights from accumulated evidence (TABED Alg. 1, App. B).

    ``grid`` scores every simplex grid point; ``softmax`` and ``adaboost`` score each member
    alone (the one-hot candidates) and turn the scores into weights; ``random`` and
    ``static`` use no evidence. The first block of a turn uses equal weights, whatever the policy.
    """

    def __init__(self, members: int, config: EnsembleSpec, vocab_size: int, seed: int = 0):
        """``config``: the profile's ``ensemble`` section (policy, distance, labels, window, grid_steps,
        tau, adaboost_c); its ``members`` are the drafter's business, not the policy's."""
        self.members = members
        self.config = config
        self.vocab_size = vocab_size
        self.generator = torch.Generator().manual_seed(seed)
        if config.policy == "grid":
            self.candidates = simplex_grid(members, config.grid_steps)
        else:
            self.candidates = torch.eye(members, dtype=torch.float64)
        self.equal = torch.full((members,), 1.0 / members, dtype=torch.float64)
        self._candidates_as: dict[tuple, torch.Tensor] = {}  # the candidates in each dtype and device the rows use
        self.reset()

    def reset(self) -> None:
        self.evidence = Evidence(len(self.candidates), self.config.window)
        self.blocks = 0  # blocks drafted since the reset

    @property
    def uses_evidence(self) -> bool:
        return self.config.policy in ("grid", "softmax", "adaboost")

    def weights(self) -> torch.Tensor:
        cfg = self.config
        self.blocks += 1
        if self.blocks == 1 or cfg.policy == "static":
            return self.equal
        if cfg.policy == "random":
            return random_simplex_point(self.members, self.generator)
        if self.evidence.count == 0:
            return self.equal
        ev = self.evidence
        if cfg.policy == "grid":
            return self.candidates[best_candidate(ev.soft, ev.hits, cfg.labels)]
        if cfg.policy == "softmax":
            errors = ev.soft if cfg.labels == "soft" else ev.count - ev.hits
            return softmax_weights(errors, cfg.tau)
        if cfg.policy == "adaboost":
            return adaboost_weights(1.0 - ev.hits / ev.count, self.vocab_size, cfg.adaboost_c)
        raise ValueError(f"unknown policy {cfg.policy!r}")

    def observe(self, p: torch.Tensor, member_q: torch.Tensor, labels: Sequence[int] | torch.Tensor) -> None:
        """Add n verified positions: p (n, V), member_q (n, m, V), labels (n,) the kept tokens (read by the policies
        that count hits only)."""
        if not self.uses_evidence or len(labels) == 0:
            return
        key = (member_q.dtype, member_q.device)
        if key not in self._candidates_as:
            self._candidates_as[key] = self.candidates.to(member_q)
        mixed = candidate_mixtures(member_q, self._candidates_as[key])  # (n, C, V), built once
        hits = candidate_matches(mixed, torch.as_tensor(labels)) if self.reads_hits else None
        self.evidence.add(candidate_errors(p, mixed, self.config.distance), hits)

    @property
    def reads_hits(self) -> bool:
        """Hard labels, or AdaBoost's error rates, need the argmax hits; soft labels do not."""
        return self.config.labels == "hard" or self.config.policy == "adaboost"
