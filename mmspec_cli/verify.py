"""Verification of a drafted block: pure tensor maths, no model code.

Greedy rule: accept the longest prefix of draft tokens equal to the target's argmax, then
emit the target's argmax at the first mismatch (or the bonus token after a full accept).

Sampling rule (Leviathan et al. 2023, Alg. 1; Chen et al. 2023; TABED §3): accept draft
token y_i with probability min(1, p_i(y_i) / q_i(y_i)), where q_i is the distribution y_i
was actually drawn from (for an ensemble, the weighted mixture). At the first rejection
emit a token drawn from norm(max(0, p_i - q_i)); after a full accept draw the bonus from
p_{γ+1}. The emitted sequence is then distributed exactly as the target's own sampling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Verdict:
    """How many draft tokens were accepted and the token the target adds after them."""

    accepted: int
    next_token: int


def verify_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> Verdict:
    """draft_tokens: (γ,) ids; target_logits: (γ+1, V), row i scores the token after draft i-1."""
    gamma = draft_tokens.shape[0]
    target_choice = target_logits.argmax(dim=-1)  # (γ+1,)
    matches = (draft_tokens.to(target_choice.device) == target_choice[:gamma]).long()  # (γ,)
    accepted = int(matches.cumprod(dim=0).sum()) if gamma else 0
    return Verdict(accepted=accepted, next_token=int(target_choice[accepted]))


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) over the last axis. Where p == q everywhere (nothing left), returns p."""
    excess = torch.clamp(p - q, min=0.0)
    mass = excess.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, excess / mass.clamp_min(torch.finfo(excess.dtype).tiny), p)


def verify_sampling(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator,
) -> Verdict:
    """Speculative rejection sampling.

    draft_tokens: (γ,); draft_probs: (γ, V), row i the distribution token i was drawn from;
    target_probs: (γ+1, V), already shaped by the same temperature/top-k/top-p.
    ``generator`` is a CPU generator; all draws are made on the CPU so seeded runs repeat.
    """
    gamma = draft_tokens.shape[0]
    p = target_probs.detach().to("cpu", torch.float64)  # (γ+1, V)
    q = draft_probs.detach().to("cpu", torch.float64) if gamma else p[:0]  # (γ, V)
    tokens = draft_tokens.to("cpu")
    rows = torch.arange(gamma)
    p_draft = p[rows, tokens]  # (γ,)
    q_draft = q[rows, tokens]  # (γ,)
    uniforms = torch.rand(gamma, generator=generator, dtype=torch.float64)  # (γ,)
    # accept iff u < p/q, written without division; q(y) > 0 because y was drawn from q
    accept = uniforms * q_draft < p_draft
    for i in range(gamma):
        if not bool(accept[i]):
            fallback = residual_distribution(p[i], q[i])
            return Verdict(accepted=i, next_token=_draw(fallback, generator))
    return Verdict(accepted=gamma, next_token=_draw(p[gamma], generator))


def _draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))
