"""TABED's mixture and weight policies on hand-made distributions (TABED §5.1, App. B)."""

import math

import pytest
import torch

from mmspec_cli.models.profiles import EnsembleSpec
from mmspec_cli.drafters.weights import (KL_FLOOR, WeightPolicy, adaboost_weights, candidate_errors,
                                         candidate_mixtures, entropy_term, mixture, random_simplex_point,
                                         simplex_grid, softmax_weights)


def t(rows):
    return torch.tensor(rows, dtype=torch.float64)


def started(policy):
    """A policy after its first block (which always uses equal weights), as in the decoding loop."""
    policy.weights()
    return policy


def observe(policy, p, members, labels):
    """One verified position: p (V,), members [(V,), ...], label int."""
    policy.observe(t([p]), t([members]), torch.tensor([labels]))


def test_mixture_is_the_weighted_average():
    q = t([[0.2, 0.8], [1.0, 0.0]])
    assert torch.allclose(mixture(q, t([0.25, 0.75])), t([0.8, 0.2]))


def test_simplex_grid_is_tabeds_two_member_grid():
    grid = simplex_grid(2, 10)
    assert grid.shape == (11, 2) and torch.allclose(grid.sum(1), torch.ones(11, dtype=torch.float64))
    assert simplex_grid(3, 2).shape == (6, 3)


def test_first_block_uses_equal_weights():
    policy = WeightPolicy(3, EnsembleSpec(policy="grid"), vocab_size=4)
    assert torch.allclose(policy.weights(), torch.full((3,), 1 / 3, dtype=torch.float64))


def test_grid_moves_all_weight_to_the_member_that_equals_p():
    p = [0.7, 0.2, 0.1]
    policy = started(WeightPolicy(2, EnsembleSpec(policy="grid"), vocab_size=3))
    observe(policy, p, [p, [0.05, 0.05, 0.9]], 0)
    assert policy.weights().tolist() == [1.0, 0.0]


def test_hard_and_soft_labels_can_choose_differently():
    """Member A is close to p but its argmax misses the kept token; B's argmax hits it but B is far from p."""
    p, a, b = [0.45, 0.55, 0.0], [0.40, 0.60, 0.0], [0.60, 0.0, 0.40]
    soft = started(WeightPolicy(2, EnsembleSpec(policy="grid", labels="soft"), vocab_size=3))
    hard = started(WeightPolicy(2, EnsembleSpec(policy="grid", labels="hard"), vocab_size=3))
    for policy in (soft, hard):
        observe(policy, p, [a, b], 0)  # the target kept token 0 (e.g. sampled)
    w_soft, w_hard = soft.weights(), hard.weights()
    assert w_soft.tolist() == [1.0, 0.0]
    assert int(mixture(t([a, b]), w_hard).argmax()) == 0  # hard labels maximise matches ...
    assert not torch.equal(w_soft, w_hard)
    # ... and among the mixtures that match, break the tie by the soft error: the most A-like one
    # (0.7·A + 0.3·B = [0.46, 0.42, 0.12] still picks token 0; 0.8·A + 0.2·B does not)
    assert w_hard.tolist() == pytest.approx([0.7, 0.3])


def test_the_window_drops_old_evidence():
    p, good, bad = [0.9, 0.1], [0.9, 0.1], [0.1, 0.9]
    everything = started(WeightPolicy(2, EnsembleSpec(policy="grid", window=None), vocab_size=2))
    recent = started(WeightPolicy(2, EnsembleSpec(policy="grid", window=2), vocab_size=2))
    for policy in (everything, recent):
        for _ in range(5):
            observe(policy, p, [good, bad], 0)  # member 0 was right for 5 positions
        for _ in range(2):
            observe(policy, p, [bad, good], 0)  # then member 1 for the last 2
    assert everything.weights()[0] > 0.5  # five old positions still outweigh two new ones
    assert recent.weights().tolist() == [0.0, 1.0]  # only the last two count
    assert recent.evidence.count == 2


