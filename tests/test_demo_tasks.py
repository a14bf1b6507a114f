"""The synthetic demo data: determinism, held-out seeds, factual answers, lengths, variety, manifests."""

from __future__ import annotations

import io
import json
import random
import re

import pytest
from PIL import Image

from mmspec_cli.demo import scenes, tasks
from mmspec_cli.demo.scenes import COLOURS, PLURALS, POSITIONS, Scene, Shape, change, make_story, random_scene, render
from mmspec_cli.demo.tasks import (FAMILIES, NUMBER_WORDS, QUALITY_SEEDS, SUITE_SEEDS, TRAIN_SEEDS, answer_correct,
                                   caption, keyword_match, make_sample, number, quality_questions, suite, to_manifest,
                                   training_corpus, word_count)

N = 150  # samples per family in the sweeps (all of them run in well under a second each)


def png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def samples() -> dict[str, list[tasks.Sample]]:
    return {fam: [make_sample(fam, s) for s in range(N)] for fam in FAMILIES}


# --- determinism and seeds -----------------------------------------------------------------------

def test_same_seed_same_samples_and_image_bytes():
    for fam in FAMILIES:
        a, b = make_sample(fam, 12345), make_sample(fam, 12345)
        assert a == b
        assert [png_bytes(render(s)) for s in a.images] == [png_bytes(render(s)) for s in b.images]
    assert suite("demo-all", 3) == suite("demo-all", 3)
    assert training_corpus(30, seed=4) == training_corpus(30, seed=4)
    assert training_corpus(30, seed=4) != training_corpus(30, seed=5)
    assert random_scene(7) == random_scene(random.Random(7))


def test_no_global_random_state_used():
    random.seed(1)
    a = make_sample("story", 3)
    random.seed(2)
    assert make_sample("story", 3) == a


def test_heldout_seeds_disjoint_from_training():
    ranges = [TRAIN_SEEDS, QUALITY_SEEDS, *SUITE_SEEDS.values()]
    for i, r in enumerate(ranges):
        for other in ranges[i + 1:]:
            assert r.stop <= other.start or other.stop <= r.start
    assert TRAIN_SEEDS == range(0, 10**6)
    assert all(r.start >= 10**9 for r in [QUALITY_SEEDS, *SUITE_SEEDS.values()])
    held = suite("demo-all", 5)
    assert len(held) == 20 and all(s.seed >= 10**9 for s in held)
    corpus = training_corpus(200, seed=0)
    assert all(s.seed in TRAIN_SEEDS for s in corpus)
    assert {s.family for s in corpus} == set(FAMILIES)
    assert not {(s.family, s.seed) for s in corpus} & {(s.family, s.seed) for s in held}


def test_suites():
    assert len(suite("demo-single")) == tasks.DEFAULT_SUITE_SIZE
    for name, fam in tasks.SUITE_FAMILIES.items():
        got = suite(name, 4)
        assert [s.family for s in got] == [fam] * 4
        assert len({s.id for s in got}) == 4
    assert [s.family for s in suite("demo-all", 2)] == ["single"] * 2 + ["pair"] * 2 + ["story"] * 2 + ["followup"] * 2
    with pytest.raises(ValueError, match="unknown suite"):
        suite("demo-nope")
    with pytest.raises(ValueError, match="unknown family"):
        make_sample("nope", 0)


# --- structure -----------------------------------------------------------------------------------

def test_image_and_turn_counts(samples):
    for fam, xs in samples.items():
        for x in xs:
            assert len(x.images) == tasks.FAMILY_IMAGES[fam]
            assert len(x.turns) == (2 if fam == "followup" else 1)
            assert x.id == f"{fam}-{x.seed}"
            for scene in x.images:
                assert 1 <= len(scene) <= scenes.MAX_SHAPES


def test_render_size_and_colours():
    scene = Scene((Shape("square", "red", "large", 0), Shape("circle", "blue", "small", 4),
                   Shape("cross", "green", "large", 8)))
    for size in (48, 30, 96):
        img = render(scene, size)
        assert img.size == (size, size) and img.mode == "RGB"
    img = render(scene)  # 48 px: cells of 16 px, centres at 8, 24, 40
    assert img.getpixel((8, 8)) == COLOURS["red"]
    assert img.getpixel((24, 24)) == COLOURS["blue"]
    assert img.getpixel((40, 40)) == COLOURS["green"]
    assert img.getpixel((40, 8)) == scenes.BACKGROUND  # empty top right
    assert img.getpixel((35, 35)) == scenes.BACKGROUND  # between the cross's arms
    # a small shape covers about half a cell's width, a large one most of it
    row = [img.getpixel((x, 24)) for x in range(16, 32)]
    assert 6 <= sum(p == COLOURS["blue"] for p in row) <= 10
    row = [img.getpixel((x, 8)) for x in range(0, 16)]
    assert sum(p == COLOURS["red"] for p in row) >= 11


