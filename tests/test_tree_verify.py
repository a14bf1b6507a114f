"""Token-tree verification maths and tree masks: pure functions, no models."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from mmspec_cli.decoding.sampling import draw_without_replacement
from mmspec_cli.decoding.tree import PendingTree
from mmspec_cli.decoding.verify import recursive_rejection, verify_tree_greedy, verify_tree_sampling

from tests.test_engine_sampling import chi_square_p_value


def one_hot_logits(ids, vocab=8):
    logits = torch.full((len(ids), vocab), -5.0)
    logits[torch.arange(len(ids)), torch.tensor(ids)] = 5.0
    return logits


def test_greedy_follows_the_branch_that_starts_with_the_targets_token():
    branches = torch.tensor([[1, 2, 3], [4, 5, 6]])
    root = one_hot_logits([4])[0]
    branch_logits = torch.stack([one_hot_logits([0, 0, 0]), one_hot_logits([5, 7, 1])])  # branch 1: 4 5 then 7 ≠ 6
    assert verify_tree_greedy(branches, root, branch_logits).__dict__ == {"branch": 1, "accepted": 2, "next_token": 7}
    full = torch.stack([one_hot_logits([0, 0, 0]), one_hot_logits([5, 6, 3])])
    assert verify_tree_greedy(branches, root, full).__dict__ == {"branch": 1, "accepted": 3, "next_token": 3}
    assert verify_tree_greedy(branches, one_hot_logits([7])[0], full).__dict__ == {
        "branch": 0, "accepted": 0, "next_token": 7}


def test_tree_mask_shows_each_node_its_ancestors_only():
    tree = PendingTree(base=3)
    firsts = tree.add([7, 8], [-1, -1])  # two branches off the prefix
    seconds = tree.add([9, 9], [firsts[0], firsts[1]])
    mask, positions = tree.inputs(seconds, torch.float64, "cpu")
    assert positions.tolist() == [[4, 4]] and tree.inputs(firsts, torch.float64, "cpu")[1].tolist() == [[3, 3]]
    allowed = mask[0, 0] == 0  # (2, 3 + 4)
    assert allowed.tolist() == [[True, True, True, True, False, True, False],
                                [True, True, True, False, True, False, True]]
    padded, rows = tree.inputs(seconds, torch.float64, "cpu", prefix=torch.tensor([[0, 1, 1], [1, 1, 1]]))
    assert padded.shape == (2, 1, 2, 7) and bool(padded[0, 0, 0, 0] < 0) and bool(padded[1, 0, 0, 0] == 0)
    assert rows.tolist() == [[3, 3], [4, 4]]  # each row counts its own real positions


def random_distribution(vocab, generator, zeros=()):
    p = torch.rand(vocab, generator=generator, dtype=torch.float64) ** 2
    p[list(zeros)] = 0
    return p / p.sum()


@pytest.mark.parametrize("width", [2, 3])
def test_recursive_rejection_without_replacement_keeps_the_target_distribution(width):
    g = torch.Generator().manual_seed(width)
    vocab, runs = 6, 20000
    p = random_distribution(vocab, g, zeros=[5])
    q = random_distribution(vocab, g, zeros=[0])  # the draft can't propose 0; the target can't emit 5
    counts = Counter()
    for _ in range(runs):
        candidates = draw_without_replacement(q, width, g)
        index, residual = recursive_rejection(candidates, q, p, g)
        counts[candidates[index] if index is not None else int(torch.multinomial(residual, 1, generator=g))] += 1
    expected = {(t,): float(p[t]) for t in range(vocab) if p[t] > 0}
    assert chi_square_p_value(Counter({(t,): c for t, c in counts.items()}), expected, runs) > 1e-3


def test_the_test_catches_forgetting_to_renormalise_q():
    """Keeping q unchanged after a rejection (as if drawing with replacement) biases the output."""
    g = torch.Generator().manual_seed(0)
    vocab, runs = 4, 20000
    p = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    q = torch.tensor([0.7, 0.1, 0.1, 0.1], dtype=torch.float64)
    counts = Counter()
    for _ in range(runs):
        candidates = draw_without_replacement(q, 2, g)
        token = None
        p_i = p
        for x in candidates:  # the wrong rule: q never renormalised
            if float(torch.rand((), generator=g, dtype=torch.float64)) * float(q[x]) < float(p_i[x]):
                token = x
                break
            p_i = torch.clamp(p_i - q, min=0) / torch.clamp(p_i - q, min=0).sum()
        counts[(token if token is not None else int(torch.multinomial(p_i, 1, generator=g)),)] += 1
    expected = {(t,): float(p[t]) for t in range(vocab)}
    assert chi_square_p_value(counts, expected, runs) < 1e-6


def test_draws_without_replacement_are_distinct_and_stop_at_the_support():
    g = torch.Generator().manual_seed(1)
    probs = torch.tensor([0.5, 0.0, 0.3, 0.2], dtype=torch.float64)
    for _ in range(50):
        drawn = draw_without_replacement(probs, 3, g)
        assert sorted(drawn) == [0, 2, 3]
    assert len(draw_without_replacement(probs, 8, g)) == 3


def test_tree_sampling_continues_along_the_accepted_branch():
    g = torch.Generator().manual_seed(0)
    vocab = 5
    point = lambda t: torch.nn.functional.one_hot(torch.tensor(t), vocab).double()  # noqa: E731
    q_root = torch.tensor([0.0, 0.5, 0.5, 0.0, 0.0], dtype=torch.float64)
    branches = torch.tensor([[1, 3], [2, 4]])
    draft = torch.stack([torch.stack([q_root, point(3)]), torch.stack([q_root, point(4)])])  # (2, 2, V)
    target_branch = torch.stack([torch.stack([point(0), point(0)]), torch.stack([point(4), point(0)])])
    verdict = verify_tree_sampling(branches, draft, point(2), target_branch, g)  # the target can only say 2, 4, 0
    assert verdict.__dict__ == {"branch": 1, "accepted": 2, "next_token": 0}