def test_tvd_and_kl_rank_a_constructed_case_differently():
    """A puts zero mass where p has half (KL: huge; TVD: 0.5); B spreads mass away (TVD 0.6, KL 0.92)."""
    p = t([[0.5, 0.5, 0.0]])
    members = t([[[1.0, 0.0, 0.0], [0.2, 0.2, 0.6]]])  # (n=1, m=2, V=3)
    one_hot = torch.eye(2, dtype=torch.float64)
    mixed = candidate_mixtures(members, one_hot)
    tvd = candidate_errors(p, mixed, "tvd")[0]
    kl = candidate_errors(p, mixed, "kl")[0]
    assert tvd.tolist() == pytest.approx([0.5, 0.6])
    assert kl[1].item() == pytest.approx(math.log(2.5))
    assert int(tvd.argmin()) == 0 and int(kl.argmin()) == 1
    for distance, expected in (("tvd", [1.0, 0.0]), ("kl", [0.0, 1.0])):
        policy = started(WeightPolicy(2, EnsembleSpec(policy="grid", grid_steps=1, distance=distance), vocab_size=3))
        policy.observe(p, members, torch.tensor([0]))
        assert policy.weights().tolist() == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kl_errors_are_the_definition_for_every_candidate_and_position(dtype):
    """e[t, j] = Σ_v p_tv log p_tv − Σ_v p_tv log max(q_{w_j,tv}, floor), written out in float64 with ``xlogy``
    (0 log 0 = 0), for a target with zero probabilities: one error per (position, candidate), the mixtures left as
    given."""
    generator = torch.Generator().manual_seed(3)
    n, members, vocab = 4, 3, 301
    q = torch.softmax(4 * torch.randn(n, members, vocab, generator=generator, dtype=dtype), dim=-1)
    p = torch.softmax(4 * torch.randn(n, vocab, generator=generator, dtype=dtype), dim=-1)
    p[0, :40] = 0.0
    candidates = simplex_grid(members, 4).to(q)
    mixed = candidate_mixtures(q, candidates)
    given = mixed.clone()
    errors = candidate_errors(p, mixed, "kl")
    p64, mixed64 = p.double(), given.double()
    expected = (torch.xlogy(p64, p64).sum(-1)[:, None]
                - (p64[:, None, :] * mixed64.clamp_min(KL_FLOOR).log()).sum(-1))  # (n, C)
    assert errors.shape == (n, len(candidates))
    torch.testing.assert_close(errors.double(), expected, rtol=1e-5 if dtype == torch.float32 else 1e-12, atol=0)
    assert torch.equal(mixed, given)  # the caller's mixtures are not written
    # Σ p log p is xlogy's, up to an ulp of the log
    torch.testing.assert_close(entropy_term(p), torch.xlogy(p, p).sum(-1, keepdim=True), rtol=1e-6, atol=0)


def test_adaboost_equation_2_gives_the_expected_numbers():
    # w_m = ln(1/ε_m - 1) + C ln(K - 1): ε = (0.1, 0.5), K = 3, C = 1 -> (ln 9 + ln 2, ln 2), normalised
    w = adaboost_weights(t([0.1, 0.5]), vocab_size=3, c=1.0)
    raw = torch.tensor([math.log(9) + math.log(2), math.log(2)], dtype=torch.float64)
    assert torch.allclose(w, raw / raw.sum())
    assert w.tolist() == pytest.approx([0.80657, 0.19343], abs=1e-5)
    # a member worse than chance gets nothing
    assert adaboost_weights(t([0.999, 0.2]), vocab_size=2, c=1.0).tolist() == pytest.approx([0.0, 1.0])


def test_adaboost_policy_counts_error_rates_from_hard_hits():
    policy = started(WeightPolicy(2, EnsembleSpec(policy="adaboost"), vocab_size=3))
    for label in (0, 0, 0, 1):  # member 0 always predicts token 0: 3 hits of 4; member 1 predicts 1: 1 of 4
        observe(policy, [0.5, 0.5, 0.0], [[0.9, 0.1, 0.0], [0.1, 0.9, 0.0]], label)
    assert torch.allclose(policy.weights(), adaboost_weights(t([0.25, 0.75]), 3))


def test_softmax_of_inverse_errors_with_temperature():
    assert softmax_weights(t([1.0, 2.0]), tau=1.0).tolist() == pytest.approx(torch.softmax(t([1.0, 0.5]), 0).tolist())
    sharp, flat = softmax_weights(t([1.0, 2.0]), tau=0.1), softmax_weights(t([1.0, 2.0]), tau=10.0)
    assert sharp[0] > 0.99 and abs(flat[0] - 0.5) < 0.02


def test_random_policy_is_a_fresh_simplex_point_each_block_and_static_is_equal():
    policy = WeightPolicy(3, EnsembleSpec(policy="random"), vocab_size=3, seed=1)
    assert policy.weights().tolist() == pytest.approx([1 / 3] * 3)  # the first block, as for every policy
    a, b = policy.weights(), policy.weights()
    assert a.sum().item() == pytest.approx(1.0) and (a >= 0).all() and not torch.equal(a, b)
    static = started(WeightPolicy(2, EnsembleSpec(policy="static"), vocab_size=3))
    observe(static, [1.0, 0.0, 0.0], [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]], 0)
    assert static.weights().tolist() == [0.5, 0.5]
    assert random_simplex_point(4, torch.Generator().manual_seed(0)).shape == (4,)