def test_colours_far_apart():
    vals = list(COLOURS.values())
    for i, a in enumerate(vals):
        assert sum((x - 255) ** 2 for x in a) ** 0.5 > 100  # far from the white background
        for b in vals[i + 1:]:
            assert sum((x - y) ** 2 for x, y in zip(a, b)) ** 0.5 > 90


# --- scene pairs and stories ---------------------------------------------------------------------

@pytest.mark.parametrize("kind", scenes.CHANGE_KINDS)
def test_change_does_what_it_says(kind):
    rng = random.Random(kind)
    done = 0
    for seed in range(200):
        scene = random_scene(seed)
        if kind not in scenes.possible_changes(scene):
            continue
        new, c = change(scene, rng, kind)
        done += 1
        assert c.kind == kind and 1 <= len(new) <= scenes.MAX_SHAPES
        if kind == "add":
            assert c.before is None and new.shapes == scene.plus(c.after).shapes and scene.at(c.after.cell) is None
            assert c.after.position in c.description
        elif kind == "remove":
            assert c.after is None and new == scene.without(c.before) and c.before.position in c.description
        else:
            assert new == scene.swap(c.before, c.after)
            diff = {f for f in ("kind", "colour", "size", "cell") if getattr(c.before, f) != getattr(c.after, f)}
            assert diff == {{"move": "cell", "recolour": "colour", "resize": "size"}[kind]}
            assert c.before.colour in c.description and c.before.kind in c.description
    assert done > 50


def test_stories_are_consistent():
    for seed in range(100):
        story = make_story(seed)
        assert len(story.frames) == len(story.captions) == len(story.path) == 5
        hero = [story.hero(i) for i in range(5)]
        assert [h.cell for h in hero] == list(story.path)
        for i in range(1, 5):
            a, b = story.path[i - 1], story.path[i]
            assert a == b or b in scenes.neighbours(a)
            if a != b:
                assert POSITIONS[b] in story.captions[i]
        assert story.protagonist.colour in story.captions[0] and story.protagonist.position in story.captions[0]
        if story.theme == "meeting":
            assert story.path[-1] in scenes.neighbours(story.friend.cell)
        if story.theme == "visitor":
            assert len(story.frames[4]) == len(story.frames[3]) + 1
        if story.theme == "recolour":
            assert hero[4].colour != hero[3].colour and hero[4].colour in story.captions[4]


# --- answers: factual ----------------------------------------------------------------------------

_COUNT_Q = [
    (re.compile(r"^How many shapes (are there|are in the image)\?$|^Count the shapes in the picture"), lambda m: {}),
    (re.compile(r"How many ({c}) shapes are there\?|How many shapes in the image are ({c})\?|Count the ({c}) shapes"
                .format(c="|".join(COLOURS))),
     lambda m: {"colour": next(g for g in m.groups() if g)}),
    (re.compile(r"How many (circles|squares|triangles|crosses)"),
     lambda m: {"kind": {v: k for k, v in PLURALS.items()}[m.group(1)]}),
    (re.compile(r"How many (large|small) shapes|shapes in the picture are (large|small)"),
     lambda m: {"size": next(g for g in m.groups() if g)}),
]


def asked_cell(question: str) -> int:
    return POSITIONS.index(re.search(r"in the ([a-z ]+)\?$", question).group(1))


def expected_count(scene: Scene, question: str) -> int:
    for pattern, filt in _COUNT_Q:
        m = pattern.search(question)
        if m:
            return scene.count(**filt(m))
    raise AssertionError(f"unparsed count question {question!r}")


