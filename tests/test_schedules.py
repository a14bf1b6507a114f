"""Draft-length schedules: the pure rules, and losslessness of the engine under each of them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests import tiny
from mmspec_cli.drafters import build_drafter
from mmspec_cli.decoding.engine import SpeculativeDecoder
from mmspec_cli.errors import InputError, ProfileError
from mmspec_cli.models.profiles import profile_from_dict
from mmspec_cli.models.prompts import process, render_prompt
from mmspec_cli.decoding.schedules import (AcceptanceEstimate, GammaSchedule, StepCosts, best_gamma, block_ms,
                                           OPENING_BLOCKS, block_prices, expected_tokens, fastvlm_length, heuristic_next,
                                           nondecreasing, sigmoid)

from tests.helpers import MAX_NEW, QUESTION, reference


def test_heuristic_grows_by_two_after_a_full_accept_and_shrinks_by_one_otherwise():
    assert heuristic_next(3, drafted=3, accepted=3, gamma_max=8) == 5
    assert heuristic_next(3, drafted=3, accepted=2, gamma_max=8) == 2
    assert heuristic_next(7, drafted=7, accepted=7, gamma_max=8) == 8  # capped at γ_max
    assert heuristic_next(1, drafted=1, accepted=0, gamma_max=8) == 1  # never below 1
    assert heuristic_next(4, drafted=0, accepted=0, gamma_max=8) == 4  # nothing drafted: unchanged


def test_fastvlm_eq5_values():
    # FastVLM Eq. (5) with d(0) = 5 and N = 4096: 5 far below N/2, 5 + ⌊10·0.5⌋ = 10 at N/2, 15 far above.
    assert fastvlm_length(5, 0, 4096) == 5
    assert fastvlm_length(5, 2048, 4096) == 10
    assert fastvlm_length(5, 2048 + 100, 4096) == 5 + 7  # ⌊10·σ(1)⌋ = ⌊7.31⌋
    assert fastvlm_length(5, 10**6, 4096) == 15
    assert fastvlm_length(5, 10**6, 10**9) == 5  # no overflow far below N/2
    assert sigmoid(-1000) == 0.0 and sigmoid(1000) == 1.0
    lengths = [fastvlm_length(5, t, 4096) for t in range(0, 8000, 50)]
    assert lengths == sorted(lengths) and set(lengths) <= set(range(5, 16))


def test_schedule_state_per_turn():
    schedule = GammaSchedule("heuristic", 4)
    assert schedule.length(10) == 4
    schedule.update(drafted=4, accepted=1)
    assert schedule.length(10) == 3
    schedule.update(drafted=3, accepted=3)
    assert schedule.length(10) == 4  # +2 capped at γ = 4
    assert GammaSchedule("constant", 4).length(10**6) == 4
    assert GammaSchedule("fastvlm", 4, max_length=100).length(50) == 9


def test_unknown_schedule_is_refused():
    with pytest.raises(InputError, match="unknown gamma schedule 'cosine'"):
        GammaSchedule("cosine", 3)
    with pytest.raises(ProfileError, match="decoding.gamma_schedule: expected one of constant, heuristic, fastvlm"):
        profile_from_dict({"target": {"model": "x"}, "decoding": {"gamma_schedule": "cosine"}})


@pytest.mark.parametrize("schedule", ["constant", "heuristic", "fastvlm"])
@pytest.mark.parametrize("drafter, draft", [("m", "perturbed"), ("m", "same"), ("tabed", "perturbed")])
def test_greedy_output_is_the_targets_under_every_schedule(tiny_models, schedule, drafter, draft):
    target = tiny_models["target"]
    ref = reference(target, [QUESTION], [], 1)
    decoder = SpeculativeDecoder(target, build_drafter(drafter, target, tiny_models[draft]), gamma=3,
                                 max_new_tokens=MAX_NEW, gamma_schedule=schedule)
    turn = decoder.generate(tiny.images(1), [QUESTION]).turns[0]
    assert turn.token_ids == ref
    drafted = [len(b.draft) for b in turn.blocks]
    if schedule == "heuristic" and draft == "same":
        assert drafted[:3] == [3, 3, 3]  # full accepts keep γ at its cap
    if schedule == "heuristic" and draft == "perturbed":
        assert min(drafted[:-1]) < 3  # partial accepts shrank γ
    if schedule == "fastvlm":  # tiny N = 1024: t ≈ 30 tokens is far below N/2, so d(t) = γ + ⌊10·σ(−4.8)⌋ = γ
        assert max(drafted) == 3


def test_fastvlm_schedule_grows_with_the_context(tiny_models, monkeypatch):
    """With a small N the sigmoid is near 0.5 at the prompt's length: blocks draft γ + 4 or γ + 5 tokens."""
    from mmspec_cli.decoding import engine

    monkeypatch.setattr(engine, "max_sequence_length", lambda config: 60)
    target = tiny_models["target"]
    decoder = SpeculativeDecoder(target, build_drafter("m", target, tiny_models["same"]), gamma=2,
                                 max_new_tokens=MAX_NEW, gamma_schedule="fastvlm")
    turn = decoder.generate(tiny.images(1), [QUESTION]).turns[0]
    assert turn.token_ids == reference(target, [QUESTION], [], 1)
    prompt_len = len(process(target.processor, render_prompt(target.processor, [QUESTION], [], 1), tiny.images(1)).ids)
    assert len(turn.blocks[0].draft) == fastvlm_length(2, prompt_len, 60) > 2


