"""The one loop that drafts a width-d token tree (TABED §6.1), for every drafter that drafts trees.

A drafter supplies two steps and the loop does the rest:

- ``tree_root(generated, picker)``: the proposal at the last verified token, (V,);
- ``tree_level(tokens, parents, picker)``: feed one level of nodes (each seeing the prefix and
  its own ancestors) in ONE forward and return the proposal after each node, (n, V).

A *proposal* is what a token is picked from: logits or probabilities when greedy (argmax),
the probabilities it is drawn from when sampling. The d first tokens are the d likeliest
(greedy), or d draws without replacement (sampling); each branch then continues alone. The
tree's nodes are fed level by level in node order (:meth:`TreeTopology.width`), so a cache's
node numbers are the topology's; the last level is never fed (no draft step reads it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mmspec_cli.decoding.drafter import TreeDraft
from mmspec_cli.decoding.sampling import TokenPicker, draw_without_replacement
from mmspec_cli.decoding.tree import TreeTopology


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
    """Mixin: ``propose_tree`` from the drafter's ``tree_root`` and ``tree_level`` steps."""

    def tree_root(self, generated: Sequence[int], picker: TokenPicker) -> torch.Tensor:
        raise NotImplementedError

    def tree_level(self, tokens: Sequence[int], parents: Sequence[int], picker: TokenPicker) -> torch.Tensor:
        raise NotImplementedError

    def tree_done(self) -> None:
        """The tree is drafted (``ssd`` gives the target's cache back here)."""

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
        return TreeDraft(topology, tokens, probs=None if picker.greedy else torch.stack(drawn_from))  # probs (n, V)
