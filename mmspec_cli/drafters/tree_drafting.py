"""The loops that draft token trees, for every drafter that drafts trees: width-d trees (TABED §6.1)
and EAGLE-2 dynamic trees (Li et al. 2024).

A drafter hands :class:`TreeDrafts` a :class:`TreeStep`, as it hands the chain loop a
:class:`~mmspec_cli.decoding.chain.DraftStep`, and the loops do the rest:

- ``root(verified, picker)``: the proposal at the last verified token, (V,);
- ``level(tokens, parents, picker)``: feed one level of nodes (each seeing the prefix and
  its own ancestors) in ONE forward and return the proposal after each node, (n, V);
- ``keep(fed)``: after verification, keep these fed nodes (one path from the top) in the draft's cache;
- ``done()``: the tree is drafted (``ssd`` gives the target's cache back here, a head drops its tree).

A *proposal* is what a token is picked from: logits or probabilities when greedy (argmax),
the probabilities it is drawn from when sampling.

**Width trees.** The d first tokens are the d likeliest (greedy), or d draws without
replacement (sampling); each branch then continues alone. The nodes are fed level by level in
node order (:meth:`TreeTopology.width`); the last level is never fed (no draft step reads it).

**Dynamic trees.** The root's top-k children are the first level. Each round, the k candidates
with the best scores (cumulative log-probability of their path) are fed in ONE forward and
each proposes its top-k children; every scored child stays a candidate. After the last level,
the ``budget − 1`` best candidates are kept (:func:`~mmspec_cli.decoding.tree.rerank`). Tokens
are chosen deterministically, greedy or sampling alike; the verifier's rule for deterministic
candidates keeps the target's distribution.

Only some nodes are fed to the draft's cache; :attr:`TreeDrafts.fed` maps a tree node to its number in
the cache, so that :meth:`TreeDrafts.keep_path` (called from the drafter's ``roll_back``) keeps the accepted
nodes the cache holds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from mmspec_cli.decoding.drafter import DraftShape, TreeDraft
from mmspec_cli.decoding.sampling import TokenPicker, argmax_ids, draw_without_replacement
from mmspec_cli.decoding.tree import ROOT, TreeTopology, best, rerank, top_children


def first_tokens(proposal: torch.Tensor, width: int, picker: TokenPicker) -> list[int]:
    """The tree's first tokens: the ``width`` likeliest of ``proposal`` (greedy; logits or probabilities),
    or ``width`` draws without replacement from it (sampling; probabilities), fewer if the support is smaller."""
    if picker.greedy:
        return torch.topk(proposal, min(width, proposal.shape[-1])).indices.tolist()
    return draw_without_replacement(proposal, width, picker.generator)


def pick(proposal: torch.Tensor, picker: TokenPicker) -> int:
    """One token from a proposal: its argmax when greedy, a draw from it when sampling."""
    return int(argmax_ids(proposal)) if picker.greedy else picker.choose_from(proposal)


def logits_log_proposal(proposal: torch.Tensor, picker: TokenPicker, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` likeliest tokens after each row of a proposal (n, V), likeliest first, as (log q (n, k) in float64,
    ids (n, k)): of logits when greedy (a model's or a head's: their log-softmax), of probabilities when sampling
    (:func:`top_log_probabilities`)."""
    if picker.greedy:
        top = torch.topk(torch.log_softmax(proposal.to(torch.float64), dim=-1), min(k, proposal.shape[-1]), dim=-1)
        return top.values, top.indices
    return top_log_probabilities(proposal, k)


