"""The verification maths on hand-made distributions (no models).

The chain rule's distribution test runs the pure function on 200,000 blocks at once
(:func:`~mmspec_cli.decoding.verify.verify_sampling_batch`, the code the engine's one-block call runs):
the block's emitted tokens, completed to a fixed length by drawing from the target, must follow the
target's exact joint distribution; the same test with a deliberately wrong rule must fail at p < 1e-6.
"""

import pytest
import torch

from mmspec_cli.decoding import verify
from mmspec_cli.decoding.sampling import (INVERSE_CDF_FROM, SamplingParams, argmax_ids, draw_ids,
                                          invert_cumulative, probabilities)
from mmspec_cli.decoding.verify import (draw_rows, residual_distribution, verify_any_tree_sampling, verify_greedy,
                                        verify_sampling, verify_sampling_batch, verify_tree_sampling)
from mmspec_cli.drafters.weights import mixture
from tests.distributions import ToyModel

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_argmax_ids_picks_what_torch_argmax_picks_on_ties_nans_and_infinities(dtype):
    """The greedy choice must be transformers' (``torch.argmax``: the first maximum, a NaN counting as the maximum)
    wherever the faster ``torch.max`` indices are read instead: many ties (few distinct values), rows of -inf, a
    NaN, vocabularies on both sides of a vectorised reduction's chunk, 1-D and 2-D, and a transposed (strided) view."""
    generator = torch.Generator().manual_seed(0)
    for trial in range(300):
        rows, vocab = 1 + trial % 6, (3, 17, 1200, 4099)[trial % 4]
        logits = torch.randint(-2, 3, (rows, vocab), generator=generator).to(dtype)  # ties everywhere
        if trial % 5 == 0:
            logits[0, int(torch.randint(0, vocab, (1,), generator=generator))] = float("nan")
        if trial % 7 == 0:
            logits[-1] = float("-inf")
        strided = logits.t().contiguous().t()
        for case in (logits, strided, logits[0]):
            assert torch.equal(argmax_ids(case), case.argmax(dim=-1)), (trial, dtype)


def test_the_inverse_transform_gives_each_id_its_probability_and_never_one_of_none():
    """Uniforms on an even grid of M points: each id is drawn at exactly its share of them, up to one point, and an
    id of zero probability (inside the row, first or last) at none; where u · total rounds up to the total, the last
    id of positive probability."""
    probs = torch.zeros(2, 40, dtype=torch.float64)
    probs[0, [1, 7, 8, 30]] = torch.tensor([0.1, 0.45, 0.25, 0.2], dtype=torch.float64)
    probs[1, [0, 39]] = torch.tensor([3.0, 1.0], dtype=torch.float64)  # a distribution up to its sum
    cumulative = probs.cumsum(dim=-1)
    points = 10_000
    grid = (torch.arange(points, dtype=torch.float64) / points)[:, None]  # u in [0, 1)
    for row in range(2):
        ids = invert_cumulative(probs[row].expand(points, -1), cumulative[row].expand(points, -1), grid)
        counts = torch.bincount(ids, minlength=40).to(torch.float64)
        share = probs[row] / probs[row].sum()
        assert ((counts / points - share).abs() <= 1 / points).all()
        assert counts[share == 0].sum() == 0
    below_one = torch.tensor([[1.0 - 2.0 ** -53]], dtype=torch.float64)
    trailing = torch.tensor([[0.3, 0.7, 0.0, 0.0]], dtype=torch.float64)
    over = torch.tensor([[1.0 + 1e-12]], dtype=torch.float64)  # what a total rounded past the last sum would ask for
    assert invert_cumulative(trailing, trailing.cumsum(-1), below_one).tolist() == [1]
    assert invert_cumulative(trailing, trailing.cumsum(-1), over).tolist() == [1]


