"""The prompt a user gives: questions holding the image placeholder, empty questions, prompts past the context, and
the drafter choices checked against the profile; each ends in one clear line (or is handled right).

Tiny float64 LLaVA models of ``conftest.py`` on CPU (context: 1024 positions, 2 decoder layers).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from PIL import Image

from mmspec_cli.bench.peers import PEERS
from mmspec_cli.decoding.engine import SpeculativeDecoder
from mmspec_cli.drafters import build_drafter
from mmspec_cli.choices import BENCH_PEERS
from mmspec_cli.errors import InputError
from mmspec_cli.models.images import to_rgb
from mmspec_cli.models.prompts import process, render_prompt

from tests.conftest import load
from tests.helpers import assert_one_line_error, cli, save_images, write_profile

QUESTION = "what is in the image?"
MAX_NEW = 5
CONTEXT = 1024  # tests/tiny.py: max_position_embeddings


# --------------------------------------------------------------------------- questions


def test_a_question_holding_the_image_placeholder_keeps_it_as_text(one_image_files):
    question = "What is <image> this?"
    result = cli("generate", *one_image_files["images"], "-q", question, "--profile", one_image_files["profile"], "--json")
    assert result.exit_code == 0, (result.stderr, result.exception)
    assert json.loads(result.stdout)["turns"][0]["question"] == question


@pytest.mark.parametrize("processor_of", ["target", "no_template"])
def test_questions_and_answers_holding_the_placeholder_keep_one_slot_per_image(tiny_models, processor_of):
    processor = tiny_models[processor_of].processor
    image_id = tiny_models["target"].image_token_id
    images = [to_rgb(Image.new("RGB", (28, 28), (200, 30, 30)))]
    plain = process(processor, render_prompt(processor, ["what is it?"], [], 1), images)
    text = render_prompt(processor, ["what is <image>?", "and <image><image>?"], ["an <image> tag"], 1,
                         history=[("a <image>?", "<image>")])
    quoted = process(processor, text, images)
    assert quoted.ids.count(image_id) == plain.ids.count(image_id) > 0


def test_a_history_holding_the_placeholder_is_decoded(tiny_models):
    target = tiny_models["target"]
    decoder = SpeculativeDecoder(target, build_drafter("t", target, tiny_models["perturbed"]), gamma=3,
                                 max_new_tokens=MAX_NEW)
    images = [Image.new("RGB", (28, 28), (30, 30, 200))]
    generation = decoder.generate(images, ["and now?"], history=[("what is <image>?", "an <image> tag")])
    assert generation.turns[0].stats.new_tokens > 0


@pytest.mark.parametrize("question", ["", "   \n\t"])
def test_an_empty_question_is_one_line(one_image_files, no_model_loading, question):
    for command in ("generate", "compare"):
        assert_one_line_error(cli(command, *one_image_files["images"], "-q", question, "--profile", one_image_files["profile"]),
                              "is empty; write the question after -q")
    assert_one_line_error(cli("generate", *one_image_files["images"], "-q", QUESTION, "-q", question,
                              "--profile", one_image_files["profile"]), "question 2 (-q) is empty")
    assert_one_line_error(cli("generate", "--raw-prompt", question, "--profile", one_image_files["profile"]),
                          "--raw-prompt is empty")


def test_an_empty_question_is_one_line_for_select_layer(one_image_files):
    assert_one_line_error(cli("select-layer", *one_image_files["images"], "-q", " ", "--profile", one_image_files["profile"]),
                          "is empty; write the question after -q")


# --------------------------------------------------------------------------- context


def long_question(processor, images, tokens: int) -> str:
    """A question whose prompt (with ``images``) is exactly ``tokens`` tokens."""
    words = ["red"]
    while len(process(processor, render_prompt(processor, [" ".join(words)], [], len(images)), images).ids) < tokens:
        words.append("red")
    question = " ".join(words)
    assert len(process(processor, render_prompt(processor, [question], [], len(images)), images).ids) == tokens
    return question


def test_a_question_longer_than_the_context_is_one_line(one_image_files):
    line = assert_one_line_error(cli("generate", *one_image_files["images"], "-q", "describe " * 5000, "--profile",
                                     one_image_files["profile"]), f"max_new_tokens is {MAX_NEW}")
    assert f"more than the target's context of {CONTEXT}; shorten the question" in line


def test_the_context_check_refuses_one_token_past_the_boundary_only(tiny_models):
    target = tiny_models["target"]
    images = [Image.new("RGB", (28, 28), (30, 200, 30))]
    question = long_question(target.processor, images, CONTEXT - 3)
    decoder = SpeculativeDecoder(target, build_drafter("ar", target, None), max_new_tokens=4)
    assert decoder.generate(images, [question]).turns  # reads 1021 + 4 - 1 = 1024 positions: fits
    with pytest.raises(InputError, match=rf"the prompt is {CONTEXT - 3} tokens \(4 for its image, {CONTEXT - 7} for "
                                         rf"the text\) and max_new_tokens is 5: "
                                         f"{CONTEXT + 1} tokens, more than the target's context of {CONTEXT}; "
                                         f"lower --max-new-tokens to 4"):
        decoder.generate(images, [question], max_new_tokens=5)


@pytest.mark.parametrize("drafter", ["t", "mt"])
def test_the_drafts_own_prompt_must_fit_the_drafts_context(tiny_dirs, tiny_models, drafter):
    target = tiny_models["target"]
    draft = load(tiny_dirs["perturbed"], "draft")  # a fresh copy: its context is shrunk below
    draft.model.config.text_config.max_position_embeddings = 64
    images = [Image.new("RGB", (28, 28), (200, 200, 30))]
    decoder = SpeculativeDecoder(target, build_drafter(drafter, target, draft), gamma=2, max_new_tokens=MAX_NEW)
    fits = long_question(target.processor, images, 60)  # the text-only view is shorter: it fits the draft too
    assert decoder.generate(images, [fits]).turns
    with pytest.raises(InputError, match=f"as drafter {drafter} shows it to the draft is .* more than the draft's "
                                         f"context of 64"):
        decoder.generate(images, [long_question(target.processor, images, 200)])


def test_bench_records_a_sample_too_long_for_the_context_and_goes_on(one_image_files, tmp_path):
    [image] = save_images(tmp_path, 1)
    rows = [{"id": "long", "images": [Path(image).name], "turns": ["red " * 3000], "category": "x"},
            {"id": "short", "images": [Path(image).name], "turns": [QUESTION], "category": "x"}]
    manifest = tmp_path / "manifest.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    result = cli("bench", str(manifest), "--drafters", "ar", "--out", str(out), "--profile", one_image_files["profile"])
    assert result.exit_code == 1, result.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["id"], "error" in r) for r in records] == [("long", True), ("short", False)]
    assert f"more than the target's context of {CONTEXT}" in records[0]["error"]


# --------------------------------------------------------------------------- drafters and ssd.layer


def test_hf_assisted_outside_bench_says_it_is_a_bench_peer(one_image_files, no_model_loading):
    fragment = "'hf-assisted' is a bench-only peer row"
    line = assert_one_line_error(cli("generate", *one_image_files["images"], "-q", QUESTION, "--profile", one_image_files["profile"],
                                     "--drafter", "hf-assisted"), fragment)
    assert "mmspec bench SOURCE --drafters ar,hf-assisted" in line
    assert_one_line_error(cli("compare", *one_image_files["images"], "-q", QUESTION, "--profile", one_image_files["profile"],
                              "--drafters", "ar,hf-assisted"), fragment)
    assert set(BENCH_PEERS) == set(PEERS)  # the registry knows every bench peer by name


def test_an_ssd_layer_the_target_lacks_is_refused_for_any_drafter(one_image_files):
    for drafter in ("m", "ar"):
        assert_one_line_error(cli("generate", *one_image_files["images"], "-q", QUESTION, "--profile", one_image_files["profile"],
                                  "--drafter", drafter, "--ssd-layer", "99"), "ssd.layer 99 is outside [1, 1]")


def test_select_layer_ignores_a_stale_ssd_layer_in_the_profile(one_image_files, tmp_path):
    stale = tmp_path / "stale.yaml"
    stale.write_text(Path(one_image_files["profile"]).read_text() + "ssd: {layer: 99}\n")
    result = cli("select-layer", *one_image_files["images"], "-q", QUESTION, "--profile", str(stale), "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["chosen"] == 1


def test_a_draft_that_is_the_target_gives_one_warning_line(one_image_files, tiny_dirs, tmp_path):
    same = write_profile(tmp_path / "same.yaml", tiny_dirs["target"], tiny_dirs["target"], max_new_tokens=MAX_NEW)
    result = cli("generate", *one_image_files["images"], "-q", QUESTION, "--profile", same, "--json")
    assert result.exit_code == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if line and not line.startswith("Loading weights")]
    assert len(lines) == 1 and lines[0].startswith("warning: the draft is the target itself")
    for args in (["--profile", same, "--drafter", "ar"], ["--profile", one_image_files["profile"]]):
        quiet = cli("generate", *one_image_files["images"], "-q", QUESTION, *args, "--json")
        assert quiet.exit_code == 0 and "warning" not in quiet.stderr
    data = yaml.safe_load(Path(same).read_text())
    assert data["draft"]["model"] == data["target"]["model"]
