"""The sampling rules draw what they drew before they were written for N blocks at once.

``decoding/verify.py`` runs each one-block rule as its batched form with one row. The outputs below were
recorded from the one-block rules as they were before that change (commit 2a9eb9c), on the same inputs and
generator seeds, so a seeded run keeps its output across the change; a rule that consumed its generator
differently, or decided differently, would change some of them.
"""

from __future__ import annotations

import torch

from mmspec_cli.decoding.verify import verify_any_tree_sampling, verify_sampling, verify_tree_sampling

N = 24
V = 7
PARENTS = [-1, -1, 0, 0, 1, 2]  # two children of the root, two of node 0, one each of nodes 1 and 2


def _probs(generator: torch.Generator, *shape: int) -> torch.Tensor:
    logits = torch.randn(*shape, V, generator=generator, dtype=torch.float64) * 1.5
    logits[..., V - 1] = -torch.inf  # a token no distribution gives: zeros in p and q, as top-k leaves them
    return torch.softmax(logits, dim=-1)


def chain_case(i: int):
    """γ = 3 draft tokens drawn from q, and the target's p at the 4 positions."""
    g = torch.Generator().manual_seed(1000 + i)
    q = _probs(g, 3)
    tokens = torch.multinomial(q, 1, generator=g)[:, 0]
    return tokens, q, _probs(g, 4)


def tree_case(i: int):
    """A width-3 tree of 2 tokens a branch: first tokens drawn from q_root without replacement."""
    g = torch.Generator().manual_seed(2000 + i)
    q_root = _probs(g)
    first = torch.multinomial(q_root, 3, replacement=False, generator=g)
    q_next = _probs(g, 3)
    second = torch.multinomial(q_next, 1, generator=g)[:, 0]
    draft_probs = torch.stack([q_root.expand(3, -1), q_next], dim=1)  # (3, 2, V)
    return torch.stack([first, second], dim=1), draft_probs, _probs(g), _probs(g, 3, 2)


def any_tree_case(i: int):
    """A dynamic tree of :data:`PARENTS` with distinct tokens among siblings, scores and the target's p per row."""
    g = torch.Generator().manual_seed(3000 + i)
    tokens = [int(t) for t in torch.randperm(V - 1, generator=g)[:len(PARENTS)]]
    scores = [float(s) for s in -torch.rand(len(PARENTS), generator=g)]
    return PARENTS, tokens, scores, _probs(g, len(PARENTS) + 1)


CHAIN = [(0, 3), (1, 0), (0, 5), (1, 5), (0, 2), (1, 3), (2, 0), (0, 3), (0, 5), (0, 3), (0, 4), (1, 3), (1, 0),
         (0, 2), (1, 2), (0, 0), (2, 3), (0, 2), (0, 3), (0, 5), (0, 1), (0, 0), (0, 3), (0, 0)]
TREE = [(0, 1, 3), (0, 1, 4), (0, 0, 5), (0, 1, 3), (0, 1, 0), (1, 1, 2), (0, 0, 0), (0, 2, 4), (0, 0, 3),
        (1, 2, 5), (0, 2, 5), (0, 1, 5), (2, 2, 5), (0, 0, 0), (0, 0, 2), (0, 0, 1), (1, 2, 5), (0, 2, 3),
        (0, 0, 2), (1, 2, 5), (0, 0, 3), (0, 0, 2), (1, 2, 3), (0, 0, 0)]
ANY_TREE = [((), 4), ((), 0), ((3,), 3), ((3,), 5), ((), 0), ((2,), 1), ((), 4), ((), 1), ((), 0), ((3,), 3),
            ((), 1), ((), 4), ((), 5), ((3,), 1), ((), 3), ((), 2), ((2, 5), 1), ((), 1), ((), 0), ((3,), 4),
            ((), 3), ((), 4), ((), 4), ((), 1)]


def verdicts(case, rule) -> list:
    """``rule`` on the inputs of each of the N cases, with generator seed i for case i."""
    return [rule(*case(i), torch.Generator().manual_seed(i)) for i in range(N)]


def test_the_chain_rule_draws_as_before():
    assert [(v.accepted, v.next_token) for v in verdicts(chain_case, verify_sampling)] == CHAIN


def test_the_width_tree_rule_draws_as_before():
    assert [(v.branch, v.accepted, v.next_token) for v in verdicts(tree_case, verify_tree_sampling)] == TREE


def test_the_dynamic_tree_rule_draws_as_before():
    assert [(tuple(v.rows), v.next_token) for v in verdicts(any_tree_case, verify_any_tree_sampling)] == ANY_TREE