def test_a_large_row_is_drawn_by_the_inverse_transform_and_a_small_one_as_multinomial_draws_it():
    """From INVERSE_CDF_FROM ids a row, a draw is the inverse transform at the generator's uniform, never an id of
    zero probability, one per row; below it, ``torch.multinomial``'s own draw (the recorded draws stay); a row
    with no finite mass is refused."""
    large = torch.zeros(3, INVERSE_CDF_FROM + 3)
    large[:, [5, 9000, INVERSE_CDF_FROM + 1]] = torch.tensor([0.2, 0.5, 0.3])
    large[2] = large[2].roll(7)  # ids 12, 9007 and 5 (the last wraps around)
    drawn = torch.stack([draw_ids(large, torch.Generator().manual_seed(seed)) for seed in range(200)])  # (200, 3)
    assert drawn.shape == (200, 3)
    assert set(drawn[:, :2].flatten().tolist()) <= {5, 9000, INVERSE_CDF_FROM + 1}
    assert set(drawn[:, 2].tolist()) <= {12, 9007, 5}
    uniforms = torch.rand(3, 1, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    rows = large.to(torch.float64)
    assert draw_ids(large, torch.Generator().manual_seed(0)).tolist() == invert_cumulative(
        rows, rows.cumsum(-1), uniforms).tolist()
    small = torch.softmax(torch.randn(4, 1200, generator=torch.Generator().manual_seed(3)), dim=-1)
    assert draw_ids(small, torch.Generator().manual_seed(4)).tolist() == torch.multinomial(
        small.to(torch.float64), 1, generator=torch.Generator().manual_seed(4)).squeeze(-1).tolist()
    negative = large[:1].clone()
    negative[0, 7] = -0.1
    for bad in (torch.zeros(1, INVERSE_CDF_FROM), torch.full((1, INVERSE_CDF_FROM), float("nan")), negative):
        with pytest.raises(RuntimeError, match="negative entry, or a total that is zero, infinite or NaN"):
            draw_ids(bad, torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match="not 3 dimensions"):
        draw_ids(large[None], torch.Generator().manual_seed(0))


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


# --------------------------------------------------------------------------- the chain rule's distribution

DRAWS = 200_000  # blocks per test, in one call; a wrong rule below fails by orders of magnitude past 1e-6


def target_and_draft(gamma: int) -> tuple[ToyModel, ToyModel]:
    """Random next-token models over 5 tokens for γ + 1 positions: the target never gives token 4,
    the draft never proposes token 0 (so both the accept test and the residual meet zeros)."""
    return ToyModel(V, gamma + 1, seed=10 + gamma, zero=V - 1), ToyModel(V, gamma + 1, seed=20 + gamma, zero=0)


def chain_sequences(rule, target: ToyModel, draft: ToyModel, gamma: int, proposal: ToyModel | None = None,
                    seed: int = 0) -> torch.Tensor:
    """DRAWS blocks: γ tokens drawn from ``draft``, judged by ``rule`` given q from ``proposal`` (default: the
    draft itself, the right q), and what the block emits completed to γ + 1 tokens from the target: (DRAWS, γ + 1)."""
    g = torch.Generator().manual_seed(seed)
    tokens, q = draft.draft(DRAWS, gamma, g)
    if proposal is not None:
        q = proposal.along(tokens)[:, :gamma]
    accepted, next_token = rule(tokens, q, target.along(tokens), g)
    return target.finish(tokens, accepted, next_token, g)


@pytest.mark.parametrize("gamma", [1, 2, 3])
def test_the_chain_rule_keeps_the_target_distribution(gamma):
    target, draft = target_and_draft(gamma)
    sequences = chain_sequences(verify_sampling_batch, target, draft, gamma)
    assert target.p_value(sequences) > 1e-3


def accept_everything(tokens, q, p, generator):
    """Wrong: every draft token is kept and the bonus drawn, so the output follows the draft."""
    return torch.full((len(tokens),), tokens.shape[1]), draw_rows(p[:, -1], generator)


@pytest.mark.parametrize("wrong", ["accept every draft token", "resample from p after a rejection"])
def test_a_wrong_chain_rule_fails_the_distribution_test(wrong, monkeypatch):
    """The test above can fail: each wrong rule gives p < 1e-6 (about 0 with these draws)."""
    target, draft = target_and_draft(2)
    rule = verify_sampling_batch
    if wrong == "accept every draft token":
        rule = accept_everything
    else:  # p instead of norm(max(0, p − q)): the rejected region is drawn again, too often
        monkeypatch.setattr(verify, "residual_distribution", lambda p, q: p)
    assert target.p_value(chain_sequences(rule, target, draft, 2)) < 1e-6


class Mixture(ToyModel):
    """An ensemble's draft: q_w = Σ_k w_k q_k of member models, mixed by the engine's own :func:`mixture`."""

    def __init__(self, members: list[ToyModel], weights: list[float]):
        self.members, self.weights = members, torch.tensor(weights, dtype=torch.float64)
        self.vocab, self.length = members[0].vocab, members[0].length

    def probs(self, prefixes: torch.Tensor) -> torch.Tensor:
        return mixture(torch.stack([m.probs(prefixes) for m in self.members], dim=-2), self.weights)


def test_an_ensemble_keeps_the_target_distribution_only_when_verified_with_the_mixture():
    """Tokens drawn from the mixture: q = the mixture keeps p; q = one member's (the draft's own q) must fail."""
    target, member = target_and_draft(2)
    ensemble = Mixture([member, ToyModel(V, 3, seed=30)], [0.4, 0.6])
    assert target.p_value(chain_sequences(verify_sampling_batch, target, ensemble, 2)) > 1e-3
    assert target.p_value(chain_sequences(verify_sampling_batch, target, ensemble, 2, proposal=member)) < 1e-6


def test_one_block_is_the_batched_rule_with_one_row():
    """The engine's one-block call draws what the batched rule draws for that block, from the same generator."""
    target, draft = target_and_draft(3)
    g = torch.Generator().manual_seed(5)
    tokens, q = draft.draft(40, 3, g)
    p = target.along(tokens)
    for i in range(40):
        one, batch = torch.Generator().manual_seed(i), torch.Generator().manual_seed(i)
        verdict = verify_sampling(tokens[i], q[i], p[i], one)
        accepted, next_token = verify_sampling_batch(tokens[i:i + 1], q[i:i + 1], p[i:i + 1], batch)
        assert (verdict.accepted, verdict.next_token) == (int(accepted[0]), int(next_token[0]))
        assert torch.equal(one.get_state(), batch.get_state())


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


@pytest.mark.parametrize("vocab", [6, 300, 5000, 20000])
def test_the_nucleus_keeps_what_its_definition_keeps_with_ties_and_beyond_the_first_look(vocab):
    """A token stays when its strictly likelier tokens hold less than top_p (brute force over every token), tied tokens
    together: peaked rows, whose nucleus lies inside the first look, and flat ones over 5,000 ids, whose nucleus
    reaches past it (the whole-row sort); over 20,000 ids, the rows cut at (1 − top_p) / V first (the CPU's
    path for a real vocabulary); rows of many ties (rounded logits) included. Where no tie sits at the edge the result
    is the sort-based rule's, value for value."""
    from mmspec_cli.decoding.sampling import NUCLEUS_LOOK

    generator = torch.Generator().manual_seed(vocab)
    reached_past = False
    for trial in range(12):
        logits = torch.randn(3, vocab, generator=generator, dtype=torch.float64) * (0.3, 1.0, 6.0)[trial % 3]
        if trial % 2:
            logits = logits.round()
        for top_p in (0.05, 0.5, 0.9):
            probs = torch.softmax(logits, dim=-1)
            got = probabilities(logits, SamplingParams(temperature=1.0, top_p=top_p))
            for row in range(3):
                p = probs[row]
                sorted_p = p.sort(descending=True).values
                above = torch.cumsum(sorted_p, 0) - sorted_p
                floor = sorted_p[above < top_p].min() if trial % 2 else None
                keep = torch.tensor([float(p[p > v].sum()) < top_p for v in p.tolist()]) if vocab <= 300 else (
                    p >= sorted_p[int((above < top_p).sum()) - 1])  # 5,000 ids: the sorted prefix, no ties there
                assert torch.equal(got[row] > 0, keep), (trial, top_p, row)
                reached_past |= int(keep.sum()) > NUCLEUS_LOOK
                if floor is None:  # no ties: exactly the sort-based rule's values
                    expected = torch.where(keep, p, torch.zeros_like(p))
                    assert torch.equal(got[row], expected / expected.sum())
    assert reached_past == (vocab > NUCLEUS_LOOK)  # the whole-row sort was reached where a nucleus can pass the look


def test_a_cut_nucleus_floor_is_the_whole_rows_or_none(monkeypatch):
    """Rows of 20,000 ids: the floor read from the probabilities above (1 − top_p) / V is the one the first look or
    the whole-row sort reads, number for number, on peaked, flat and tied rows and where the ids above the cut are
    the nucleus itself; a row whose mass above the cut is within rounding of top_p is left to the whole row."""
    from mmspec_cli.decoding import sampling
    from mmspec_cli.decoding.sampling import cut_nucleus_floor, nucleus_floor

    generator = torch.Generator().manual_seed(11)
    vocab = 20000
    for dtype in (torch.float32, torch.float64):
        for spread in (0.5, 3.0, 8.0, 30.0):
            logits = torch.randn(4, vocab, generator=generator, dtype=dtype) * spread
            logits[1] = logits[1].round()
            probs = torch.softmax(logits, dim=-1)
            for top_p in (0.1, 0.5, 0.9, 0.99):
                cut = cut_nucleus_floor(probs, top_p)
                assert cut is not None
                with monkeypatch.context() as patch:
                    patch.setattr(sampling, "NUCLEUS_CUT_FROM", vocab + 1)  # the first look, or the whole sort
                    whole = nucleus_floor(probs, top_p)
                assert torch.equal(cut, whole), (dtype, spread, top_p)
    peaked = torch.softmax(torch.randn(2, vocab, generator=generator) * 3, dim=-1)
    assert torch.equal(cut_nucleus_floor(peaked, 1e-46), peaked.max(dim=-1, keepdim=True).values)  # 0 in float32
    assert cut_nucleus_floor(peaked[:0], 0.9) is None and nucleus_floor(peaked[:0], 0.9).shape == (0, 1)
    exact = torch.zeros(1, vocab, dtype=torch.float64)
    exact[0, :3] = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)
    assert cut_nucleus_floor(exact, 1 - 1e-9).item() == 0.25  # the whole mass is above the cut, by far more than 1e-9
    assert cut_nucleus_floor(exact, 1 - 2 ** -53) is None  # within rounding of the mass above the cut
    assert cut_nucleus_floor(exact, 0.7).item() == 0.25


