"""Verification of a drafted block: pure tensor maths, no model code.

Greedy rule: accept the longest prefix of draft tokens equal to the target's argmax, then
emit the target's argmax at the first mismatch (or the bonus token after a full accept).

Sampling rule (Leviathan et al. 2023, Alg. 1; Chen et al. 2023; TABED §3): accept draft
token y_i with probability min(1, p_i(y_i) / q_i(y_i)), where q_i is the distribution y_i
was actually drawn from (for an ensemble, the weighted mixture). At the first rejection
emit a token drawn from norm(max(0, p_i - q_i)); after a full accept draw the bonus from
p_{γ+1}. The emitted sequence is then distributed exactly as the target's own sampling.

Token trees (several branches per block, TABED §6.1): greedy follows the one branch that
starts with the target's argmax; sampling settles the branches' distinct first tokens by
recursive rejection sampling without replacement (Jeon et al. 2024), then the chain rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mmspec_cli.decoding.sampling import sample


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
            return Verdict(accepted=i, next_token=sample(fallback, generator))
    return Verdict(accepted=gamma, next_token=sample(p[gamma], generator))


# --------------------------------------------------------------------------- token trees
#
# A tree block has d branches of γ tokens. Their first tokens are distinct: the d most
# likely tokens of the draft's root distribution q (greedy), or d draws from q without
# replacement (sampling); each branch then continues as a chain. The target scores the
# whole tree in one forward: ``root`` are its logits/probabilities at the last verified
# token (they judge every branch's first token), and ``branch[j, t]`` those after token t of
# branch j. Branch j alone is then exactly a chain block with target rows
# cat(root, branch[j]) (γ+1 rows), which is what the chain rules above take.


@dataclass(frozen=True)
class TreeVerdict:
    """The branch followed (0 when no first token was accepted), its accepted tokens, and the target's token."""

    branch: int
    accepted: int
    next_token: int


def verify_tree_greedy(branches: torch.Tensor, root_logits: torch.Tensor, branch_logits: torch.Tensor) -> TreeVerdict:
    """branches: (d, γ) ids, distinct first tokens; root_logits: (V,); branch_logits: (d, γ, V).

    At most one branch starts with the target's argmax; the greedy chain rule then runs along
    it, which accepts the longest branch prefix equal to the target's own greedy tokens.
    """
    choice = int(root_logits.argmax())
    firsts = branches[:, 0].tolist()
    if choice not in firsts:
        return TreeVerdict(branch=0, accepted=0, next_token=choice)
    j = firsts.index(choice)
    chain = verify_greedy(branches[j], torch.cat([root_logits[None], branch_logits[j]]))
    return TreeVerdict(branch=j, accepted=chain.accepted, next_token=chain.next_token)


def recursive_rejection(candidates: Sequence[int], q: torch.Tensor, p: torch.Tensor,
                        generator: torch.Generator) -> tuple[int | None, torch.Tensor]:
    """Recursive rejection sampling over candidates drawn WITHOUT replacement (RRSw; Jeon et al. 2024,
    "Recursive Speculative Decoding", Alg. 2; the multi-candidate rule of SpecInfer, Miao et al. 2023 §4,
    with the proposal renormalised after each rejection, as in Yang et al. 2024 "Multi-Candidate
    Speculative Decoding").

    candidates: x_1..x_k in the order they were drawn from q without replacement; q, p: (V,).
    With p_1 = p and q_1 = q: accept x_i with probability min(1, p_i(x_i) / q_i(x_i)); on rejection
    p_{i+1} = norm(max(0, p_i − q_i)) and q_{i+1} = q_i with x_i removed and renormalised (the
    distribution x_{i+1} was drawn from). Each step is the single-draft rule for target p_i
    and proposal q_i, so what comes out (the accepted x_i, or a draw from p_{k+1}) is
    distributed as p_i, and by induction as p.
    Returns (index of the accepted candidate or None, the residual to draw from when None).
    """
    p_i = p.detach().to("cpu", torch.float64)
    q_i = q.detach().to("cpu", torch.float64)
    for index, x in enumerate(candidates):
        u = float(torch.rand((), generator=generator, dtype=torch.float64))
        if u * float(q_i[x]) < float(p_i[x]):
            return index, p_i
        p_i = residual_distribution(p_i, q_i)
        q_i = q_i.clone()
        q_i[x] = 0.0
        mass = q_i.sum()
        q_i = q_i / mass if mass > 0 else q_i
    return None, p_i


