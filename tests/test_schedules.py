"""Draft-length schedules: the pure rules, and losslessness of the engine under each of them."""

from __future__ import annotations

import pytest

from tests import tiny
from mmspec_cli.drafters import build_drafter
from mmspec_cli.decoding.engine import SpeculativeDecoder
from mmspec_cli.errors import InputError, ProfileError
from mmspec_cli.models.profiles import profile_from_dict
from mmspec_cli.models.prompts import process, render_prompt
from mmspec_cli.decoding.schedules import GammaSchedule, fastvlm_length, heuristic_next, sigmoid

from tests.test_engine_greedy import MAX_NEW, QUESTION, reference


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
