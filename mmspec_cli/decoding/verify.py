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

Each sampling rule is written once, for N blocks at a time (``*_batch``: the tests run 10^5 blocks
in one call); the one-block form the engine calls is that code with N = 1, and draws the same
random numbers in the same order as a loop over one block would.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from mmspec_cli.decoding.sampling import argmax_ids, draw_ids


@dataclass(frozen=True)
class Verdict:
    """How many draft tokens were accepted and the token the target adds after them."""

    accepted: int
    next_token: int


def verify_greedy(draft_tokens: torch.Tensor | Sequence[int], target_logits: torch.Tensor) -> Verdict:
    """draft_tokens: (γ,) ids; target_logits: (γ+1, V), row i scores the token after draft i-1. The longest prefix
    of the draft that equals the target's argmax, then the target's argmax after it. One argmax and one copy to the
    host; the prefix is compared in Python (a block's γ is small: tensor ops would cost more than they save)."""
    drafted = draft_tokens.tolist() if isinstance(draft_tokens, torch.Tensor) else list(draft_tokens)
    target_choice = argmax_ids(target_logits).tolist()  # γ + 1 ids
    accepted = 0
    while accepted < len(drafted) and drafted[accepted] == target_choice[accepted]:
        accepted += 1
    return Verdict(accepted=accepted, next_token=target_choice[accepted])


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) over the last axis. Where p == q everywhere (nothing left), returns p."""
    excess = torch.clamp(p - q, min=0.0)
    mass = excess.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, excess / mass.clamp_min(torch.finfo(excess.dtype).tiny), p)


def draw_rows(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token id from each row of ``probs`` (N, V), using ``generator`` (a CPU generator): (N,)
    (:func:`~mmspec_cli.decoding.sampling.draw_ids`; for N = 1 it draws exactly as
    :func:`~mmspec_cli.decoding.sampling.sample` does on that row)."""
    return draw_ids(probs, generator)


def verify_sampling(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator,
) -> Verdict:
    """Speculative rejection sampling of one block: :func:`verify_sampling_batch` with N = 1.

    draft_tokens: (γ,); draft_probs: (γ, V), row i the distribution token i was drawn from (None when γ = 0);
    target_probs: (γ+1, V), already shaped by the same temperature/top-k/top-p.
    ``generator`` is a CPU generator; all draws are made on the CPU so seeded runs repeat.
    """
    accepted, next_token = verify_sampling_batch(
        draft_tokens[None], None if draft_probs is None else draft_probs[None], target_probs[None], generator)
    return Verdict(accepted=int(accepted[0]), next_token=int(next_token[0]))


