"""Under sampling, speculative decoding must leave the target's output distribution unchanged.

The rules themselves are tested on their pure functions with 200,000 blocks at once, each beside
deliberately wrong rules that fail (``test_verify.py``, ``test_tree_verify.py``, ``test_dynamic_trees.py``).
Here, and in one engine-level test per decoding path (ensemble, width tree, dynamic tree, draft head,
ssd), the whole engine runs: on the tiny target with top-k = 4 (at most 16 outcomes for two tokens),
the first two generated tokens of seeded runs are compared with the target's exact distribution
p(x1)·p(x2 | x1) (the ``joint`` fixture) by a chi-square test. Those tests catch wiring mistakes: a
p or q handed to the rule from the wrong position, from the wrong model, or shaped differently.
"""

from __future__ import annotations

from mmspec_cli.decoding.engine import SpeculativeDecoder
from mmspec_cli.decoding.sampling import SamplingParams
from mmspec_cli.drafters import build_drafter
from tests import tiny
from tests.distributions import ENGINE_RUNS, PARAMS, QUESTION, chi_square_p_value, exact_joint, sampled_pairs


def test_sampled_pairs_follow_the_target_distribution(tiny_models, joint):
    """A single drafter (t, whose draft is right about half the time), chains of γ = 2: ENGINE_RUNS runs.

    What it can detect (measured when it was written, same seeds): handing the rule the draft's q rows in
    reverse order gives p ≈ 9e-23; the target's p rows shifted by one, or accepting every draft token, p ≈ 0."""
    target = tiny_models["target"]
    decoder = SpeculativeDecoder(target, build_drafter("t", target, tiny_models["perturbed"]), gamma=2,
                                 max_new_tokens=3, sampling=PARAMS)
    counts, turns = sampled_pairs(decoder, ENGINE_RUNS)
    first_blocks = [turn.blocks[0] for turn in turns]
    assert {b.accepted for b in first_blocks} == {0, 1, 2}  # rejections at each position, and full accepts
    assert chi_square_p_value(counts, joint, ENGINE_RUNS) > 1e-3


def test_seeded_sampling_is_reproducible(tiny_models):
    target = tiny_models["target"]
    decoder = SpeculativeDecoder(target, build_drafter("m", target, tiny_models["perturbed"]), gamma=3,
                                 max_new_tokens=12, sampling=SamplingParams(temperature=0.8, top_p=0.9), seed=42)
    first = decoder.generate(tiny.images(1), [QUESTION]).turns[0].token_ids
    second = decoder.generate(tiny.images(1), [QUESTION]).turns[0].token_ids
    decoder.seed = 43
    third = decoder.generate(tiny.images(1), [QUESTION]).turns[0].token_ids
    assert first == second
    assert len(first) == 12 and first != third


def test_sampling_under_the_targets_repetition_penalty_keeps_its_distribution(tiny_models):
    """The target's generation_config asks for a repetition penalty (3.0, to matter on 16 outcomes): the first two
    tokens follow its exact distribution under transformers' own RepetitionPenaltyLogitsProcessor. Measured when
    written: with the penalty left out of verification, p = 0 (an outcome it makes impossible is drawn)."""
    target = tiny_models["target"]
    decoder = SpeculativeDecoder(target, build_drafter("m", target, tiny_models["perturbed"]), gamma=2,
                                 max_new_tokens=3, sampling=PARAMS, repetition_penalty=3.0)
    counts, _ = sampled_pairs(decoder, ENGINE_RUNS)
    expected = exact_joint(target, repetition_penalty=3.0)
    assert expected != exact_joint(target)  # the penalty changes the distribution
    assert chi_square_p_value(counts, expected, ENGINE_RUNS) > 1e-3
