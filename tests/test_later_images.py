"""Images in any turn (issue 21): a later question brings new images, the cache of the turns before is kept, and
every turn is the target's own output. LLaVA-1.5 here; the Qwen-VL families in test_qwen_families.py, LLaVA-NeXT
and OneVision in test_model_families.py."""

from __future__ import annotations

import pytest

from mmspec_cli.decoding.kv import CachedModel
from mmspec_cli.drafters.head import HeadDrafter
from mmspec_cli.models.prompts import build_messages, image_counts, process, render_prompt
from tests import tiny
from tests.helpers import FOLLOW_UP, QUESTION, image_in_second_turn, speculative_decoder
from tests.test_heads import random_head

DYNAMIC = {"tree": "dynamic", "tree_budget": 10, "tree_topk": 3}


def test_each_user_turn_shows_its_own_images():
    assert image_counts(2, 3) == [2, 0, 0]
    assert image_counts([1, 0, 2], 3) == [1, 0, 2]
    assert image_counts([1], 2) == [1, 0]
    messages = build_messages(["a", "b"], ["x"], [1, 2])
    assert [sum(c["type"] == "image" for c in m["content"]) for m in messages] == [1, 0, 2]


@pytest.mark.parametrize("case", ["ar", "m", "t", "mt", "tabed", "p", "ssd", "eagle", "m-width", "vispec-dynamic"])
@pytest.mark.parametrize("opening", [0, 1])
def test_an_image_in_the_second_turn_keeps_the_targets_own_output(tiny_models, case, opening):
    target, draft = tiny_models["target"], tiny_models["perturbed"]
    name = case.split("-")[0]
    drafter = HeadDrafter(target, random_head(target, name)) if name in ("eagle", "vispec") else name
    options = {"m-width": {"tree_width": 2}, "vispec-dynamic": DYNAMIC}.get(case, {})
    images = tiny.images(2)
    mine, own = image_in_second_turn(target, drafter, draft, images[:opening], images[1:2],
                                     build={"ssd_layer": 1} if name == "ssd" else None, **options)
    assert mine == own


def fed_lengths(target, monkeypatch) -> list[int]:
    """The number of tokens of every forward of the target model, as they happen."""
    fed: list[int] = []
    original = type(target.model).forward

    def counting(self, *args, **kwargs):
        if self is target.model:
            fed.append(kwargs["input_ids"].shape[1])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(target.model), "forward", counting)
    return fed


def test_the_earlier_turns_stay_cached_and_only_the_new_part_is_fed(tiny_models, monkeypatch):
    """The second turn's first forward feeds the first turn's answer, the new question and the new image, not the
    conversation again; with the incremental path turned off it would (the check can fail)."""
    target = tiny_models["target"]
    images = tiny.images(2)
    first_prompt = len(process(target.processor, render_prompt(target.processor, [QUESTION], [], 1), images[:1]).ids)
    for incremental in (True, False):
        if not incremental:
            monkeypatch.setattr(CachedModel, "_images_after", lambda *args: None)
        fed = fed_lengths(target, monkeypatch)
        decoder = speculative_decoder(target, "ar", None, max_new_tokens=6)
        turns = decoder.generate(images[:1], [QUESTION, FOLLOW_UP], turn_images={1: images[1:]}).turns
        text = render_prompt(target.processor, [QUESTION, FOLLOW_UP], [turns[0].text], [1, 1])
        whole = len(process(target.processor, text, images).ids)
        opening = fed[len(turns[0].token_ids)]  # ar: one forward per token of the first turn, its prompt in the first
        assert fed[0] == first_prompt
        if incremental:
            assert opening <= whole - first_prompt
        else:
            assert opening == whole
        monkeypatch.undo()


def test_images_for_a_question_that_does_not_exist_are_one_line(tiny_models):
    from mmspec_cli.errors import InputError

    decoder = speculative_decoder(tiny_models["target"], "ar", None, max_new_tokens=2)
    with pytest.raises(InputError, match="question 3.*2 questions"):
        decoder.generate([], [QUESTION, FOLLOW_UP], turn_images={2: tiny.images(1)})


# --------------------------------------------------------------------------- generate --turn-image, bench manifests