# --------------------------------------------------------------------------- cost: γ from measured step costs

#: T_verify(S = 64, n) = 10 + 2·(n − 1) ms for n = 1..9 and one draft step of 1 ms: a block of γ costs 3γ + 10 ms.
LINEAR = StepCosts({(64, n): 10.0 + 2 * (n - 1) for n in range(1, 10)}, {64: 1.0})


def test_expected_tokens_is_leviathans_eq1():
    assert expected_tokens(0.0, 5) == 1.0  # the target's own token
    assert expected_tokens(1.0, 5) == 6.0  # γ + 1 at α = 1
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens(0.8, 3) == pytest.approx((1 - 0.8 ** 4) / 0.2)


def test_best_gamma_maximises_expected_tokens_per_ms_on_a_hand_made_table():
    # α = 0.8: E[τ] / (3γ + 10) = 2.44/16 = 0.1525 (γ 2), 2.952/19 = 0.1554 (γ 3), 3.3616/22 = 0.1528 (γ 4)
    assert block_ms(LINEAR, 64, 3) == 3 * 1.0 + 16.0
    assert best_gamma(LINEAR, 64, 0.8) == 3
    assert best_gamma(LINEAR, 64, 0.5) == 1
    assert best_gamma(LINEAR, 64, 0.9) == 5
    assert best_gamma(LINEAR, 64, 0.0) == 1  # nothing is accepted: the cheapest block
    free = StepCosts({(64, 1): 10.0, (64, 9): 10.0})  # no draft model (oracle, pld); verification flat in n
    assert free.gamma_max == 8 and best_gamma(free, 64, 0.3) == 8  # more tokens for the same cost
    priced_as_one_step = StepCosts({(64, n): 10.0 * n for n in range(1, 10)})  # verifying n tokens costs n steps
    assert best_gamma(priced_as_one_step, 64, 1.0) == 1  # every γ gives 0.1 tokens per ms: the shorter draft wins


def test_a_chain_drafted_in_one_compiled_graph_is_priced_as_measured_not_as_gamma_steps():
    """--compile drafts a greedy chain in ONE graph after its catch-up step: T_draft(γ) = T_step + T_chain(γ), which
    costs less than γ steps called one by one; priced that way the same acceptance buys a longer draft."""
    steps = StepCosts(LINEAR.verify_ms, {64: 1.0})  # 1 ms a step: γ steps cost γ ms
    chained = StepCosts(LINEAR.verify_ms, {64: 1.0}, {(64, 2): 0.4, (64, 4): 0.8, (64, 6): 1.2})
    assert steps.drafting(64, 4) == 4.0
    assert chained.drafting(64, 1) == 1.0 and chained.drafting(64, 0) == steps.drafting(64, 0) == 0.0  # γ = 0: none
    assert chained.drafting(64, 4) == pytest.approx(1.0 + 0.8) and chained.drafting(64, 3) == pytest.approx(1.6)
    assert block_ms(chained, 64, 4) == pytest.approx(1.8 + LINEAR.verify(64, 5))
    # a chain that feeds the catch-up itself (a draft model's lead) is the block's whole drafting from γ = 2 on
    leading = StepCosts(LINEAR.verify_ms, {64: 1.0}, {(64, 2): 0.4, (64, 4): 0.8, (64, 6): 1.2}, chain_leads=True)
    assert leading.drafting(64, 1) == 1.0 and leading.drafting(64, 4) == pytest.approx(0.8)
    assert leading.prices(64)[4] == pytest.approx(0.8 + LINEAR.verify(64, 5))
    assert best_gamma(steps, 64, 0.85) < best_gamma(chained, 64, 0.85)