def verify_tree_sampling(branches: torch.Tensor, draft_probs: torch.Tensor, root_probs: torch.Tensor,
                         branch_probs: torch.Tensor, generator: torch.Generator) -> TreeVerdict:
    """Multi-draft speculative sampling over a tree whose only fork is the root.

    branches: (d, γ), first tokens drawn from q_root without replacement, in draw order;
    draft_probs: (d, γ, V), [j, t] the distribution token t of branch j was drawn from (all
    [j, 0] equal q_root); root_probs: (V,) and branch_probs: (d, γ, V), the target's p, shaped
    like q. The root is settled by :func:`recursive_rejection`; after accepting branch j's
    first token, the rest of branch j is a chain and goes through :func:`verify_sampling`.
    Both keep the target's distribution, so the emitted tokens follow the target's own sampling.
    """
    firsts = branches[:, 0].tolist()
    index, residual = recursive_rejection(firsts, draft_probs[0, 0], root_probs, generator)
    if index is None:
        return TreeVerdict(branch=0, accepted=0, next_token=sample(residual, generator))
    rest = verify_sampling(branches[index, 1:], draft_probs[index, 1:], branch_probs[index], generator)
    return TreeVerdict(branch=index, accepted=1 + rest.accepted, next_token=rest.next_token)


# --------------------------------------------------------------------------- trees of any shape (EAGLE-2)
#
# The target was fed ``[root] + nodes``: row 0 is the root (the last verified token) and
# ``parents[r]`` is row r's parent row (-1 for the root). Draft tokens were chosen
# deterministically (the top-k of each expansion), so each candidate's q is a point mass.


@dataclass(frozen=True)
class PathVerdict:
    """The accepted rows (a path from the root's child down, fed indices) and the target's token after them."""

    rows: list[int]
    next_token: int


def _children(parents: Sequence[int]) -> list[list[int]]:
    children: list[list[int]] = [[] for _ in parents]
    for row, parent in enumerate(parents):
        if parent >= 0:
            children[parent].append(row)
    return children


def verify_any_tree_greedy(parents: Sequence[int], tokens: Sequence[int], logits: torch.Tensor) -> PathVerdict:
    """Greedy: from the root, follow the child whose token is the target's argmax, while there is one.

    parents, tokens: per fed row; logits: (rows, V). The path is the longest one whose tokens are
    the target's own greedy tokens; the target's argmax at its end is the next token.
    """
    choice = logits.argmax(dim=-1).tolist()  # (rows,)
    children = _children(parents)
    row, path = 0, []
    while True:
        matching = [c for c in children[row] if tokens[c] == choice[row]]
        if not matching:
            return PathVerdict(path, choice[row])
        row = matching[0]
        path.append(row)


def verify_any_tree_sampling(parents: Sequence[int], tokens: Sequence[int], scores: Sequence[float],
                             target_probs: torch.Tensor, generator: torch.Generator) -> PathVerdict:
    """Sampling with deterministic candidates (EAGLE-2; Li et al. 2024; the multi-draft rule with q a point mass).

    At each accepted row, its children are tried in descending draft ``scores`` (per row): child x
    is accepted with probability p(x) under the current p; on rejection p(x) is set to 0 and p
    renormalised, and the next child is tried. If every child is rejected, the next token is drawn
    from what remains of p. Each step is the single-draft rule with q = a point mass on x (accept
    with min(1, p(x)/1), residual norm(max(0, p − δ_x))), so the output follows the target's p.
    target_probs: (rows, V), already shaped by temperature/top-k/top-p.
    """
    children = _children(parents)
    row, path = 0, []
    while True:
        p = target_probs[row].detach().to("cpu", torch.float64).clone()
        accepted = None
        for child in sorted(children[row], key=lambda c: (-scores[c], c)):
            x = tokens[child]
            u = float(torch.rand((), generator=generator, dtype=torch.float64))
            if u * float(p.sum()) < float(p[x]):
                accepted = child
                break
            p[x] = 0.0
        if accepted is None:
            return PathVerdict(path, sample(p / p.sum(), generator))
        row = accepted
        path.append(row)