@pytest.mark.parametrize("top_k", [None, 3])
def test_rows_without_a_nucleus_leave_the_other_rows_as_they_are(top_k):
    """A row of NaN probabilities (a NaN logit, a +inf one, or every logit -inf) has no nucleus: it comes back NaN, as
    softmax gives it, without an error, and the rows beside it are shaped as they are alone."""
    generator = torch.Generator().manual_seed(5)
    for vocab in (40, 1000, 20000):  # inside the first look, past it, and cut first
        logits = torch.randn(4, vocab, generator=generator, dtype=torch.float64) * 0.2
        logits[1, 7] = float("nan")
        logits[2, 3] = float("inf")
        logits[3] = float("-inf")
        params = SamplingParams(temperature=1.0, top_k=top_k, top_p=0.9)
        got = probabilities(logits, params)
        assert torch.equal(got[0], probabilities(logits[:1], params)[0])
        assert got[1:].isnan().all()


# --------------------------------------------------------------------------- recorded draws of the sampling rules
# The sampling rules draw what they drew before they were written for N blocks at once. ``decoding/verify.py`` runs
# each one-block rule as its batched form with one row. The outputs below were recorded from the one-block rules as
# they were before that change (commit 2a9eb9c), on the same inputs and generator seeds, so a seeded run keeps its
# output across the change; a rule that consumed its generator differently, or decided differently, would change
# some of them.