def test_measured_costs_are_made_nondecreasing_in_tokens_before_they_are_priced():
    """Pool-adjacent violators: a timing's noise where more tokens cost less is pooled to its mean, so a longer draft
    never looks free; what rises already is kept as measured."""
    fitted = nondecreasing([(1, 1.3), (2, 1.3), (3, 1.5), (4, 1.4), (5, 2.0)])
    assert [x for x, _ in fitted] == [1, 2, 3, 4, 5] and [y for _, y in fitted] == pytest.approx([1.3, 1.3, 1.45, 1.45, 2.0])
    assert nondecreasing([(1, 3.0), (2, 2.0), (3, 1.0)]) == [(1, 2.0), (2, 2.0), (3, 2.0)]
    cascade = nondecreasing([(1, 2.0), (2, 3.0), (3, 0.0)])  # pooling 3 and 0 falls below 2: pooled again
    assert [y for _, y in cascade] == pytest.approx([5 / 3] * 3) and nondecreasing([(4, 1.0)]) == [(4, 1.0)]
    noisy = StepCosts({(64, 1): 10.0, (64, 5): 12.0, (64, 6): 11.0})  # 6 tokens timed below 5
    assert noisy.verify(64, 6) == noisy.verify(64, 5) == 11.5
    assert StepCosts({(64, 1): 10.0}, {64: 1.0}, {(64, 3): 2.0, (64, 4): 1.0}).drafting(64, 3) == 2.5


def test_a_blocks_prices_over_every_gamma_are_its_drafting_plus_verification_at_any_context():
    """``StepCosts.prices`` (one blend of vectors computed at the measured S, what the schedule reads each block) is
    block_ms at every γ, between, on and outside the measured S, with noisy curves pooled at each S."""
    costs = StepCosts({(100, 1): 10.0, (100, 4): 13.0, (100, 5): 12.0, (300, 1): 20.0, (300, 5): 26.0},
                      {100: 1.0, 250: 2.0}, {(100, 2): 0.5, (100, 4): 0.4, (300, 2): 1.0, (300, 4): 1.6})
    for seq in (50, 100, 160, 250, 280, 300, 900):
        assert costs.prices(seq) == pytest.approx([block_ms(costs, seq, g) for g in range(costs.gamma_max + 1)])
        assert block_prices(costs, seq, 2) == pytest.approx([block_ms(costs, seq, g) for g in range(3)])
    assert costs.verify(100, 5) == costs.verify(100, 4) == 12.5  # pooled at S = 100
    # between measured S: the blend of the curves pooled at each (pooling at S = 200 itself would give 21 at n = 5)
    ragged = StepCosts({(100, 1): 10.0, (100, 5): 12.0, (100, 6): 11.0, (300, 1): 20.0, (300, 5): 30.0, (300, 6): 40.0})
    assert ragged.verify(200, 5) == pytest.approx((11.5 + 30.0) / 2)
    assert costs.drafting(100, 3) == pytest.approx(1.0 + 0.45)  # the chain pooled at S = 100 (0.5, 0.4)
    assert costs.drafting(300, 3) == pytest.approx(2.0 + 1.3)  # the step held flat past S = 250