def test_single_answers_match_the_scene(samples):
    seen = set()
    for x in samples["single"]:
        scene, (q, a) = x.images[0], x.turns[0]
        seen.add(x.category)
        if x.category == "count":
            k = expected_count(scene, q)
            assert answer_correct(a, number(k)), (q, a, k)
        elif x.category == "colour":
            m = re.search(r"the (circle|square|triangle|cross)( have)?\?$", q)
            shape = scene.select(kind=m.group(1))[0] if m else scene.at(asked_cell(q))
            assert answer_correct(a, shape.colour), (q, a)
            assert shape.position in a
        elif x.category == "describe":
            assert keyword_match(a, number(len(scene))) or len(scene) == 1
            for s in scene.shapes:
                assert f"{s.size} {s.colour} {s.kind}" in a and s.position in a
        elif x.category == "shape":
            shape = scene.at(POSITIONS.index(re.search(r"in the ([a-z ]+?)( of the image)?\?$", q).group(1)))
            assert a.endswith(f"a {shape.kind}.") and shape.colour in a
        elif x.category == "position":
            colour, kind = re.search(r"the (\w+) (\w+)\?$", q).groups()
            (shape,) = scene.select(colour=colour, kind=kind)
            assert f"the {shape.position}" in a.split(". ")[-1]
        elif x.category == "largest":
            (big,) = scene.select(size="large")
            assert f"the {big.noun()}" in a.split(". ")[-1]
        elif x.category == "presence":
            colour, kind = re.search(r" an? (\w+) (circle|square|triangle|cross)\b", q).groups()
            present = scene.count(colour=colour, kind=kind) > 0
            assert a.startswith("Yes") == present and a.endswith("yes." if present else "no.")
    assert {"describe", "count", "colour", "shape", "position", "presence"} <= seen


def test_pair_answers_name_every_difference(samples):
    for x in samples["pair"]:
        first, second = x.images
        assert first != second
        a = x.answers[0]
        for cell in range(9):
            before, after = first.at(cell), second.at(cell)
            if before != after:
                assert POSITIONS[cell] in a, (x.id, cell, a)
                for s in (before, after):
                    if s is not None:
                        assert s.kind in a
            if before is not None and before == after and x.category == "edit":
                assert f"Move the {before.noun()} from the {before.position}" not in a


def test_story_answers_describe_frame_five(samples):
    for x in samples["story"]:
        q, a = x.turns[0]
        assert [f"Frame {i}:" in q for i in range(1, 6)] == [True] * 4 + [False]
        assert "frame 5" in q
        last = x.images[4]
        assert any(s.position in a and s.kind in a for s in last.shapes)
        if x.category in ("recolour", "grow", "journey", "meeting"):
            story = make_story(random.Random(f"mmspec-demo:story:{x.seed}"))
            assert story.hero(4).position in a and story.hero(4).kind in a
            if x.category == "recolour":
                assert story.hero(4).colour in a
        else:  # visitor: the newcomer is named with its position
            (new,) = set(last.shapes) - set(x.images[3].shapes)
            assert f"{new.indefinite()} " in a and new.position in a


def test_followup_answers(samples):
    for x in samples["followup"]:
        scene = x.images[0]
        (q1, a1), (q2, a2) = x.turns
        n = len(scene)
        if q1.startswith("How many"):
            assert answer_correct(a1, number(n))
        m = re.search(r"If (\w+) more (\w+) shapes? (?:was|were) added, how many shapes", q2) or \
            re.search(r"Suppose we add (\w+) more (\w+) shapes?\. How many shapes", q2)
        if m:
            k = NUMBER_WORDS.index(m.group(1))
            assert keyword_match(a2, number(n + k)) and a2.count(number(n + k)) >= 2
        m = re.search(r"how many (\w+) shapes would there be|How many (\w+) shapes would there be", q2)
        if m:
            colour = next(g for g in m.groups() if g)
            k = NUMBER_WORDS.index(re.search(r"(?:If|add) (\w+) more", q2).group(1))
            assert keyword_match(a2, number(scene.count(colour=colour) + k))
        if "removed" in q2 or "take away" in q2:
            assert keyword_match(a2, number(n - 1))
        if "doubled" in q2 or "twin" in q2:
            assert keyword_match(a2, number(2 * n))
        if "empty" in q2 and "cells" in q2:
            assert keyword_match(a2, number(9 - n))
        side = re.search(r"(on the left|on the right|at the top|at the bottom)", q2)
        if side:
            test = {"on the left": lambda s: s.col == 0, "on the right": lambda s: s.col == 2,
                    "at the top": lambda s: s.row == 0, "at the bottom": lambda s: s.row == 2}[side.group(1)]
            matches = [s for s in scene.shapes if test(s)]
            if not matches:
                assert "none of them" in a2
            for s in matches:
                assert s.noun() in a2


