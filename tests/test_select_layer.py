"""``mmspec select-layer``: FastVLM App. A.4's reward, on a tiny model whose confidence jumps at a known layer."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from transformers import LlavaForConditionalGeneration
from typer.testing import CliRunner

from tests import tiny
from mmspec_cli.cli.app import app
from mmspec_cli.cli.select_layer import written_imitation
from mmspec_cli.errors import InputError
from mmspec_cli.selectlayer.reward import candidate_layers, check_lambda, choose_layer, ranked_layers, rewards
from mmspec_cli.models.profiles import load_profile

from tests.helpers import save_images
from tests.helpers import assert_one_line_error

LAYERS = 8
JUMP = 3  # the confidence is flat (1/V) after layers 1 and 2, and high from layer 3 on
QUESTION = "what is in the image?"

runner = CliRunner()


def test_reward_and_choice_follow_fastvlm():
    confidences = {1: 0.20, 2: 0.50, 3: 0.55, 4: 0.90}
    reward = rewards(confidences, 0.1)
    assert reward == pytest.approx({1: 0.10, 2: 0.30, 3: 0.25, 4: 0.50})
    assert choose_layer(reward) == 4
    assert choose_layer(rewards(confidences, 0.2)) == 2  # a dearer layer: shallower wins (0.1, 0.3, 0.25, 0.1)
    assert choose_layer({1: 0.5, 2: 0.5}) == 1  # ties go to the shallower layer
    assert ranked_layers(reward, 2) == [4, 2]
    assert candidate_layers(32) == list(range(1, 17))
    assert candidate_layers(8, 7) == list(range(1, 8))
    with pytest.raises(InputError, match="--max-layer: expected an integer between 1 and 7"):
        candidate_layers(8, 8)
    with pytest.raises(InputError, match="--lambda: expected a number >= 0"):
        check_lambda(-0.1)


def jump_model(vocab: int, seed: int = 0) -> LlavaForConditionalGeneration:
    """Layers other than JUMP write nothing to the residual stream (zero output projections); the
    embeddings are tiny against the norm's epsilon, so the final norm and LM head see ~0 and give a
    flat distribution; layer JUMP (its norms scaled up) writes a full-size vector, and the sharp LM
    head turns it into a confident one. So C_1 = C_2 ≈ 1/V and C_l ≈ 0.9 for l ≥ JUMP."""
    torch.manual_seed(seed)
    config = tiny.make_config(vocab, layers=LAYERS)
    config.text_config.rms_norm_eps = 1e-2
    model = LlavaForConditionalGeneration(config).to(torch.float64)
    decoder = model.get_decoder()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(100.0)
        decoder.embed_tokens.weight.mul_(1e-4)
        for index, layer in enumerate(decoder.layers):
            if index + 1 == JUMP:
                layer.input_layernorm.weight.mul_(1e5)
                layer.post_attention_layernorm.weight.mul_(1e5)
            else:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 3
    return model


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("select")
    tokenizer = tiny.train_tokenizer()
    path = tiny.save(jump_model(len(tokenizer)), tiny.make_processor(tokenizer), root / "jump")
    profile = root / "jump.yaml"
    profile.write_text(yaml.safe_dump({"target": {"model": path, "dtype": "float64", "device": "cpu"},
                                       "decoding": {"gamma": 3, "max_new_tokens": 6}}))
    return {"root": root, "profile": str(profile), "images": save_images(root, 1), "vocab": len(tokenizer)}


def select(files, *args):
    result = runner.invoke(app, ["select-layer", *files["images"], "-q", QUESTION, "--profile", files["profile"],
                                 "--json", *args])
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def test_the_reward_picks_the_layer_where_confidence_jumps(files):
    out = select(files)
    assert out["layers_total"] == LAYERS and out["lambda"] == pytest.approx(1 / LAYERS)
    confidence = {row["layer"]: row["confidence"] for row in out["layers"]}
    assert list(confidence) == [1, 2, 3, 4]  # l ≤ L/2
    assert confidence[1] == pytest.approx(1 / files["vocab"], rel=1e-2) and confidence[1] == confidence[2]
    assert confidence[JUMP] > 0.5 and confidence[4] == pytest.approx(confidence[JUMP])
    for row in out["layers"]:
        assert row["reward"] == pytest.approx(row["confidence"] - row["layer"] / LAYERS)
    assert out["chosen"] == out["chosen_by_reward"] == JUMP


def test_lambda_and_max_layer_move_the_choice(files):
    assert select(files, "--lambda", "1")["chosen"] == 1  # every layer costs more than any confidence gain
    assert select(files, "--max-layer", "2")["chosen"] == 1  # flat confidence: the shallower layer
    assert select(files, "--lambda", "0", "--max-layer", "7")["chosen"] == JUMP


def test_empirical_runs_ssd_and_write_saves_a_copy(files):
    """The copy keeps the profile's imitation network, trained for the chosen layer (--write used to drop it)."""
    network = files["root"] / "imitation"  # never loaded without --imitation: its config says its layer
    network.mkdir(exist_ok=True)
    (network / "config.json").write_text(json.dumps({"mmspec_imitation": {"layer": JUMP}}))
    profile = files["root"] / "with-imitation.yaml"
    data = yaml.safe_load(open(files["profile"]))
    profile.write_text(yaml.safe_dump({**data, "ssd": {"layer": JUMP, "imitation": str(network)}}))
    written = files["root"] / "chosen.yaml"
    out = select({**files, "profile": str(profile)}, "--empirical", "2", "--write", str(written))
    assert [m["layer"] for m in out["empirical"]] == [JUMP, 4]  # the two best rewards
    for m in out["empirical"]:
        assert 1 <= m["block_efficiency"] <= out["gamma"] + 1
        assert m["latency_ratio"] > 0 and m["expected_speedup"] > 0 and m["speedup"] > 0
    assert out["chosen"] == out["chosen_by_measurement"] in (JUMP, 4)
    assert load_profile(str(written)).ssd.layer == out["chosen"]
    kept = str(network) if out["chosen"] == JUMP else None  # trained for JUMP: no use at layer 4
    assert load_profile(str(written)).ssd.imitation == out["written_imitation"] == kept
    assert load_profile(str(profile)).ssd.layer == JUMP  # the profile itself is untouched