def probabilities_log_proposal(proposal: torch.Tensor, picker: TokenPicker,
                               k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`logits_log_proposal` of a proposal that is a distribution, greedy or not (an ensemble's mixture): a
    probability of 0 has the log of float64's smallest normal number."""
    return top_log_probabilities(proposal, k, floor=torch.finfo(torch.float64).tiny)


def top_log_probabilities(probs: torch.Tensor, k: int,
                          floor: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` likeliest tokens of each row of ``probs`` (n, V) and the float64 log of their probabilities (floored
    at ``floor``): the top k of the log of the whole rows, with k logs taken instead of V. A probability in float32
    or bfloat16 is exactly a float64, and the float64 log keeps the order of two such numbers and their equality
    (two float32 numbers differ by at least 2^-24 of their size, which moves their logs apart by millions of the
    log's rounding steps), so the same comparisons pick the same ids, ties included; over a real vocabulary the log
    of whole rows cost more than the rest of a dynamic tree's drafting (a float64 row's entries within a few
    rounding steps of each other may tie or swap under the log)."""
    top = torch.topk(probs, min(k, probs.shape[-1]), dim=-1)
    values = top.values.to(torch.float64)
    return (values if floor is None else values.clamp_min(floor)).log(), top.indices


@dataclass
class TreeStep:
    """One drafter kind's tree steps (module doc): ``root``, ``level``, ``keep``, ``done``; ``log_proposal`` gives a
    proposal's k likeliest tokens and their log q (a dynamic tree's children and their scores)."""

    root: Callable[[Sequence[int], TokenPicker], torch.Tensor]
    level: Callable[[Sequence[int], Sequence[int], TokenPicker], torch.Tensor]
    keep: Callable[[Sequence[int]], None]
    done: Callable[[], None] = lambda: None
    log_proposal: Callable[[torch.Tensor, TokenPicker, int], tuple[torch.Tensor, torch.Tensor]] = logits_log_proposal


class TreeDrafts:
    """Width and dynamic trees from one drafter's :class:`TreeStep` (module doc); ``fed`` maps the last tree's nodes
    to their numbers in the draft's cache."""

    def __init__(self, step: TreeStep):
        self.step = step
        self.fed: dict[int, int] = {}

    def draft(self, verified: Sequence[int], shape: DraftShape, picker: TokenPicker) -> TreeDraft:
        """The tree ``shape`` asks for, after the ``verified`` tokens."""
        if shape.kind == "dynamic":
            return self.dynamic(verified, shape.length, shape.budget, shape.topk, picker)
        return self.width(verified, shape.length, shape.width, picker)

    def keep_path(self, nodes: Sequence[int]) -> None:
        """After verification: keep the accepted ``nodes`` the draft's cache holds."""
        self.step.keep([self.fed[node] for node in nodes if node in self.fed])

    def width(self, verified: Sequence[int], gamma: int, width: int, picker: TokenPicker) -> TreeDraft:
        step = self.step
        root = step.root(verified, picker)  # (V,)
        firsts = first_tokens(root, width, picker)
        topology = TreeTopology.width(len(firsts), gamma)
        tokens, drawn_from = list(firsts), [root] * len(firsts)
        for depth in range(gamma - 1):
            level = topology.level(depth)
            proposals = step.level([tokens[n] for n in level], topology.parents_of(level), picker)  # (d, V)
            for proposal in proposals:  # the children of ``level``, in node order
                tokens.append(pick(proposal, picker))
                drawn_from.append(proposal)
        step.done()
        self.fed = {node: node for node in range(len(topology) - len(firsts))}  # all levels but the last
        return TreeDraft(topology, tokens, probs=None if picker.greedy else torch.stack(drawn_from))  # probs (n, V)

    def dynamic(self, verified: Sequence[int], levels: int, budget: int, topk: int,
                picker: TokenPicker) -> TreeDraft:
        step = self.step
        top = step.log_proposal(step.root(verified, picker)[None], picker, topk)  # (1, k) log q and ids
        parents: list[int] = []  # every candidate, in creation order
        tokens: list[int] = []
        scores: list[float] = []
        frontier, frontier_scores = [ROOT], torch.zeros(1, dtype=torch.float64)
        fed: dict[int, int] = {}
        for level in range(levels):
            rows, children, child_scores = top_children(*top, frontier_scores)
            first = len(tokens)
            parents += [frontier[row] for row in rows]
            tokens += children
            scores += child_scores
            if level == levels - 1:
                break
            frontier = [first + i for i in best(child_scores, topk)]
            fed_parents = [fed.get(parents[node], ROOT) for node in frontier]
            proposals = step.level([tokens[node] for node in frontier], fed_parents, picker)  # (k, V)
            fed.update({node: len(fed) + i for i, node in enumerate(frontier)})  # numbered as the cache numbers them
            top = step.log_proposal(proposals, picker, topk)
            frontier_scores = torch.tensor([scores[node] for node in frontier], dtype=torch.float64)
        step.done()
        topology, kept = rerank(parents, scores, budget - 1)
        self.fed = {new: fed[old] for new, old in enumerate(kept) if old in fed}
        return TreeDraft(topology, [tokens[old] for old in kept], scores=[scores[old] for old in kept])
