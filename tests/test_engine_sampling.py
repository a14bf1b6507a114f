"""Under sampling, speculative decoding must leave the target's output distribution unchanged.

On the tiny target with top-k = 4 (at most 16 outcomes for two tokens), the empirical
distribution of the first two generated tokens over a few thousand seeded runs is compared
with the target's exact distribution p(x1)·p(x2 | x1) by a chi-square test. The same test
with a deliberately wrong verification rule must fail: that is the proof it can.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from mmspec_cli.decoding import step as step_module
from tests import tiny
from mmspec_cli.drafters import build_drafter
from mmspec_cli.decoding.engine import SpeculativeDecoder
from mmspec_cli.models.prompts import process, render_prompt
from mmspec_cli.decoding.sampling import SamplingParams, probabilities
from mmspec_cli.decoding.verify import Verdict

PARAMS = SamplingParams(temperature=1.0, top_k=4)
QUESTION = "what is in the image?"
RUNS = 1500  # enough for the wrong rules below to fail by orders of magnitude (p < 1e-6)


def exact_joint(target, n_images=1):
    """{(x1, x2): p} for the target's first two sampled tokens."""
    text = render_prompt(target.processor, [QUESTION], [], n_images)
    prompt = process(target.processor, text, tiny.images(n_images))
    vision = {k: v.to(target.model.dtype) if v.is_floating_point() else v for k, v in prompt.vision.items()}
    with torch.no_grad():
        def next_probs(ids):
            out = target.model(input_ids=torch.tensor([ids]), **vision)
            return probabilities(out.logits[0, -1], PARAMS)

        p1 = next_probs(prompt.ids)
        return {(a, b): float(p1[a] * p2)
                for a in torch.nonzero(p1).flatten().tolist()
                for b, p2 in enumerate(next_probs(prompt.ids + [a])) if p2 > 0}


def chi_square_p_value(counts: Counter, expected: dict, n: int) -> float:
    """Pearson's test; outcomes with expected count < 5 are pooled into one cell."""
    stat, pooled_obs, pooled_exp, cells = 0.0, 0.0, 0.0, 0
    for outcome, p in expected.items():
        e = p * n
        if e < 5:
            pooled_obs, pooled_exp = pooled_obs + counts.get(outcome, 0), pooled_exp + e
        else:
            stat += (counts.get(outcome, 0) - e) ** 2 / e
            cells += 1
    stray = sum(c for o, c in counts.items() if o not in expected)  # impossible outcomes observed
    pooled_obs += stray
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        cells += 1
    elif stray:
        return 0.0
    dof = torch.tensor((cells - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, torch.tensor(stat / 2, dtype=torch.float64)))


def sample_pairs(models, drafter, draft):
    target = models["target"]
    decoder = SpeculativeDecoder(target, build_drafter(drafter, target, models[draft]), gamma=2, max_new_tokens=3,
                                 sampling=PARAMS)
    counts: Counter = Counter()
    for seed in range(RUNS):
        decoder.seed = seed
        ids = decoder.generate(tiny.images(1), [QUESTION]).turns[0].token_ids
        counts[tuple(ids[:2])] += 1
    return counts


@pytest.fixture(scope="module")
def joint(tiny_models):
    return exact_joint(tiny_models["target"])


@pytest.mark.parametrize("drafter, draft", [("m", "random"), ("t", "perturbed")])
def test_sampled_pairs_follow_the_target_distribution(tiny_models, joint, drafter, draft):
    counts = sample_pairs(tiny_models, drafter, draft)
    assert chi_square_p_value(counts, joint, RUNS) > 1e-3


def test_the_distribution_test_catches_a_wrong_rule(tiny_models, joint, monkeypatch):
    """Accept every draft token: the output then follows the draft, and the test must say so."""
    monkeypatch.setattr(step_module, "verify_sampling",
                        lambda tokens, q, p, g: Verdict(len(tokens), int(torch.multinomial(p[-1].cpu(), 1, generator=g))))
    counts = sample_pairs(tiny_models, "m", "random")
    assert chi_square_p_value(counts, joint, RUNS) < 1e-6


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
