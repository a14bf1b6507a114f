"""Self-speculative drafting (``ssd``): the target's first n layers draft over the target's own cache."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from tests import tiny
from mmspec_cli.cli.app import app
from mmspec_cli.drafters import build_drafter
from mmspec_cli.drafters.ssd import SelfSpeculativeDrafter
from mmspec_cli.decoding.engine import SpeculativeDecoder
from mmspec_cli.errors import InputError, ProfileError
from mmspec_cli.models.profiles import apply_overrides, profile_from_dict
from mmspec_cli.models.prompts import process, render_prompt
from mmspec_cli.decoding.sampling import TokenPicker

from tests.conftest import load
from tests.helpers import (FOLLOW_UP, QUESTION, after_block, assert_one_line_error, begin_turn, chain, decode, save_images,
                           uncached_forward, write_profile)
from tests.helpers import reference
from tests.distributions import ENGINE_RUNS, PARAMS, chi_square_p_value, sampled_pairs

LAYERS = 4


@pytest.fixture(scope="module")
def deep(tmp_path_factory, tiny_dirs):
    """A 4-layer tiny target with the shared tokenizer, saved and loaded like any model."""
    root = tmp_path_factory.mktemp("ssd")
    tokenizer = tiny.train_tokenizer()
    path = tiny.save(tiny.make_model(len(tokenizer), seed=5, layers=LAYERS), tiny.make_processor(tokenizer),
                     root / "deep")
    return load(path, "target")


@pytest.mark.parametrize("layer", [1, 2, 3])
@pytest.mark.parametrize("gamma, n_images", [(1, 1), (3, 0), (3, 2), (5, 1)])
def test_greedy_equals_target_generate(deep, layer, gamma, n_images):
    generation = decode(deep, "ssd", build=dict(ssd_layer=layer), gamma=gamma, n_images=n_images)
    assert generation.turns[0].token_ids == reference(deep, [QUESTION], [], n_images)


def test_two_turns_equal_target_generate(deep):
    generation = decode(deep, "ssd", build=dict(ssd_layer=2), questions=(QUESTION, FOLLOW_UP))
    first = generation.turns[0]
    assert first.token_ids == reference(deep, [QUESTION], [], 1)
    assert generation.turns[1].token_ids == reference(deep, [QUESTION, FOLLOW_UP], [first.text], 1)


def early_exit_greedy(target, layer, ids, vision, steps):
    """Reference draft: argmax of LM head(final norm(hidden state after `layer`)), full forward each step, no cache."""
    tokens = []
    for _ in range(steps):
        with torch.no_grad():
            out = uncached_forward(target.model, ids + tokens, vision, output_hidden_states=True)
        hidden = out.hidden_states[layer][0, -1]  # transformers gives the last layer's output already normed
        hidden = target.model.get_decoder().norm(hidden) if layer < len(out.hidden_states) - 1 else hidden
        logits = target.model.get_output_embeddings()(hidden)
        tokens.append(int(logits.argmax()))
    return tokens


@pytest.mark.parametrize("layer", [1, 3])
def test_draft_is_the_targets_first_layers(deep, layer):
    text = render_prompt(deep.processor, [QUESTION], [], 1)
    prompt = process(deep.processor, text, tiny.images(1))
    decoder = SpeculativeDecoder(deep, build_drafter("ssd", deep, None, ssd_layer=layer), gamma=4, max_new_tokens=24)
    drafter = decoder.drafter
    begin_turn(decoder, text, tiny.images(1))
    draft = drafter.propose([], chain(4), TokenPicker(decoder.sampling))
    assert draft.tokens == early_exit_greedy(deep, layer, prompt.ids, prompt.vision, 4)
    # the draft's entries were cropped again: every layer of the target's cache holds the same positions
    lengths = {layer_cache.get_seq_length() for layer_cache in decoder.cached_target.cache.layers}
    assert lengths == {len(prompt.ids) - 1} and decoder.cached_target.length == len(prompt.ids) - 1
    generated = early_exit_greedy(deep, LAYERS, prompt.ids, prompt.vision, 2)  # the target's own next tokens
    after_block(decoder, prompt, generated)
    assert drafter.propose(generated, chain(3), TokenPicker(decoder.sampling)).tokens == early_exit_greedy(
        deep, layer, prompt.ids + generated, prompt.vision, 3)


def test_no_second_model_in_memory(deep):
    drafter = build_drafter("ssd", deep, None, ssd_layer=2)
    assert isinstance(drafter, SelfSpeculativeDrafter)
    target_tensors = {p.data_ptr() for p in deep.model.parameters()}
    assert {p.data_ptr() for p in drafter.decoder.parameters()} <= target_tensors
    assert len(drafter.decoder.layers) == 2
    assert drafter.decoder.layers[1] is deep.model.get_decoder().layers[1]


def test_sampled_pairs_follow_the_target_distribution(tiny_models, joint):
    """ssd at layer 1 of the 2-layer tiny target (layer 0 + norm + head drafts), chains of γ = 2: ENGINE_RUNS
    runs against the target's exact distribution (tests/test_engine_sampling.py says how).

    What it can detect (measured when it was written, same seeds): handing the rule the draft's q rows in
    reverse order gives p ≈ 6e-20; the target's p rows shifted by one, or accepting every draft token, p ≈ 0."""
    target = tiny_models["target"]
    decoder = SpeculativeDecoder(target, build_drafter("ssd", target, None, ssd_layer=1), gamma=2, max_new_tokens=3,
                                 sampling=PARAMS)
    counts, turns = sampled_pairs(decoder, ENGINE_RUNS)
    # the draft is right sometimes and wrong sometimes, so both branches of the rule are exercised
    assert {turn.blocks[0].accepted for turn in turns} == {0, 1, 2}
    assert chi_square_p_value(counts, joint, ENGINE_RUNS) > 1e-3


def test_layer_outside_the_range_is_refused(deep):
    with pytest.raises(InputError, match=r"ssd.layer 4 is outside \[1, 3\]"):
        build_drafter("ssd", deep, None, ssd_layer=4)
    with pytest.raises(InputError, match="run `mmspec select-layer"):
        build_drafter("ssd", deep, None, ssd_layer=None)
    with pytest.raises(InputError, match="ssd can't be an ensemble member"):
        build_drafter("tabed:ms", deep, None)


def test_profile_key_and_flag():
    profile = profile_from_dict({"target": {"model": "x"}, "ssd": {"layer": 3}})
    assert profile.ssd.layer == 3
    assert apply_overrides(profile, ssd_layer=5).ssd.layer == 5
    with pytest.raises(ProfileError, match="ssd.layer: expected an integer >= 1, got 0"):
        profile_from_dict({"target": {"model": "x"}, "ssd": {"layer": 0}})
    with pytest.raises(ProfileError, match="--ssd-layer: expected an integer >= 1, got 0"):
        apply_overrides(profile, ssd_layer=0)


def test_cli_errors_are_one_line(tiny_dirs, tmp_path):
    profile = write_profile(tmp_path / "p.yaml", tiny_dirs["target"], tiny_dirs["perturbed"], max_new_tokens=4)
    [image] = save_images(tmp_path, 1)
    runner = CliRunner()
    args = ["generate", image, "-q", QUESTION, "--profile", profile, "--drafter", "ssd"]
    assert_one_line_error(runner.invoke(app, args), "run `mmspec select-layer")
    assert_one_line_error(runner.invoke(app, [*args, "--ssd-layer", "2"]), "ssd.layer 2 is outside [1, 1]")
    result = runner.invoke(app, [*args, "--ssd-layer", "1", "--json"])
    assert result.exit_code == 0, result.stderr