def test_write_keeps_the_imitation_network_where_it_follows_the_chosen_layer():
    assert written_imitation(None, None, 3, scored=False, chosen_with_it=False) == (None, None)
    assert written_imitation("in", 3, 3, scored=False, chosen_with_it=False) == ("in", None)
    kept, warning = written_imitation("in", 1, 3, scored=False, chosen_with_it=False)
    assert kept is None and "trained after layer 1, not the chosen layer 3" in warning and "--imitation" in warning
    kept, warning = written_imitation("in", None, 3, scored=False, chosen_with_it=False)
    assert kept is None and "can't be read" in warning
    assert written_imitation("in", None, 1, scored=True, chosen_with_it=True) == ("in", None)  # --imitation decides
    assert written_imitation("in", None, 1, scored=True, chosen_with_it=False) == (None, None)


def test_write_refuses_a_file_that_holds_something(files, no_model_loading):
    """A user's notes given as --write became a profile; refused before any model loads, the notes kept."""
    notes = files["root"] / "notes.txt"
    notes.write_text("my notes\n")
    result = runner.invoke(app, ["select-layer", *files["images"], "-q", QUESTION, "--profile", files["profile"],
                                 "--write", str(notes)])
    assert_one_line_error(result, "already exists; --write saves to a new file", loading_bars=False)
    assert notes.read_text() == "my notes\n"


def test_an_image_without_a_question_is_one_line(files, no_model_loading):
    """It was read as a JSONL manifest: "manifest ... could not be read (UnicodeDecodeError)"."""
    for images in (files["images"], [*files["images"], *files["images"]]):
        result = runner.invoke(app, ["select-layer", *images, "--profile", files["profile"]])
        assert_one_line_error(result, "is an image, and images need a question: pass -q QUESTION",
                              loading_bars=False)


def test_plain_output_marks_the_chosen_layer(files):
    result = runner.invoke(app, ["select-layer", *files["images"], "-q", QUESTION, "--profile", files["profile"]])
    assert result.exit_code == 0, result.stderr
    [marked] = [line for line in result.stdout.splitlines() if "<- chosen by reward" in line]
    assert marked.split()[0] == str(JUMP)
    assert f"chosen: ssd.layer = {JUMP}" in result.stdout


def test_a_suite_is_a_calibration_set(files):
    result = runner.invoke(app, ["select-layer", "demo-single", "--limit", "1", "--profile", files["profile"], "--json"])
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["samples"] == 1


@pytest.mark.parametrize("args, fragment", [
    (["--lambda", "-0.5"], "--lambda: expected a number >= 0"),
    (["--max-layer", "8"], "--max-layer: expected an integer between 1 and 7"),
    (["--empirical", "0"], "--empirical: expected an integer >= 1"),
])
def test_bad_flags_are_one_line(files, args, fragment):
    result = runner.invoke(app, ["select-layer", *files["images"], "-q", QUESTION, "--profile", files["profile"], *args])
    assert_one_line_error(result, fragment)


def test_bad_sources_are_one_line(files):
    assert_one_line_error(runner.invoke(app, ["select-layer", "--profile", files["profile"]]),
                          "pass one calibration SOURCE")
    assert_one_line_error(runner.invoke(app, ["select-layer", *files["images"], "-q", QUESTION, "--profile",
                                              files["profile"], "--write", files["profile"]]), "is the profile itself")


def test_a_later_turns_own_images_are_read(files):
    """A calibration sample whose second question brings an image: both turns are decoded and read with the
    images each turn's prompt shows (dropping the brought one would make the processor refuse the prompt)."""
    (files["root"] / "turns").mkdir(exist_ok=True)
    first, second = save_images(files["root"] / "turns", 2)
    manifest = files["root"] / "turns.jsonl"
    manifest.write_text(json.dumps({"id": "s", "images": [first], "category": "c",
                                    "turns": [QUESTION, {"question": "and now?", "images": [second]}]}) + "\n")
    result = runner.invoke(app, ["select-layer", str(manifest), "--profile", files["profile"], "--json",
                                 "--empirical", "1"])
    assert result.exit_code == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["samples"] == 1 and out["positions"] == 2 * 6  # two turns of max_new_tokens each, read in full
    assert out["chosen"] == JUMP and out["empirical"][0]["block_efficiency"] >= 1


# --------------------------------------------------------------------------- select-layer --write


def test_select_layer_refuses_an_unwritable_write_path_before_calibrating(files, no_model_loading):
    result = runner.invoke(app, ["select-layer", *files["images"], "-q", QUESTION, "--profile", files["profile"],
                                 "--write", "/proc/x.yaml"])
    assert_one_line_error(result, "--write '/proc/x.yaml' can't be written")


def test_the_write_check_leaves_no_file_behind(files, tmp_path, no_model_loading):
    target = tmp_path / "ssd.yaml"
    result = runner.invoke(app, ["select-layer", "--profile", files["profile"], "--write", str(target)])
    assert_one_line_error(result, "pass one calibration SOURCE")  # refused after the --write check
    assert not target.exists()
