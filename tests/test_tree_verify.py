"""Token-tree verification maths and tree masks: pure functions, no models.

The width-tree rule's distribution test runs :func:`~mmspec_cli.decoding.verify.verify_tree_sampling_batch`
(the code the engine's one-tree call runs) on 200,000 trees at once; deliberately wrong rules must fail it
at p < 1e-6.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from mmspec_cli.decoding import verify
from mmspec_cli.decoding.sampling import draw_without_replacement
from mmspec_cli.decoding.tree import PendingTree
from mmspec_cli.decoding.verify import (draw_rows, recursive_rejection, recursive_rejection_batch, verify_tree_greedy,
                                        verify_tree_sampling, verify_tree_sampling_batch)
from tests.distributions import ToyModel, chi_square_p_value
from tests.helpers import one_hot_logits


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


# --------------------------------------------------------------------------- the width-tree rule's distribution

DRAWS = 200_000  # trees per test, in one call
V = 5


def target_and_draft() -> tuple[ToyModel, ToyModel]:
    """Over 5 tokens and 3 positions: the target never gives token 4, the draft never proposes token 0."""
    return ToyModel(V, 3, seed=1, zero=V - 1), ToyModel(V, 3, seed=2, zero=0)


def tree_sequences(rule, target: ToyModel, draft: ToyModel, width: int, seed: int = 0) -> torch.Tensor:
    """DRAWS trees of ``width`` branches of 2 tokens, as the engine drafts them: distinct first tokens drawn from
    the draft's root q without replacement (in draw order), each branch's second token drawn after its first.
    ``rule`` settles each tree; what it emits is completed to 3 tokens from the target: (DRAWS, 3)."""
    g = torch.Generator().manual_seed(seed)
    empty = torch.zeros(DRAWS, 0, dtype=torch.long)
    q_root = draft.probs(empty)  # (N, V)
    firsts = torch.multinomial(q_root, width, replacement=False, generator=g)  # (N, d), in draw order
    q_second = torch.stack([draft.probs(firsts[:, j:j + 1]) for j in range(width)], dim=1)  # (N, d, V)
    seconds = torch.multinomial(q_second.reshape(-1, V), 1, generator=g).reshape(DRAWS, width)
    branches = torch.stack([firsts, seconds], dim=2)  # (N, d, 2)
    draft_probs = torch.stack([q_root[:, None].expand(-1, width, -1), q_second], dim=2)  # (N, d, 2, V)
    branch_probs = torch.stack([torch.stack([target.probs(branches[:, j, :t + 1]) for t in range(2)], dim=1)
                                for j in range(width)], dim=1)  # (N, d, 2, V)
    branch, accepted, next_token = rule(branches, draft_probs, target.probs(empty), branch_probs, g)
    return target.finish(branches[torch.arange(DRAWS), branch], accepted, next_token, g)


@pytest.mark.parametrize("width", [1, 2, 3, 4])
def test_recursive_rejection_without_replacement_keeps_the_target_distribution(width):
    """Width 4 is the draft's whole support: every tree holds every token the draft can propose."""
    target, draft = target_and_draft()
    sequences = tree_sequences(verify_tree_sampling_batch, target, draft, width)
    assert target.p_value(sequences) > 1e-3


def first_branch_whole(branches, draft_probs, root_probs, branch_probs, generator):
    """Wrong: branch 0 is kept whole and the bonus drawn, so the output follows the draft."""
    n, _, gamma = branches.shape
    return (torch.zeros(n, dtype=torch.long), torch.full((n,), gamma),
            draw_rows(branch_probs[:, 0, -1], generator))


def without_renormalising(q, x):
    q = q.clone()
    q[torch.arange(len(x)), x] = 0.0
    return q


WRONG_TREE_RULES = {
    "keep the first branch whole": None,
    # as if the candidates had been drawn WITH replacement (the test the old suite ran)
    "forget to renormalise q after a rejection": lambda q, x: q,
    "remove the rejected candidate from q without renormalising": without_renormalising,
    "leave the residual of p unnormalised": lambda p, q: torch.clamp(p - q, min=0.0),
}