import json  # noqa: E402

from typer.testing import CliRunner  # noqa: E402

from mmspec_cli.cli.app import app  # noqa: E402
from mmspec_cli.models.images import load_images  # noqa: E402
from tests.helpers import MAX_NEW, assert_one_line_error, own_generate, tiny_files  # noqa: E402

runner = CliRunner()


@pytest.fixture(scope="module")
def files(tiny_dirs, tmp_path_factory) -> dict:
    return tiny_files(tmp_path_factory.mktemp("later"), tiny_dirs, max_new_tokens=MAX_NEW)


def test_generate_shows_a_turn_image_in_its_turn(files, tiny_models):
    first, second = files["images"]
    result = runner.invoke(app, ["generate", first, "-q", QUESTION, "-q", FOLLOW_UP, "--turn-image", f"2:{second}",
                                 "--profile", files["profile"], "--json"])
    assert result.exit_code == 0, result.stderr
    turns = json.loads(result.stdout)["turns"]
    target, pictures = tiny_models["target"], load_images([first, second])
    assert turns[0]["token_ids"] == own_generate(target, [QUESTION], [], [1], pictures[:1])
    assert turns[1]["token_ids"] == own_generate(target, [QUESTION, FOLLOW_UP], [turns[0]["text"]], [1, 1], pictures)


@pytest.mark.parametrize("case", ["no number", "no such question", "raw prompt", "missing file"])
def test_a_bad_turn_image_is_one_line_before_loading(files, no_model_loading, case):
    image = files["images"][1]
    args, fragment = {
        "no number": (["-q", QUESTION, "--turn-image", image], "--turn-image takes N:IMAGE"),
        "no such question": (["-q", QUESTION, "-q", FOLLOW_UP, "--turn-image", f"3:{image}"],
                             "names question 3, but there are 2 questions"),
        "raw prompt": (["--raw-prompt", "USER: <image>\nhi ASSISTANT:", "--turn-image", f"1:{image}"],
                       "drop --turn-image"),
        "missing file": (["-q", QUESTION, "-q", FOLLOW_UP, "--turn-image", "2:nowhere.png"], "nowhere.png"),
    }[case]
    result = runner.invoke(app, ["generate", files["images"][0], *args, "--profile", files["profile"]])
    assert_one_line_error(result, fragment)


def test_a_bench_manifest_turn_brings_its_own_images(files, tiny_models, tmp_path):
    first, second = files["images"]
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps({"id": "s", "images": [first], "category": "c",
                                    "turns": [QUESTION, {"question": FOLLOW_UP, "images": [second]}]}) + "\n")
    out = tmp_path / "r.jsonl"
    result = runner.invoke(app, ["bench", str(manifest), "--drafters", "ar,m", "--profile", files["profile"],
                                 "--out", str(out), "--format", "json"])
    assert result.exit_code == 0, result.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    target, pictures = tiny_models["target"], load_images([first, second])
    for record in records:
        if record["turn"] == 0:
            assert record["token_ids"] == own_generate(target, [QUESTION], [], [1], pictures[:1])
        else:
            assert record["token_ids"] == own_generate(target, [QUESTION, FOLLOW_UP], [record_text(records, record)],
                                                       [1, 1], pictures)
    assert sorted((r["drafter"], r["turn"]) for r in records) == [("ar", 0), ("ar", 1), ("m", 0), ("m", 1)]


def record_text(records: list[dict], record: dict) -> str:
    """The first turn's answer of ``record``'s drafter."""
    return next(r["text"] for r in records if r["drafter"] == record["drafter"] and r["turn"] == 0)


def test_a_bad_turn_in_a_manifest_is_one_line_with_its_number(files, no_model_loading, tmp_path):
    manifest = tmp_path / "bad.jsonl"
    manifest.write_text(json.dumps({"id": "s", "images": [], "category": "c",
                                    "turns": [QUESTION, {"question": FOLLOW_UP, "images": "b.png"}]}) + "\n")
    result = runner.invoke(app, ["bench", str(manifest), "--profile", files["profile"]])
    assert_one_line_error(result, "line 1: turn 2 must be a question or")