def test_step_costs_interpolate_in_s_and_n_and_never_extrapolate():
    costs = StepCosts({(100, 1): 10.0, (100, 3): 14.0, (300, 1): 20.0, (300, 3): 24.0}, {100: 1.0, 300: 3.0})
    assert costs.verify(200, 2) == pytest.approx(17.0)  # halfway in S (15, 19), then in n
    assert costs.verify(100, 3) == 14.0  # a measured point as measured
    assert costs.verify(10, 1) == 10.0 and costs.verify(5000, 3) == 24.0  # outside the S measured: the nearest end
    assert costs.verify(100, 7) == 14.0  # past the largest n measured: held, never extrapolated
    assert costs.draft(200) == pytest.approx(2.0) and costs.draft(5000) == 3.0
    assert costs.gamma_max == 2  # verifying γ + 1 = 3 tokens is the most measured
    assert StepCosts({(100, 1): 10.0}).draft(100) == 0.0 and StepCosts({(100, 1): 10.0}).gamma_max == 1


def test_acceptance_is_the_geometric_mle_over_the_turns_blocks():
    estimate = AcceptanceEstimate()
    assert estimate.alpha is None  # no evidence yet
    estimate.add(drafted=5, accepted=5)  # accepted in full: 5 successes, no failure seen
    assert estimate.alpha == 1.0
    estimate.add(drafted=5, accepted=2)  # 2 successes, then a rejection
    estimate.add(drafted=3, accepted=0)
    estimate.add(drafted=0, accepted=0)  # a block cut to no draft says nothing
    assert estimate.alpha == pytest.approx(7 / 9)


def test_the_turns_blocks_give_the_expected_tokens_with_acceptance_in_runs():
    """Half the blocks accept all their drafts, half none: E[τ(γ)] is what those blocks would have kept at γ (a full
    block's tail beyond what it drafted from the geometric α̂), where the i.i.d. model spreads α̂ over every
    position and so undervalues long drafts."""
    estimate = AcceptanceEstimate()
    for _ in range(3):
        estimate.add(drafted=6, accepted=6)
        estimate.add(drafted=6, accepted=0)
    alpha = estimate.alpha  # 18 / 21
    assert estimate.expected(2) == pytest.approx(1 + 0.5 * 2)
    assert estimate.expected(6) == pytest.approx(1 + 0.5 * 6)
    assert estimate.expected(8) == pytest.approx(1 + 0.5 * (6 + alpha + alpha ** 2))
    # longer drafts gain more than the i.i.d. model says
    assert estimate.expected(6) / estimate.expected(2) > expected_tokens(alpha, 6) / expected_tokens(alpha, 2)
    # the shape changes the choice: drafting nearly free, verification linear in its tokens
    cheap = StepCosts({(64, n): 10.0 + 2.0 * n for n in range(1, 10)}, {64: 0.5})
    assert best_gamma(cheap, 64, alpha, gamma_max=6, expected=estimate.expected) == 6
    assert best_gamma(cheap, 64, alpha, gamma_max=6) == 5
    assert AcceptanceEstimate().expected(3) == 1.0


def test_a_short_draft_kept_in_full_says_nothing_of_the_depths_it_did_not_draft():
    """Kaplan–Meier: blocks that drafted 3 and kept all 3 are censored at 3; depths 4-8 are answered by the block that
    drafted 8 and kept them (acceptance in runs), not by the pooled α̂ (which the long rejected block pulls down)."""
    estimate = AcceptanceEstimate()
    estimate.add(drafted=8, accepted=8)
    estimate.add(drafted=8, accepted=0)
    for _ in range(4):
        estimate.add(drafted=3, accepted=3)
    assert estimate.survival(8) == pytest.approx([5 / 6] * 8)  # depth 1: 1 of 6 stopped; after it none of 5 or 1
    assert estimate.expected(6) == pytest.approx(1 + 6 * 5 / 6)
    tail = sum(estimate.alpha ** k for k in range(1, 4))  # a geometric tail after each short block instead
    assert estimate.expected(6) > 1 + (6 + 0 + 4 * (3 + tail)) / 6
    estimate.add(drafted=2, accepted=1)  # a rejection at depth 2: S(2..) falls by 1/6 of those that reached it
    assert estimate.survival(3) == pytest.approx([6 / 7, 6 / 7 * 5 / 6, 6 / 7 * 5 / 6])