@pytest.mark.parametrize("wrong", list(WRONG_TREE_RULES))
def test_a_wrong_tree_rule_fails_the_distribution_test(wrong, monkeypatch):
    """The test above can fail: each wrong rule gives p < 1e-6 at width 3."""
    target, draft = target_and_draft()
    rule = verify_tree_sampling_batch
    if wrong == "keep the first branch whole":
        rule = first_branch_whole
    elif "residual" in wrong:  # the next candidate is then judged against a p that does not sum to 1
        monkeypatch.setattr(verify, "residual_distribution", WRONG_TREE_RULES[wrong])
    else:
        monkeypatch.setattr(verify, "drop_candidate", WRONG_TREE_RULES[wrong])
    assert target.p_value(tree_sequences(rule, target, draft, 3)) < 1e-6


def test_one_tree_is_the_batched_rule_with_one_row():
    """The engine's one-tree calls draw what the batched rules draw for that tree, from the same generator."""
    target, draft = target_and_draft()
    for i in range(30):
        g = torch.Generator().manual_seed(100 + i)
        q, p = draft.probs(torch.zeros(1, 0, dtype=torch.long))[0], target.probs(torch.zeros(1, 0, dtype=torch.long))[0]
        candidates = draw_without_replacement(q, 3, g)
        one, batch = torch.Generator().manual_seed(i), torch.Generator().manual_seed(i)
        index, residual = recursive_rejection(candidates, q, p, one)
        indices, residuals = recursive_rejection_batch(torch.tensor([candidates]), q[None], p[None], batch)
        assert (index if index is not None else -1) == int(indices[0]) and torch.equal(residual, residuals[0])
        assert torch.equal(one.get_state(), batch.get_state())


def test_a_tree_shapes_only_the_branch_it_follows():
    """Given the target's branch rows as a function (the engine's), the rule asks for the followed branch alone, and
    none when no first token is accepted; it draws what it draws from the whole tensor (verdict and generator)."""
    target, draft = target_and_draft()
    for i in range(60):
        g = torch.Generator().manual_seed(200 + i)
        empty = torch.zeros(1, 0, dtype=torch.long)
        q, p = draft.probs(empty)[0], target.probs(empty)[0]
        firsts = torch.tensor(draw_without_replacement(q, 2, g))  # (d,)
        seconds = torch.stack([draft.probs(firsts[j:j + 1][None])[0] for j in range(2)])  # (d, V)
        branches = torch.stack([firsts, torch.multinomial(seconds, 1, generator=g)[:, 0]], dim=1)  # (d, 2)
        draft_probs = torch.stack([q.expand(2, -1), seconds], dim=1)  # (d, 2, V)
        branch_probs = torch.stack([torch.stack([target.probs(branches[j:j + 1, :t + 1])[0] for t in range(2)])
                                    for j in range(2)])  # (d, 2, V)
        asked: list[list[int]] = []

        def followed(js: torch.Tensor) -> torch.Tensor:
            asked.append(js.tolist())
            return branch_probs[js]

        lazy, whole = torch.Generator().manual_seed(i), torch.Generator().manual_seed(i)
        verdict = verify_tree_sampling(branches, draft_probs, p, followed, lazy)
        assert verdict == verify_tree_sampling(branches, draft_probs, p, branch_probs, whole)
        assert torch.equal(lazy.get_state(), whole.get_state())
        assert asked == ([[verdict.branch]] if verdict.accepted else [])


def test_draws_without_replacement_come_in_draw_order():
    """The engine's first tokens: (x1, x2) has probability q(x1) · q(x2) / (1 − q(x1)), the law the rule assumes."""
    g = torch.Generator().manual_seed(3)
    q = torch.tensor([0.5, 0.25, 0.15, 0.1], dtype=torch.float64)
    runs = 4000
    counts = Counter(tuple(draw_without_replacement(q, 2, g)) for _ in range(runs))
    expected = {(a, b): float(q[a] * q[b] / (1 - q[a])) for a in range(4) for b in range(4) if a != b}
    assert chi_square_p_value(counts, expected, runs) > 1e-3
    backwards = {(b, a): p for (a, b), p in expected.items()}  # a sampler that returned them reversed
    assert chi_square_p_value(counts, backwards, runs) < 1e-6


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
