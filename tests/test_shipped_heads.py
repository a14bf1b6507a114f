"""The shipped demo heads (``mmspec:demo-vispec``, ``mmspec:demo-eagle``, ``mmspec:demo-eagle3``): small, half
precision, named by the demo
profile, and lossless where a trained head's drafts are accepted, end a turn inside a block, and meet the token limit."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from mmspec_cli.inputs.samples import load_sample_images
from mmspec_cli.inputs.sources import resolve
from mmspec_cli.cli.app import app
from mmspec_cli.decoding.engine import SpeculativeDecoder, eos_ids
from mmspec_cli.drafters.head import HeadDrafter
from mmspec_cli.models.head_files import head_dir, load_head
from mmspec_cli.models.loading import load_model
from mmspec_cli.models.profiles import load_profile
from mmspec_cli.models.prompts import render_prompt
from tests.helpers import generate_from_text
from tests.test_demo_shipped import EXAMPLES, offline  # noqa: F401  (the no-hub fixture)

HEADS = {"vispec": "mmspec:demo-vispec", "eagle": "mmspec:demo-eagle", "eagle3": "mmspec:demo-eagle3"}


@pytest.fixture(scope="module")
def demo(offline):  # noqa: F811
    profile = load_profile(None)
    target = load_model(profile.target, "target")
    return profile, target, {h.kind: load_head(h.model, h.kind, h.num_q, target) for h in profile.head}


def test_the_demo_profile_names_every_head_small_and_in_half_precision(demo):
    profile, _, heads = demo
    assert {h.kind: h.model for h in profile.head} == HEADS
    for kind, name in HEADS.items():
        folder = head_dir(name)
        assert (folder / "model.safetensors").stat().st_size < 5 * 2**20
        with safe_open(str(folder / "model.safetensors"), "pt") as weights:
            floats = {weights.get_tensor(k).dtype for k in weights.keys() if k not in ("d2t", "t2d")}
            assert floats == {torch.float16}  # an EAGLE-3 head's d2t and t2d are ids (int64) and a mask (bool)
        config = json.loads((folder / "config.json").read_text())["mmspec"]
        assert config["kind"] == kind and config["target"] == "mmspec:demo-target"
    assert heads["vispec"].num_q == 2


def reference(target, sample, images, max_new_tokens):
    text = render_prompt(target.processor, list(sample.turns[:1]), [], len(images), sample.history)
    return generate_from_text(target, text, images, max_new_tokens)


@pytest.fixture(scope="module")
def answered(demo):
    """Three demo samples (one and two images) with the target's own greedy answers."""
    _, target, _ = demo
    out = []
    for sample in resolve("demo-single", 2) + resolve("demo-pair", 1):
        images = load_sample_images(sample)
        out.append((sample, images, reference(target, sample, images, 160)))
    return out


@pytest.mark.parametrize("kind", ["vispec", "eagle", "eagle3"])
@pytest.mark.parametrize("tree", [{}, {"tree": "dynamic"}])
def test_trained_heads_are_lossless_and_end_turns_inside_blocks(demo, answered, kind, tree):
    _, target, heads = demo
    decoder = SpeculativeDecoder(target, HeadDrafter(target, heads[kind]), gamma=5, max_new_tokens=160, **tree)
    eos = eos_ids(target)
    accepted = ended_inside = 0
    for sample, images, expected in answered:
        turn = decoder.generate(images, list(sample.turns[:1]), history=sample.history).turns[0]
        assert turn.token_ids == expected
        accepted += turn.stats.accepted
        last = turn.blocks[-1]
        ended_inside += last.tokens[-1] in eos and last.accepted == len(last.tokens)  # EOS was an accepted draft
    assert accepted > 0 and ended_inside > 0


@pytest.mark.parametrize("max_new", [1, 6, 11])
def test_the_token_limit_is_exact_with_a_trained_head(demo, max_new):
    _, target, heads = demo
    [sample] = resolve("demo-single", 1)
    images = load_sample_images(sample)
    for tree in ({}, {"tree": "dynamic"}):
        decoder = SpeculativeDecoder(target, HeadDrafter(target, heads["vispec"]), gamma=5, max_new_tokens=max_new, **tree)
        turn = decoder.generate(images, list(sample.turns[:1])).turns[0]
        assert turn.token_ids == reference(target, sample, images, max_new)


def test_generate_with_vispec_needs_no_profile(offline):  # noqa: F811
    result = CliRunner().invoke(app, ["generate", str(EXAMPLES / "shapes.png"), "-q", "What shapes are in the image?",
                                      "--drafter", "vispec", "--json"])
    assert result.exit_code == 0, result.stderr
    turn = json.loads(result.stdout)["turns"][0]
    assert turn["text"] and turn["stats"]["block_efficiency"] > 1.5


def test_the_shipped_imitation_network_follows_the_demo_profiles_layer(demo):
    from mmspec_cli.models.imitation import load_imitation

    profile, target, _ = demo
    assert profile.ssd.imitation == "mmspec:demo-imitation"
    folder = head_dir("mmspec:demo-imitation")
    config = json.loads((folder / "config.json").read_text())["mmspec_imitation"]
    assert config["layer"] == profile.ssd.layer and config["target"] == "mmspec:demo-target"
    with safe_open(str(folder / "model.safetensors"), "pt") as weights:
        assert {weights.get_tensor(k).dtype for k in weights.keys()} == {torch.float16}
    network = load_imitation(profile.ssd.imitation, profile.ssd.layer, target)
    [sample] = resolve("demo-single", 1)
    images = load_sample_images(sample)
    from mmspec_cli.drafters import build_drafter

    drafter = build_drafter("ssd", target, None, ssd_layer=profile.ssd.layer, imitation=network)
    turn = SpeculativeDecoder(target, drafter, gamma=5, max_new_tokens=160).generate(images, list(sample.turns[:1])).turns[0]
    assert turn.token_ids == reference(target, sample, images, 160)


def test_the_shipped_networks_carry_the_demo_targets_entries_and_load_on_it_without_a_warning(demo, capsys):
    from mmspec_cli.models.imitation import load_imitation
    from mmspec_cli.models.target_identity import other_target

    profile, target, _ = demo
    capsys.readouterr()
    for name, block in {"demo-eagle": "mmspec", "demo-vispec": "mmspec", "demo-eagle3": "mmspec",
                        "demo-imitation": "mmspec_imitation"}.items():
        signed = json.loads((head_dir(f"mmspec:{name}") / "config.json").read_text())[block]["target_signature"]
        assert set(signed) == {"rows", "columns", "entries"}  # LM-head entries, not the norms of rows
        assert not other_target(None, signed, target.name, target.model)
    for spec in profile.head:
        load_head(spec.model, spec.kind, spec.num_q, target)
    load_imitation(profile.ssd.imitation, profile.ssd.layer, target)
    assert capsys.readouterr().err == ""