def test_cost_schedule_drafts_gamma_first_then_the_best_length_and_is_constant_without_costs():
    schedule = GammaSchedule("cost", 4, costs=LINEAR)
    assert schedule.length(64) == 4  # no evidence yet: the profile's γ
    assert OPENING_BLOCKS == 3
    schedule.update(drafted=4, accepted=4)
    schedule.update(drafted=4, accepted=0)
    assert schedule.length(64) == 4  # two blocks: still the profile's γ
    schedule.update(drafted=4, accepted=4)  # α̂ = 8 / 9
    assert schedule.length(64) == best_gamma(LINEAR, 64, 8 / 9, expected=schedule.acceptance.expected) != 4
    without = GammaSchedule("cost", 4)
    without.update(drafted=4, accepted=0)
    assert without.length(64) == 4


def test_a_blocks_overhead_beyond_its_price_favours_longer_drafts():
    """O, what blocks took beyond their forwards' price, is a fixed cost per block: at α = 0.8 on LINEAR, γ = 3 with
    none (test above), longer with 10 ms; the turn's first block (the prompt's prefill) is left out of O."""
    assert best_gamma(LINEAR, 64, 0.8, overhead_ms=10.0) == 5
    for alpha in (0.5, 0.8, 0.9):  # an O that outweighs every price: each held at 1% of its own, as at O = 0
        assert best_gamma(LINEAR, 64, alpha, overhead_ms=-1000.0) == best_gamma(LINEAR, 64, alpha) < LINEAR.gamma_max
    schedule = GammaSchedule("cost", 4, costs=LINEAR)
    schedule.update(drafted=4, accepted=4, measured_ms=500.0, context=64)  # the first block: the prefill's
    assert schedule.overhead.ms == 0.0
    schedule.update(drafted=4, accepted=0, measured_ms=block_ms(LINEAR, 64, 4) + 10.0, context=64)
    schedule.update(drafted=3, accepted=1, measured_ms=block_ms(LINEAR, 64, 3) + 20.0, context=64)
    assert schedule.overhead.ms == pytest.approx(15.0)
    assert schedule.length(64) == best_gamma(LINEAR, 64, schedule.acceptance.alpha,
                                             expected=schedule.acceptance.expected, overhead_ms=15.0)
    assert schedule.length(64) > best_gamma(LINEAR, 64, schedule.acceptance.alpha,
                                            expected=schedule.acceptance.expected)


@pytest.mark.parametrize("drafter", ["m", "tabed"])
def test_greedy_output_is_the_targets_under_the_cost_schedule(tiny_models, drafter):
    """Verification priced at 10 ms per token makes γ = 1 the best after the opening blocks (E[τ(γ)] / E[τ(1)] is at
    most (1 + γ) / 2, less than the prices' ratio (10.5γ + 10) / 20.5, whatever the acceptance): the blocks then draft
    1 token, and the tokens are still the target's."""
    target = tiny_models["target"]
    steep = StepCosts({(s, n): 10.0 * n for s in (16, 256) for n in range(1, 8)}, {16: 0.5, 256: 0.5})
    decoder = SpeculativeDecoder(target, build_drafter(drafter, target, tiny_models["perturbed"]), gamma=4,
                                 max_new_tokens=MAX_NEW, gamma_schedule="cost", step_costs=steep)
    turn = decoder.generate(tiny.images(1), [QUESTION]).turns[0]
    assert turn.token_ids == reference(target, [QUESTION], [], 1)
    drafted = [len(b.draft) for b in turn.blocks]
    opening, chosen = drafted[:OPENING_BLOCKS], drafted[OPENING_BLOCKS:]
    assert opening == [4] * OPENING_BLOCKS and 1 in chosen and set(chosen) <= {0, 1}  # 0: the last block, cut
    if drafter == "m":  # a tree's verification is not the chain's γ + 1 tokens the costs price: the constant γ
        tree = SpeculativeDecoder(target, build_drafter(drafter, target, tiny_models["perturbed"]), gamma=4,
                                  max_new_tokens=MAX_NEW, gamma_schedule="cost", step_costs=steep, tree_width=2)
        blocks = tree.generate(tiny.images(1), [QUESTION]).turns[0].blocks
        shown = OPENING_BLOCKS + 2
        assert [len(b.tree[0]) for b in blocks[:shown]] == [4] * shown  # (the costs would make the fourth block's 1)


