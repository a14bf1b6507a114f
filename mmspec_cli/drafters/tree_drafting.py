"""The loops that draft token trees, for every drafter that drafts trees: width-d trees (TABED §6.1)
and EAGLE-2 dynamic trees (Li et al. 2024).

A drafter's ``propose`` hands a tree shape to :meth:`TreeDrafting.draft_tree`; it supplies two steps and the
loops do the rest:

- ``tree_root(verified, picker)``: the proposal at the last verified token, (V,);
- ``tree_level(tokens, parents, picker)``: feed one level of nodes (each seeing the prefix and
  its own ancestors) in ONE forward and return the proposal after each node, (n, V).

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

Only some nodes are fed to the draft's cache; ``_fed`` maps a tree node to its number in the
cache, so that ``keep_path`` (called from the drafter's ``accept``) keeps the accepted nodes the cache holds
(``keep_fed``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mmspec_cli.decoding.drafter import DraftShape, TreeDraft
from mmspec_cli.decoding.sampling import TokenPicker, draw_without_replacement
from mmspec_cli.decoding.tree import ROOT, TreeTopology, best, rerank, top_children


def first_tokens(proposal: torch.Tensor, width: int, picker: TokenPicker) -> list[int]:
    """The tree's first tokens: the ``width`` likeliest of ``proposal`` (greedy; logits or probabilities),
    or ``width`` draws without replacement from it (sampling; probabilities), fewer if the support is smaller."""
    if picker.greedy:
        return torch.topk(proposal, min(width, proposal.shape[-1])).indices.tolist()
    return draw_without_replacement(proposal, width, picker.generator)


def pick(proposal: torch.Tensor, picker: TokenPicker) -> int:
    """One token from a proposal: its argmax when greedy, a draw from it when sampling."""
    return int(proposal.argmax()) if picker.greedy else picker.choose_from(proposal)


class TreeDrafting:
    """Mixin: ``draft_tree`` (a width or a dynamic tree) from the drafter's ``tree_root`` and ``tree_level``."""

    _fed: dict[int, int] = {}

    def draft_tree(self, verified: Sequence[int], shape: DraftShape, picker: TokenPicker) -> TreeDraft:
        """The tree ``shape`` asks for, after the ``verified`` tokens."""
        if shape.kind == "dynamic":
            return self.propose_dynamic_tree(verified, shape.length, shape.budget, shape.topk, picker)
        return self.propose_tree(verified, shape.length, shape.width, picker)

    def tree_root(self, generated: Sequence[int], picker: TokenPicker) -> torch.Tensor:
        raise NotImplementedError

    def tree_level(self, tokens: Sequence[int], parents: Sequence[int], picker: TokenPicker) -> torch.Tensor:
        raise NotImplementedError

    def tree_done(self) -> None:
        """The tree is drafted (``ssd`` gives the target's cache back here)."""

    def log_proposal(self, proposal: torch.Tensor, picker: TokenPicker) -> torch.Tensor:
        """log q of a proposal: logits when greedy (single drafters), probabilities when sampling."""
        if picker.greedy:
            return torch.log_softmax(proposal.to(torch.float64), dim=-1)
        return proposal.to(torch.float64).log()

    def keep_fed(self, fed: Sequence[int]) -> None:
        """Keep these fed nodes (cache numbers, one path from the top) in the draft's cache."""

    def keep_path(self, nodes: Sequence[int]) -> None:
        self.keep_fed([self._fed[node] for node in nodes if node in self._fed])

    def propose_tree(self, generated: Sequence[int], gamma: int, width: int, picker: TokenPicker) -> TreeDraft:
        root = self.tree_root(generated, picker)  # (V,)
        firsts = first_tokens(root, width, picker)
        topology = TreeTopology.width(len(firsts), gamma)
        tokens, drawn_from = list(firsts), [root] * len(firsts)
        for depth in range(gamma - 1):
            level = topology.level(depth)
            proposals = self.tree_level([tokens[n] for n in level], topology.parents_of(level), picker)  # (d, V)
            for proposal in proposals:  # the children of ``level``, in node order
                tokens.append(pick(proposal, picker))
                drawn_from.append(proposal)
        self.tree_done()
        self._fed = {node: node for node in range(len(topology) - len(firsts))}  # all levels but the last
        return TreeDraft(topology, tokens, probs=None if picker.greedy else torch.stack(drawn_from))  # probs (n, V)

    def propose_dynamic_tree(self, generated: Sequence[int], levels: int, budget: int, topk: int,
                             picker: TokenPicker) -> TreeDraft:
        log_q = self.log_proposal(self.tree_root(generated, picker), picker)[None]  # (1, V)
        parents: list[int] = []  # every candidate, in creation order
        tokens: list[int] = []
        scores: list[float] = []
        frontier, frontier_scores = [ROOT], torch.zeros(1, dtype=torch.float64)
        fed: dict[int, int] = {}
        for level in range(levels):
            rows, children, child_scores = top_children(log_q, frontier_scores, topk)
            first = len(tokens)
            parents += [frontier[row] for row in rows]
            tokens += children
            scores += child_scores
            if level == levels - 1:
                break
            frontier = [first + i for i in best(child_scores, topk)]
            fed_parents = [fed.get(parents[node], ROOT) for node in frontier]
            proposals = self.tree_level([tokens[node] for node in frontier], fed_parents, picker)  # (k, V)
            fed.update({node: len(fed) + i for i, node in enumerate(frontier)})  # numbered as the cache numbers them
            log_q = self.log_proposal(proposals, picker)
            frontier_scores = torch.tensor([scores[node] for node in frontier], dtype=torch.float64)
        self.tree_done()
        topology, kept = rerank(parents, scores, budget - 1)
        self._fed = {new: fed[old] for new, old in enumerate(kept) if old in fed}
        return TreeDraft(topology, [tokens[old] for old in kept], scores=[scores[old] for old in kept])
