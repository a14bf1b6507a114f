"""The synthetic demo data (scenes and TABED-style task families) is deterministic, held out and factual."""

from __future__ import annotations

import json
import random

import pytest

from mmspec_cli.demo import scenes, tasks

FAMILIES_WITH_LONG_ANSWERS = ("single", "pair", "story", "followup")


def test_same_seed_same_samples_and_same_pixels():
    for name in ("demo-single", "demo-pair", "demo-story", "demo-followup"):
        first, again = tasks.suite(name, 5), tasks.suite(name, 5)
        assert [(s.id, s.turns) for s in first] == [(s.id, s.turns) for s in again]
        assert [scenes.render(sc).tobytes() for s in first for sc in s.images] == \
               [scenes.render(sc).tobytes() for s in again for sc in s.images]
    assert tasks.training_corpus(30, seed=4) == tasks.training_corpus(30, seed=4)
    assert tasks.training_corpus(30, seed=4) != tasks.training_corpus(30, seed=5)


def test_held_out_seeds_are_disjoint_from_training_seeds():
    held_out = [tasks.SUITE_SEEDS[name] for name in tasks.SUITE_SEEDS] + [tasks.QUALITY_SEEDS]
    for seeds in held_out:
        assert seeds.start >= tasks.TRAIN_SEEDS.stop
    ranges = sorted(held_out, key=lambda r: r.start)
    assert all(a.stop <= b.start for a, b in zip(ranges, ranges[1:]))  # suites do not overlap each other
    assert all(s.seed in tasks.TRAIN_SEEDS for s in tasks.training_corpus(200, seed=0))
    assert all(s.seed >= tasks.HELDOUT_SEED_START for s in tasks.suite("demo-all", 3))


def test_image_counts_per_family():
    assert {len(s.images) for s in tasks.suite("demo-single", 10)} == {1}
    assert {len(s.images) for s in tasks.suite("demo-pair", 10)} == {2}
    assert {len(s.images) for s in tasks.suite("demo-story", 10)} == {5}
    followups = tasks.suite("demo-followup", 10)
    assert {len(s.images) for s in followups} == {1} and {len(s.turns) for s in followups} == {2}
    assert len(tasks.suite("demo-all", 4)) == 16


@pytest.mark.parametrize("family", FAMILIES_WITH_LONG_ANSWERS)
def test_answers_are_long_enough_to_speculate_on_and_varied(family):
    samples = [tasks.make_sample(family, seed) for seed in range(60)]
    lengths = [tasks.word_count(a) for s in samples for a in s.answers]
    assert min(lengths) >= tasks.MIN_WORDS and max(lengths) <= tasks.MAX_WORDS
    content = set(scenes.COLOURS) | set(scenes.KINDS) | set(scenes.PLURALS.values()) | set(tasks.NUMBER_WORDS) | {
        "small", "large", "top", "middle", "bottom", "left", "right", "center", "centre"}
    skeletons = {" ".join("_" if w.lower().strip(".,:;") in content else w for w in a.split())
                 for s in samples for a in s.answers}
    answers = sum(len(s.answers) for s in samples)
    assert len(skeletons) >= 0.8 * answers  # with the scene's words masked, answers still differ in wording


def test_count_answers_state_the_true_count():
    rng = random.Random(0)
    for seed in range(200):
        scene = scenes.random_scene(random.Random(seed))
        question, answer, k = tasks.count_question(scene, rng)
        assert tasks.number(k) in answer.lower().split() or tasks.number(k) in answer.lower()
        if question in ("How many shapes are there?", "How many shapes are in the image?"):
            assert k == len(scene.shapes)


def test_colour_answers_name_the_shapes_colour():
    rng = random.Random(1)
    for seed in range(200):
        scene = scenes.random_scene(random.Random(seed))
        unique = [s for s in scene.shapes if sum(t.kind == s.kind for t in scene.shapes) == 1]
        if not unique:
            continue
        question, answer, colour = tasks.colour_question(scene, rng)
        asked = [s for s in unique if s.kind in question or scenes.PLURALS[s.kind] in question]
        assert colour in {s.colour for s in scene.shapes}
        if asked:
            assert colour == asked[0].colour
        assert tasks.keyword_match(answer, colour)


def test_quality_questions_have_unambiguous_expected_words():
    items = tasks.quality_questions(100)
    assert len(items) == 100
    kinds = {"colour": 0, "count": 0}
    for item in items:
        assert item.expected in scenes.COLOURS or item.expected in tasks.NUMBER_WORDS
        kinds["colour" if item.expected in scenes.COLOURS else "count"] += 1
    assert kinds["colour"] == kinds["count"] == 50
    assert tasks.answer_correct("The triangle is blue.", "blue")
    assert not tasks.answer_correct("It is blue or red.", "blue")
    assert not tasks.keyword_match("three", "two")


def test_pair_answers_describe_the_actual_change():
    for seed in range(50):
        sample = tasks.make_sample("pair", seed)
        before, after = sample.images
        assert before != after  # a controlled change happened


def test_story_follows_a_protagonist_across_five_frames():
    sample = tasks.make_sample("story", 3)
    question = sample.turns[0][0]
    assert all(f"Frame {i}" in question for i in range(1, 5))  # captioned frames 1-4 are given as text
    assert "Frame 5" not in question or "frame 5" in question.lower()


def test_images_render_at_the_requested_size():
    scene = tasks.suite("demo-single", 1)[0].images[0]
    assert scenes.render(scene, size=48).size == (48, 48)
    assert scenes.render(scene, size=96).size == (96, 96)
    assert scenes.render(scene).getpixel((0, 0)) != (0, 0, 0)


def test_manifest_round_trip_is_bench_input(tmp_path):
    samples = tasks.suite("demo-pair", 3)
    path = tasks.to_manifest(samples, tmp_path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["id"] for r in rows] == [s.id for s in samples]
    for row, sample in zip(rows, samples):
        assert set(row) == {"id", "images", "turns", "category"}
        assert row["turns"] == sample.questions and len(row["images"]) == 2
        assert all((tmp_path / rel).is_file() for rel in row["images"])
    from mmspec_cli.bench.samples import read_manifest

    assert [s.id for s in read_manifest(path)] == [s.id for s in samples]
