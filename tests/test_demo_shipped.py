"""The shipped demo family (issue 5): it is the default, loads offline, answers well, and drafts losslessly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors import safe_open
from typer.testing import CliRunner

from mmspec_cli.cli.app import app
from mmspec_cli.demo.examples import example_images
from mmspec_cli.demo.quality import answer_questions, score_answers
from mmspec_cli.demo.tasks import quality_questions
from mmspec_cli.demo.training.train import language_model_parameters
from mmspec_cli.models.loading import check_compatible, load_model, shipped_models, shipped_models_dir
from mmspec_cli.models.profiles import load_profile
from mmspec_cli.models.prompts import render_prompt

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
runner = CliRunner()


@pytest.fixture(scope="module")
def offline(tmp_path_factory):
    """No hub: HF_HUB_OFFLINE on and an empty HF cache, for the whole module."""
    import huggingface_hub.constants

    mp = pytest.MonkeyPatch()
    mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read at import: set the constant
    mp.setenv("HF_HUB_OFFLINE", "1")
    mp.setenv("HF_HOME", str(tmp_path_factory.mktemp("empty-hf-home")))
    yield
    mp.undo()


@pytest.fixture(scope="module")
def demo(offline):
    profile = load_profile(None)
    return profile, load_model(profile.target, "target"), load_model(profile.draft, "draft")


def test_the_default_profile_is_the_shipped_demo(demo):
    profile, target, draft = demo
    assert profile.name == "demo"
    assert profile.target.model == "mmspec:demo-target" and profile.draft.model == "mmspec:demo-draft"
    assert profile.captioner is not None and profile.captioner.model == "mmspec:demo-draft"
    assert shipped_models() == ["mmspec:demo-draft", "mmspec:demo-eagle", "mmspec:demo-eagle3", "mmspec:demo-imitation",
                                "mmspec:demo-target", "mmspec:demo-vispec"]


def test_shipped_models_load_offline_and_fit_the_issue_limits(demo):
    _, target, draft = demo
    check_compatible(target, draft)  # one shared tokenizer
    for loaded in (target, draft):
        assert type(loaded.model).__name__ == "LlavaForConditionalGeneration"
        assert loaded.model.config.vision_config.model_type == "clip_vision_model"
    assert language_model_parameters(draft.model) * 10 <= language_model_parameters(target.model)
    files = [p for p in shipped_models_dir().rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= 30 * 2**20
    for name in ("demo-target", "demo-draft"):
        with safe_open(str(shipped_models_dir() / name / "model.safetensors"), "pt") as weights:
            assert {weights.get_tensor(k).dtype for k in weights.keys()} == {torch.float16}


#: Issue 5's bar: at least 80 of 100 held-out questions answered correctly. A babbling model
#: scores about 20 (1 in 6 colours, about 1 in 4 counts). The shipped target scores 81 with
#: torch 2.13 on x86 CPUs (README "How good the target is"); the margin is one answer, so
#: another torch build or device may need the weights rebuilt rather than this bar lowered.
QUALITY_TARGET = 80


def test_quality_on_100_held_out_colour_and_count_questions(demo):
    """The demo target on 100 held-out questions, read strictly (``tasks.answer_correct``): the
    expected word appears and no other colour (colour questions) or number word (count questions)
    appears anywhere in the reasoned answer.
    The lenient reading (final answer only) is printed beside it; the README reports both.
    The 100 answers come from one left-padded batch (2 s instead of 25 s one by one); the first two and
    the most padded are answered again alone and must be the same text: the batch is the target's own
    greedy output (all 100 were the same when this was written).
    """
    _, target, _ = demo
    questions = quality_questions(100)
    answers = answer_questions(target.model, target.processor, questions, batch_size=len(questions))
    tokens = [len(target.processor.tokenizer(render_prompt(target.processor, [q.question], [], 1)).input_ids)
              for q in questions]
    for i in (0, 1, tokens.index(min(tokens))):
        assert answer_questions(target.model, target.processor, [questions[i]]) == [answers[i]], i
    score = score_answers(questions, answers)
    final, strict = score.final, score.strict
    print(f"strictly right {sum(strict)}/100 (colour {sum(strict[0::2])}/50, count {sum(strict[1::2])}/50); "
          f"final answer right {sum(final)}/100")
    wrong = strict.index(False) if not all(strict) else None
    assert sum(strict) >= QUALITY_TARGET, \
        f"{sum(strict)}/100 right; e.g. {questions[wrong].question!r} -> {answers[wrong]!r}"


def test_examples_are_what_the_generator_draws():
    images = example_images()
    assert sorted(p.name for p in EXAMPLES.glob("*.png")) == sorted(images)
    for name, image in images.items():
        on_disk = Image.open(EXAMPLES / name).convert("RGB")
        assert on_disk.size == image.size and on_disk.tobytes() == image.tobytes(), name


def test_generate_with_no_profile_runs_on_the_examples_and_matches_ar(offline):
    image = str(EXAMPLES / "shapes.png")
    question = "Describe the image in detail."
    runs = {}
    for drafter in ("ar", "tabed"):
        result = runner.invoke(app, ["generate", image, "-q", question, "--drafter", drafter, "--json"])
        assert result.exit_code == 0, result.stderr
        runs[drafter] = json.loads(result.stdout)
    tabed, ar = runs["tabed"]["turns"][0], runs["ar"]["turns"][0]
    assert tabed["token_ids"] == ar["token_ids"]  # lossless at temperature 0
    assert {"small", "large"} & set(tabed["text"].lower().split())  # it describes the shapes
    assert tabed["stats"]["block_efficiency"] > 1.5  # the demo draft is a real drafter, not a babbler


def test_generate_with_no_profile_on_the_story_frames(offline):
    frames = [str(EXAMPLES / f"story-{i}.png") for i in range(1, 6)]
    result = runner.invoke(app, ["generate", *frames, "-q", "What happens in frame 5?", "--drafter", "t",
                                 "--max-new-tokens", "24", "--json"])
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["turns"][0]["stats"]["new_tokens"] == 24