RECORDED_CASES = 24
RECORDED_V = 7
PARENTS = [-1, -1, 0, 0, 1, 2]  # two children of the root, two of node 0, one each of nodes 1 and 2


def _probs(generator: torch.Generator, *shape: int) -> torch.Tensor:
    logits = torch.randn(*shape, RECORDED_V, generator=generator, dtype=torch.float64) * 1.5
    logits[..., RECORDED_V - 1] = -torch.inf  # a token no distribution gives: zeros in p and q, as top-k leaves them
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
    draft_probs = torch.stack([q_root.expand(3, -1), q_next], dim=1)  # (3, 2, RECORDED_V)
    return torch.stack([first, second], dim=1), draft_probs, _probs(g), _probs(g, 3, 2)


def any_tree_case(i: int):
    """A dynamic tree of :data:`PARENTS` with distinct tokens among siblings, scores and the target's p per row."""
    g = torch.Generator().manual_seed(3000 + i)
    tokens = [int(t) for t in torch.randperm(RECORDED_V - 1, generator=g)[:len(PARENTS)]]
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
    """``rule`` on the inputs of each of the RECORDED_CASES cases, with generator seed i for case i."""
    return [rule(*case(i), torch.Generator().manual_seed(i)) for i in range(RECORDED_CASES)]