def verify_sampling_batch(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative rejection sampling of N independent blocks.

    draft_tokens: (N, γ); draft_probs: (N, γ, V) (None when γ = 0); target_probs: (N, γ+1, V).
    Returns (accepted (N,), next_token (N,)). Draws: N·γ uniforms, then one token per block.
    """
    n, gamma = draft_tokens.shape
    # Only what the rule reads goes to the host in float64: the drafted tokens' probabilities and one row per block
    # (over a real vocabulary, copying every row cost more than the rule itself). The values are those of whole
    # copies: a float64 copy of an entry is the same number wherever it is taken.
    p_draft = _host(_at_tokens(target_probs[:, :gamma], draft_tokens))  # (N, γ)
    q_draft = _host(_at_tokens(draft_probs, draft_tokens)) if gamma else p_draft  # (N, γ)
    uniforms = torch.rand(n, gamma, generator=generator, dtype=torch.float64)  # (N, γ)
    # accept iff u < p/q, written without division; q(y) > 0 because y was drawn from q
    accept = uniforms * q_draft < p_draft
    accepted = accept.long().cumprod(dim=-1).sum(dim=-1)  # (N,): the first rejection, or γ
    blocks = torch.arange(n)
    fallback = _host(_rows(target_probs, blocks, accepted))  # (N, V): the bonus row p_{γ+1} after a full accept
    rejected = accepted < gamma
    if bool(rejected.any()):
        at = accepted[rejected]
        fallback[rejected] = residual_distribution(fallback[rejected], _host(_rows(draft_probs, blocks[rejected], at)))
    return accepted, draw_rows(fallback, generator)


def _host(values: torch.Tensor, copy: bool = False) -> torch.Tensor:
    """``values`` on the CPU in float64, where the sampling rules compute and draw (``copy``: always a tensor of its
    own, which the rule may write into)."""
    return values.detach().to("cpu", torch.float64, copy=copy)


#: The target's distributions at some rows of a verification, asked for as they are needed: called with
#: (blocks (k,), rows (k,)) it returns those k rows' distributions (k, V) (or (k, γ, V) for a width tree's
#: branches). The engine passes one that shapes only the rows asked for; a tensor (N, rows, ...) stands for the
#: function that indexes it (:func:`target_rows`).
TargetRows = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def one_tree_rows(probs: torch.Tensor | Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor | TargetRows:
    """A one-tree rule's target rows (a tensor (rows, ...), or a function of row indices) in its batch form's terms:
    the tensor as a batch of one, the function asked for the rows alone."""
    return (lambda blocks, rows: probs(rows)) if callable(probs) else probs[None]


def target_rows(probs: torch.Tensor | TargetRows) -> TargetRows:
    """``probs`` as the function of (blocks, rows) it stands for: a tensor (N, rows, ...) is indexed."""
    if callable(probs):
        return probs
    return lambda blocks, rows: _rows(probs, blocks, rows)


def _at_tokens(probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """probs (N, γ, V) at tokens (N, γ): each row's probability of its token, (N, γ), on ``probs``'s device."""
    return probs.gather(-1, tokens.to(probs.device)[..., None]).squeeze(-1)


def _rows(probs: torch.Tensor, blocks: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """probs (N, γ, V) at (block, position) pairs: (K, V), on ``probs``'s device."""
    return probs[blocks.to(probs.device), positions.to(probs.device)]


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
    choice = int(argmax_ids(root_logits))
    firsts = branches[:, 0].tolist()
    if choice not in firsts:
        return TreeVerdict(branch=0, accepted=0, next_token=choice)
    j = firsts.index(choice)
    chain = verify_greedy(branches[j], torch.cat([root_logits[None], branch_logits[j]]))
    return TreeVerdict(branch=j, accepted=chain.accepted, next_token=chain.next_token)


def recursive_rejection(candidates: Sequence[int], q: torch.Tensor, p: torch.Tensor,
                        generator: torch.Generator) -> tuple[int | None, torch.Tensor]:
    """Recursive rejection sampling of one root: :func:`recursive_rejection_batch` with N = 1.

    candidates: x_1..x_k in draw order; q, p: (V,). Returns (index of the accepted candidate or None,
    the residual (V,) to draw from when None).
    """
    index, residual = recursive_rejection_batch(torch.tensor([list(candidates)], dtype=torch.long).reshape(1, -1),
                                                q[None], p[None], generator)
    return (None if int(index[0]) < 0 else int(index[0])), residual[0]


def drop_candidate(q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """q (n, V) with token x[r] removed from row r and the row renormalised: what the next candidate drawn
    without replacement was drawn from (a row whose mass is gone stays all zero)."""
    q = q.clone()
    q[torch.arange(len(x)), x] = 0.0
    mass = q.sum(dim=-1, keepdim=True)
    return q / torch.where(mass > 0, mass, torch.ones_like(mass))


def recursive_rejection_batch(candidates: torch.Tensor, q: torch.Tensor, p: torch.Tensor,
                              generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Recursive rejection sampling over candidates drawn WITHOUT replacement (RRSw; Jeon et al. 2024,
    "Recursive Speculative Decoding", Alg. 2; the multi-candidate rule of SpecInfer, Miao et al. 2023 §4,
    with the proposal renormalised after each rejection, as in Yang et al. 2024 "Multi-Candidate
    Speculative Decoding"), for N independent roots.

    candidates: (N, k), row r's x_1..x_k in the order they were drawn from q[r] without replacement;
    q, p: (N, V). With p_1 = p and q_1 = q: accept x_i with probability min(1, p_i(x_i) / q_i(x_i)); on
    rejection p_{i+1} = norm(max(0, p_i − q_i)) and q_{i+1} = q_i with x_i removed and renormalised (the
    distribution x_{i+1} was drawn from, :func:`drop_candidate`). Each step is the single-draft rule for
    target p_i and proposal q_i, so what comes out (the accepted x_i, or a draw from p_{k+1}) is
    distributed as p_i, and by induction as p.
    Returns (index of the accepted candidate, −1 where none was, (N,); the residual to draw from then, (N, V)).
    Draws: one uniform per candidate tried, for the undecided roots in row order.
    """
    p_i = _host(p, copy=True)  # written row by row below: the caller's tensors are left as they are
    q_i = _host(q, copy=True)
    candidates = candidates.to("cpu")
    index = torch.full((candidates.shape[0],), -1, dtype=torch.long)
    for i in range(candidates.shape[1]):
        rows = (index < 0).nonzero().flatten()  # roots still undecided
        if not len(rows):
            break
        x = candidates[rows, i]
        u = torch.rand(len(rows), generator=generator, dtype=torch.float64)
        accept = u * q_i[rows, x] < p_i[rows, x]
        index[rows[accept]] = i
        rejected = rows[~accept]
        p_i[rejected] = residual_distribution(p_i[rejected], q_i[rejected])
        q_i[rejected] = drop_candidate(q_i[rejected], x[~accept])
    return index, p_i


def verify_tree_sampling(branches: torch.Tensor, draft_probs: torch.Tensor, root_probs: torch.Tensor,
                         branch_probs: torch.Tensor | Callable[[torch.Tensor], torch.Tensor],
                         generator: torch.Generator) -> TreeVerdict:
    """Multi-draft speculative sampling of one tree: :func:`verify_tree_sampling_batch` with N = 1.

    branches: (d, γ); draft_probs: (d, γ, V); root_probs: (V,); branch_probs: (d, γ, V), or a function of branch
    indices (k,) giving those branches' (k, γ, V), called for the followed branch only.
    """
    branch, accepted, next_token = verify_tree_sampling_batch(branches[None], draft_probs[None], root_probs[None],
                                                              one_tree_rows(branch_probs), generator)
    return TreeVerdict(branch=int(branch[0]), accepted=int(accepted[0]), next_token=int(next_token[0]))


def verify_tree_sampling_batch(branches: torch.Tensor, draft_probs: torch.Tensor, root_probs: torch.Tensor,
                               branch_probs: torch.Tensor | TargetRows,
                               generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Multi-draft speculative sampling over N trees whose only fork is the root.

    branches: (N, d, γ), first tokens drawn from q_root without replacement, in draw order;
    draft_probs: (N, d, γ, V), [r, j, t] the distribution token t of branch j was drawn from (all
    [r, j, 0] equal q_root); root_probs: (N, V) and branch_probs: (N, d, γ, V), the target's p, shaped
    like q (or :data:`TargetRows` of (trees, branches), asked for the followed branches only). The root is settled
    by :func:`recursive_rejection_batch`; after accepting branch j's first token, the rest of branch j is a chain
    and goes through :func:`verify_sampling_batch`.
    Both keep the target's distribution, so the emitted tokens follow the target's own sampling.
    Returns (branch followed, 0 when no first token was accepted; accepted tokens; next token), each (N,).
    """
    index, residual = recursive_rejection_batch(branches[:, :, 0], draft_probs[:, 0, 0], root_probs, generator)
    n = branches.shape[0]
    accepted = torch.zeros(n, dtype=torch.long)
    next_token = torch.zeros(n, dtype=torch.long)
    none = index < 0
    if bool(none.any()):
        next_token[none] = draw_rows(residual[none], generator)
    chosen = (~none).nonzero().flatten()
    if len(chosen):
        j = index[chosen]
        rest, after = verify_sampling_batch(branches[chosen, j, 1:], draft_probs[chosen, j, 1:],
                                            target_rows(branch_probs)(chosen, j), generator)
        accepted[chosen] = 1 + rest
        next_token[chosen] = after
    return index.clamp_min(0), accepted, next_token


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
    choice = argmax_ids(logits).tolist()  # (rows,)
    children = _children(parents)
    row, path = 0, []
    while True:
        matching = [c for c in children[row] if tokens[c] == choice[row]]
        if not matching:
            return PathVerdict(path, choice[row])
        row = matching[0]
        path.append(row)


def verify_any_tree_sampling(parents: Sequence[int], tokens: Sequence[int], scores: Sequence[float],
                             target_probs: torch.Tensor | Callable[[torch.Tensor], torch.Tensor],
                             generator: torch.Generator) -> PathVerdict:
    """Sampling with deterministic candidates for one tree: :func:`verify_any_tree_sampling_batch` with N = 1.

    target_probs: (rows, V), already shaped by temperature/top-k/top-p; or a function of row indices (k,) giving
    those rows' distributions (k, V), called for the rows the walk reaches only.
    """
    paths, next_token = verify_any_tree_sampling_batch(parents, tokens, scores, one_tree_rows(target_probs),
                                                       generator, blocks=1)
    return PathVerdict([int(row) for row in paths[0] if row >= 0], int(next_token[0]))


def verify_any_tree_sampling_batch(parents: Sequence[int], tokens: Sequence[int], scores: Sequence[float],
                                   target_probs: torch.Tensor | TargetRows, generator: torch.Generator,
                                   blocks: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampling with deterministic candidates (EAGLE-2; Li et al. 2024; the multi-draft rule with q a point mass),
    for N independent verifications of one tree (parents, tokens and draft ``scores`` per row, shared).

    At each accepted row, its children are tried in descending draft ``scores``: child x is accepted
    with probability p(x) under the current p; on rejection p(x) is set to 0 and p renormalised, and
    the next child is tried. If every child is rejected, the next token is drawn from what remains of
    p. Each step is the single-draft rule with q = a point mass on x (accept with min(1, p(x)/1),
    residual norm(max(0, p − δ_x))), so the output follows the target's p.
    target_probs: (N, rows, V), already shaped by temperature/top-k/top-p, or :data:`TargetRows` with ``blocks``,
    the N it verifies: only the rows the walk reaches are read (over a real vocabulary, shaping and copying a whole
    tree's rows cost more than the rule), each copied to the host in float64 as it is reached, the same numbers as a
    copy of them all.
    Returns (the accepted rows of each verification, a path from the root's child down padded with −1,
    (N, depth); the next token, (N,)). Draws: one uniform per child tried, then one token per verification.
    """
    order = [sorted(kids, key=lambda c: (-scores[c], c)) for kids in _children(parents)]
    table = torch.full((len(parents), max(map(len, order), default=0)), -1, dtype=torch.long)  # children by score
    for row, kids in enumerate(order):
        table[row, : len(kids)] = torch.tensor(kids, dtype=torch.long)
    token_of = torch.tensor(list(tokens), dtype=torch.long)
    rows_at = target_rows(target_probs)
    if isinstance(target_probs, torch.Tensor):
        n = target_probs.shape[0]
    elif blocks is None:
        raise TypeError("verify_any_tree_sampling_batch: given the target's rows as a function, it needs blocks=N")
    else:
        n = blocks
    row = torch.zeros(n, dtype=torch.long)
    next_token = torch.zeros(n, dtype=torch.long)
    live = torch.arange(n)  # verifications still walking down
    steps: list[torch.Tensor] = []
    while len(live):
        p = _host(rows_at(live, row[live]), copy=True)  # (m, V): the rows the walks are at, written below
        kids = table[row[live]]  # (m, width)
        chosen = torch.full((len(live),), -1, dtype=torch.long)
        for rank in range(kids.shape[1]):
            trying = ((kids[:, rank] >= 0) & (chosen < 0)).nonzero().flatten()
            if not len(trying):
                continue
            child = kids[trying, rank]
            x = token_of[child]
            u = torch.rand(len(trying), generator=generator, dtype=torch.float64)
            accept = u * p[trying].sum(dim=-1) < p[trying, x]
            chosen[trying[accept]] = child[accept]
            p[trying[~accept], x[~accept]] = 0.0
        stop = chosen < 0
        if bool(stop.any()):
            rest = p[stop]
            next_token[live[stop]] = draw_rows(rest / rest.sum(dim=-1, keepdim=True), generator)
        go = ~stop
        if bool(go.any()):
            step = torch.full((n,), -1, dtype=torch.long)
            step[live[go]] = chosen[go]
            steps.append(step)
        row[live[go]] = chosen[go]
        live = live[go]
    paths = torch.stack(steps, dim=1) if steps else torch.full((n, 0), -1, dtype=torch.long)
    return paths, next_token