def test_a_drafter_is_priced_by_the_step_its_plan_declares_and_nothing_else():
    """bench/latency.own_step, the one pricing switch behind Eq. (1) (bench, profile-latency) and the cost schedule:
    each drafter's step as its plan declares it; a plan whose step disagrees with how it drafts, or a step the
    switch does not know, is an error instead of another step's price."""
    import types

    from mmspec_cli.bench.latency import LatencyResult, own_step
    from mmspec_cli.drafters.registry import DRAFT_STEPS, DRAFTER_KINDS, DrafterPlan, WHOLE_NAMES, parse_drafter

    result = LatencyResult("cpu", "target", "draft", target_ms={"64,3": 14.0}, draft_ms={"1,64": 1.0, "2,64": 1.5},
                           head_ms={"eagle": {"64": 0.25}, "eagle3": {"64": 0.3}}, ssd_ms={"ssd:plain": {"64": 4.0}},
                           ssd={"layer": 2, "imitation": None})
    expected = {"m": 1.0, "t": 1.0, "mt": 1.5, "tabed": 1.5, "tabed:mtc": None, "eagle": 0.25, "eagle3": 0.3,
                "vispec": None, "ssd:plain": 4.0, "ssd": None, "pld": None, "oracle": None, "ar": None}
    assert set(WHOLE_NAMES) <= set(expected)
    for name, ms in expected.items():
        plan = parse_drafter(name)
        assert plan.kind in DRAFTER_KINDS and plan.step in (None, *DRAFT_STEPS)
        assert plan.model_drafts == (plan.step is not None)
        step = own_step(result, plan, ssd_layer=2)
        assert (step.per_seq[64] if step else None) == ms, name
    assert own_step(result, parse_drafter("m"), rows=2).ratio == {"batch": 2}  # a bench record's own rows
    with pytest.raises(ValueError, match="which is no kind of registry.DRAFTER_KINDS; add it there with the draft "
                                         "step it is priced by"):
        DrafterPlan("new", "layer skip")  # a kind nobody said how to price
    with pytest.raises(ValueError, match="a head drafter has no members"):
        DrafterPlan("new", "head", ("m",))
    with pytest.raises(ValueError, match="does not price"):
        own_step(result, types.SimpleNamespace(name="new", step="verifier", members=()))


def test_step_costs_take_each_drafters_own_step_from_a_cached_latency_result():
    from mmspec_cli.bench.latency import LatencyResult, step_costs

    result = LatencyResult("cpu", "target", "draft", target_ms={"64,1": 10.0, "64,3": 14.0},
                           draft_ms={"1,64": 1.0, "2,64": 1.5}, head_ms={"eagle": {"64": 0.25}},
                           ssd_ms={"ssd:plain": {"64": 4.0}}, ssd={"layer": 2, "imitation": None})
    verify = {(64, 1): 10.0, (64, 3): 14.0}
    assert step_costs(result, "m") == StepCosts(verify, {64: 1.0})  # one draft row
    assert step_costs(result, "mt").draft(64) == step_costs(result, "tabed").draft(64) == 1.5  # two rows
    assert step_costs(result, "tabed:mtp") is None  # three rows were not timed
    assert step_costs(result, "eagle").draft(64) == 0.25 and step_costs(result, "vispec") is None
    assert step_costs(result, "ssd:plain", ssd_layer=2).draft(64) == 4.0
    assert step_costs(result, "ssd:plain", ssd_layer=3) is None  # timed at another layer
    assert step_costs(result, "oracle") == step_costs(result, "pld") == StepCosts(verify)  # no model drafts
    assert step_costs(result, "ar") is None  # drafts nothing
    compiled = dataclasses.replace(result, compiled=True, draft_chain_ms={"1,64,2": 0.5, "2,64,2": 0.75},
                                   head_chain_ms={"eagle": {"64,2": 0.2}})
    assert step_costs(compiled, "m").chain_ms == {(64, 2): 0.5} and step_costs(compiled, "mt").chain_ms == {(64, 2): 0.75}
    assert step_costs(compiled, "eagle").chain_ms == {(64, 2): 0.2}
    assert step_costs(compiled, "ssd:plain", ssd_layer=2).chain_ms == {}  # its steps are called one by one
    assert step_costs(compiled, "m", greedy=False).chain_ms == {}  # a sampled chain is drafted step by step
    # a cache from before the draft model's chains fed their catch-up: step then chain, as they ran then
    assert not step_costs(compiled, "m").chain_leads and step_costs(compiled, "m").drafting(64, 2) == 1.5
    leading = dataclasses.replace(compiled, draft_chains_lead=True)  # profile-latency's chains now
    assert step_costs(leading, "m").drafting(64, 2) == 0.5 and step_costs(leading, "tabed").drafting(64, 2) == 0.75
    assert step_costs(leading, "eagle").drafting(64, 2) == pytest.approx(0.25 + 0.2)  # a head's catch-up: its own


