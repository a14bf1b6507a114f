"""The verification maths on hand-made distributions (no models)."""

import torch

from mmspec_cli.decoding.sampling import SamplingParams, probabilities
from mmspec_cli.decoding.verify import residual_distribution, verify_greedy, verify_sampling

V = 5


def one_hot_logits(choices):
    """(len(choices), V) logits whose argmax in row i is choices[i]."""
    logits = torch.zeros(len(choices), V)
    logits[torch.arange(len(choices)), torch.tensor(choices)] = 3.0
    return logits


def test_greedy_full_accept_takes_bonus():
    verdict = verify_greedy(torch.tensor([1, 2, 3]), one_hot_logits([1, 2, 3, 4]))
    assert (verdict.accepted, verdict.next_token) == (3, 4)


def test_greedy_early_mismatch_emits_target_argmax():
    verdict = verify_greedy(torch.tensor([0, 2, 3]), one_hot_logits([1, 2, 3, 4]))
    assert (verdict.accepted, verdict.next_token) == (0, 1)


def test_greedy_mismatch_in_the_middle_ignores_later_matches():
    verdict = verify_greedy(torch.tensor([1, 0, 3]), one_hot_logits([1, 2, 3, 4]))
    assert (verdict.accepted, verdict.next_token) == (1, 2)


def test_greedy_with_no_draft_is_plain_decoding():
    verdict = verify_greedy(torch.tensor([], dtype=torch.long), one_hot_logits([4]))
    assert (verdict.accepted, verdict.next_token) == (0, 4)


def test_residual_is_normalised_positive_part():
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.6, 0.2], dtype=torch.float64)
    assert torch.allclose(residual_distribution(p, q), torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64))
    p2 = torch.tensor([0.4, 0.4, 0.2], dtype=torch.float64)
    q2 = torch.tensor([0.1, 0.3, 0.6], dtype=torch.float64)
    assert torch.allclose(residual_distribution(p2, q2), torch.tensor([0.75, 0.25, 0.0], dtype=torch.float64))


def test_residual_of_identical_distributions_falls_back_to_p():
    p = torch.tensor([0.25, 0.75], dtype=torch.float64)
    assert torch.allclose(residual_distribution(p, p.clone()), p)


def test_sampling_accepts_everything_when_draft_equals_target():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(4, V, dtype=torch.float64, generator=g), -1)
    tokens = torch.tensor([0, 1, 2])
    for _ in range(50):
        assert verify_sampling(tokens, p[:3], p, g).accepted == 3


def test_sampling_always_rejects_tokens_the_target_cannot_emit():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.0, 0.5, 0.5, 0.0, 0.0]] * 2, dtype=torch.float64)
    q = torch.tensor([[1.0, 0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    for _ in range(50):
        verdict = verify_sampling(torch.tensor([0]), q, p, g)
        assert verdict.accepted == 0 and verdict.next_token in (1, 2)


def test_first_emitted_token_follows_the_target_distribution():
    """One draft token: the emitted first token must be distributed as p, whatever q is."""
    g = torch.Generator().manual_seed(1)
    p = torch.tensor([0.1, 0.4, 0.3, 0.15, 0.05], dtype=torch.float64)
    q = torch.tensor([0.5, 0.1, 0.1, 0.1, 0.2], dtype=torch.float64)
    n = 20000
    counts = torch.zeros(V, dtype=torch.float64)
    for _ in range(n):
        y = int(torch.multinomial(q, 1, generator=g))
        verdict = verify_sampling(torch.tensor([y]), q[None], torch.stack([p, p]), g)
        counts[y if verdict.accepted else verdict.next_token] += 1
    assert (counts / n - p).abs().sum() / 2 < 0.015
    # a rule that always accepted would show q instead, far beyond the bound
    assert (q - p).abs().sum() / 2 > 0.3


def test_top_k_and_top_p_shape_the_distribution():
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1], dtype=torch.float64))
    top2 = probabilities(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(top2, torch.tensor([2 / 3, 1 / 3, 0, 0], dtype=torch.float64))
    nucleus = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.7))  # 0.5 + 0.25 reaches 0.7
    assert torch.allclose(nucleus, torch.tensor([2 / 3, 1 / 3, 0, 0], dtype=torch.float64))
    tiny_p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.1))  # the top token always stays
    assert torch.allclose(tiny_p, torch.tensor([1.0, 0, 0, 0], dtype=torch.float64))
    hot = probabilities(logits, SamplingParams(temperature=2.0))
    assert torch.allclose(hot, torch.softmax(logits / 2, -1))