def test_captions_list_every_shape(samples):
    for x in samples["caption"]:
        scene, (q, a) = x.images[0], x.turns[0]
        assert q == tasks.CAPTION_QUESTION and a == caption(scene)
        assert a.count(".") == 1 and word_count(a) <= 40
        for s in scene.shapes:
            assert f"{s.size} {s.colour} {s.kind} in the {s.position}" in a


# --- answers: length and variety -----------------------------------------------------------------

def test_answer_lengths(samples):
    for fam in ("single", "pair", "story", "followup"):
        for x in samples[fam]:
            for q, a in x.turns:
                assert tasks.MIN_WORDS <= word_count(a) <= tasks.MAX_WORDS, (x.id, word_count(a), a)


def test_counts_are_words_not_digits(samples):
    for fam, xs in samples.items():
        for x in xs:
            for a in x.answers:
                assert not re.search(r"\d", a), a


@pytest.mark.parametrize("family,minimum", [("single", 12), ("pair", 12), ("story", 5), ("followup", 8)])
def test_variety(samples, family, minimum):
    xs = samples[family][:50]
    openings = {" ".join(x.answers[-1].split()[:3]) for x in xs}
    assert len(openings) >= minimum, openings
    assert len({x.answers[-1] for x in xs}) == 50
    assert len({x.category for x in xs}) >= 2


# --- quality questions ---------------------------------------------------------------------------

def test_quality_questions():
    qs = quality_questions(40)
    assert len(qs) == 40 and quality_questions(40) == qs
    for i, (scene, question, expected) in enumerate(qs):
        if i % 2 == 0:
            assert expected in COLOURS and "colour" in question
            m = re.search(r"the (circle|square|triangle|cross)( have)?\?$", question)
            if m:
                (shape,) = scene.select(kind=m.group(1))
                assert shape.colour == expected
            else:
                assert scene.at(asked_cell(question)).colour == expected
        else:
            assert expected in NUMBER_WORDS[1:] and question.startswith(("How many", "Count"))
            assert number(expected_count(scene, question)) == expected
        _, reference = tasks.quality_item(QUALITY_SEEDS[i], "colour" if i % 2 == 0 else "count")
        assert answer_correct(reference, expected), reference


def test_keyword_checks():
    assert keyword_match("So the answer is Red.", "red") and not keyword_match("It is reddish.", "red")
    assert answer_correct("There are three shapes.", "three")
    assert not answer_correct("There are three shapes, or maybe two.", "three")
    assert not answer_correct("It is blue, not red.", "red")
    assert keyword_match("It is blue, not red.", "red")
    assert tasks.final_answer("It looks blue at first. So the answer is red.", "red") == "red"
    assert tasks.final_answer("There is one circle and one square. So there are two shapes.", "two") == "two"
    assert tasks.final_answer("So the answer is three.", "two") == "three"
    assert tasks.final_answer("I do not know.", "red") is None


def test_reference_answers_pass_both_checks():
    for seed in tasks.QUALITY_SEEDS[:300]:
        for kind in ("colour", "count"):
            q, a = tasks.quality_item(seed, kind)
            assert answer_correct(a, q.expected) and tasks.final_answer(a, q.expected) == q.expected, (q, a)


# --- manifest ------------------------------------------------------------------------------------

def test_manifest_round_trip(tmp_path):
    xs = suite("demo-all", 2)
    path = to_manifest(xs, tmp_path / "m", size=32, references=True)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == len(xs)
    for row, x in zip(rows, xs):
        assert set(row) == {"id", "images", "turns", "category", "answers"}
        assert row["id"] == x.id and row["turns"] == x.questions and row["category"] == x.category
        assert row["answers"] == x.answers and len(row["images"]) == len(x.images)
        for rel, scene in zip(row["images"], x.images):
            assert not rel.startswith("/")
            with Image.open(path.parent / rel) as img:
                assert img.size == (32, 32)
                assert img.convert("RGB").tobytes() == render(scene, 32).tobytes()
    plain = to_manifest(xs[:1], tmp_path / "p")
    assert set(json.loads(plain.read_text())) == {"id", "images", "turns", "category"}
    from mmspec_cli.inputs.samples import read_manifest  # the manifest is mmspec bench's own input format

    assert [s.id for s in read_manifest(path)] == [x.id for x in xs]