def test_cost_schedule_without_cached_costs_says_what_to_run(tmp_path, monkeypatch, tiny_dirs):
    from mmspec_cli.bench import latency

    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path / "cache"))
    spec = profile_from_dict({"target": {"model": tiny_dirs["target"]}, "draft": {"model": tiny_dirs["perturbed"]},
                              "decoding": {"gamma_schedule": "cost", "compile": True}},
                             "tiny", str(tmp_path / "t.yaml"))
    costs, note = latency.run_step_costs(spec, ["ar", "m", "eagle"], "cpu", threads=2)
    here = latency.device_name("cpu")
    assert costs == {} and note == (
        f"note: --gamma-schedule cost has no step costs measured on this machine ({here}) for this profile and "
        f"drafters m, eagle; they use the constant γ = 5 (run mmspec profile-latency --profile {tmp_path / 't.yaml'} "
        f"--threads 2 --compile first)")
    latency.save(latency.LatencyResult(here, tiny_dirs["target"], tiny_dirs["perturbed"], {"64,1": 10.0, "64,3": 11.0},
                                       {"1,64": 1.0}, compiled=True))
    costs, note = latency.run_step_costs(spec, ["ar", "m", "eagle"], "cpu")
    assert set(costs) == {"m"} and "for this profile and drafter eagle; it uses the constant γ = 5, and " in note
    assert "hold no compiled chains" in note and note.count("\n") == 0  # both in one line
    stale = latency.run_step_costs(spec, ["ar", "m"], "cpu")  # a cache from before compiled chains were timed
    assert stale[0] == {"m": costs["m"]} and stale[1] == (
        f"note: the step costs cached on this machine ({here}) hold no compiled chains (timed since this release); "
        f"--gamma-schedule cost prices the drafting of m as γ single steps, which drafts shorter than it should (run "
        f"mmspec profile-latency --profile {tmp_path / 't.yaml'} --threads {torch.get_num_threads()} --compile again)")
    latency.save(latency.LatencyResult(here, tiny_dirs["target"], tiny_dirs["perturbed"], {"64,1": 10.0, "64,3": 11.0},
                                       {"1,64": 1.0}, compiled=True, draft_chain_ms={"1,64,2": 1.5}))
    chained = latency.run_step_costs(spec, ["ar", "m"], "cpu")
    assert chained[1] is None and chained[0]["m"].drafting(64, 2) == 2.5
    sampled = dataclasses.replace(spec, decoding=dataclasses.replace(spec.decoding, temperature=1.0))
    assert latency.run_step_costs(sampled, ["m"], "cpu")[0]["m"].chain_ms == {}  # sampled chains: step by step
    latency.save(latency.LatencyResult(here, tiny_dirs["target"], tiny_dirs["perturbed"], {"64,1": 10.0, "64,2": 11.0},
                                       {"1,64": 1.0}, compiled=True))
    assert latency.run_step_costs(spec, ["m"], "cpu")[1] is None  # n ≤ 2 times no chain: rerunning would not either
    constant = dataclasses.replace(spec, decoding=dataclasses.replace(spec.decoding, gamma_schedule="constant"))
    assert latency.run_step_costs(constant, ["m"], "cpu") == ({}, None)  # another schedule: nothing looked up
    width = dataclasses.replace(spec, decoding=dataclasses.replace(spec.decoding, tree="width", tree_width=2))
    assert latency.run_step_costs(width, ["m"], "cpu") == (
        {}, "note: --gamma-schedule cost prices chains, not a width tree; it uses the constant γ = 5")