def test_the_chain_rule_draws_as_before():
    assert [(v.accepted, v.next_token) for v in verdicts(chain_case, verify_sampling)] == CHAIN


def test_the_width_tree_rule_draws_as_before():
    assert [(v.branch, v.accepted, v.next_token) for v in verdicts(tree_case, verify_tree_sampling)] == TREE


def test_the_dynamic_tree_rule_draws_as_before():
    assert [(tuple(v.rows), v.next_token) for v in verdicts(any_tree_case, verify_any_tree_sampling)] == ANY_TREE


def test_the_repetition_penalty_is_transformers_own():
    """``penalize_repeats`` over the context's ids and ``branch_repeats`` gives, row by row, what
    ``RepetitionPenaltyLogitsProcessor`` gives for that row's whole sequence: a chain and a tree, whose branches
    repeat a context token and one of their own (CTRL §4.1); the logits given are left as they were."""
    from transformers import RepetitionPenaltyLogitsProcessor

    from mmspec_cli.decoding.sampling import branch_repeats, penalize_repeats

    torch.manual_seed(0)
    vocab, context = 12, [3, 5, 5, 9]
    seen = dict.fromkeys(context)
    for tokens, parents in (([0, 1, 5, 7], [-1, 0, 1, 2]), ([0, 2, 8, 1, 4], [-1, 0, 0, 1, 2]),
                            ([9, 1, 1, 3, 6, 1], [-1, 0, 1, 2, 0, 4])):
        logits = torch.randn(len(tokens), vocab, dtype=torch.float64) * 3
        given = logits.clone()
        rows, ids = branch_repeats(tokens, parents, seen)
        ours = penalize_repeats(logits, torch.tensor(list(seen)), rows, ids, 1.7)
        assert torch.equal(logits, given)
        for row in range(len(tokens)):
            path, node = [], row
            while node > 0:
                path.insert(0, tokens[node])
                node = parents[node]
            ids = torch.tensor([context + path])
            theirs = RepetitionPenaltyLogitsProcessor(1.7)(ids, logits[row:row + 1].clone())
            assert torch.equal(ours[row], theirs[0])


def test_a_branch_adds_each_repeated_token_once_and_none_of_the_context():
    from mmspec_cli.decoding.sampling import branch_repeats

    rows, ids = branch_repeats([0, 4, 4, 2, 4], [-1, 0, 1, 2, 0], {2, 7})
    assert list(zip(rows, ids)) == [(1, 4), (2, 4), (3, 4), (4, 4)]  # 2 is the context's; 4 counted once a row
