"""Task families on synthetic scenes, mirroring the input scenarios of TABED §4.1 / App. J.

Families (each a function of an integer seed, deterministic):

- ``single`` (LLaVA-Bench / POPE / MMVet style): one image; a detailed description, or a
  question with a reasoned answer (counts, colours, positions, shape kinds, largest shape,
  yes/no presence).
- ``pair`` (Spot-the-Difference / IEdit / MagicBrush): two images that differ by one or two
  controlled changes; "what changed?" or an edit instruction.
- ``story`` (PororoSV / VIST, the out-of-distribution case): five frames; the question holds
  the captions of frames 1-4 and asks what happens in frame 5.
- ``followup`` (multi-turn): a description or count, then a second turn that depends on the
  first answer: about the image ("which of those shapes is on the left?") or text-only
  arithmetic about the counts.
- ``caption``: "Describe the image in one sentence." -> one short caption (for captioners).

Answers of families 1-4 are 30-100 crude tokens (``word_count``: words and punctuation marks,
about 40-120 tokenizer tokens), drawn from several phrasing templates per sentence with
optional clauses, and every fact in them (counts, colours, sizes, positions) is read off the
scene objects. Counts are always written as words (``NUMBER_WORDS``: "zero" .. "twelve"),
never digits; frame numbers in stories ("frame 5") are indices, not counts.

Seeds: training uses ``TRAIN_SEEDS`` = [0, 10**6); held-out suites and the quality questions
use disjoint ranges starting at ``HELDOUT_SEED_START`` = 10**9, so no held-out sample is a
training sample. A sample's randomness comes from ``random.Random(f"mmspec-demo:{family}:{seed}")``,
so the same seed gives unrelated samples in different families.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from mmspec_cli.demo.scenes import (COLOURS, COLUMNS, KINDS, PLURALS, POSITIONS, ROWS, Change, Scene, Shape, change,
                                    direction, make_story, neighbours, random_scene, refer, render)

# --- seeds and suites ----------------------------------------------------------------------------

TRAIN_SEEDS = range(0, 10**6)
HELDOUT_SEED_START = 10**9
_STRIDE = 10**6
SUITE_FAMILIES: dict[str, str] = {
    "demo-single": "single",
    "demo-pair": "pair",
    "demo-story": "story",
    "demo-followup": "followup",
}
SUITE_SEEDS: dict[str, range] = {
    name: range(HELDOUT_SEED_START + i * _STRIDE, HELDOUT_SEED_START + (i + 1) * _STRIDE)
    for i, name in enumerate(SUITE_FAMILIES)
}
QUALITY_SEEDS = range(HELDOUT_SEED_START + 4 * _STRIDE, HELDOUT_SEED_START + 5 * _STRIDE)
EXAMPLE_SEED = HELDOUT_SEED_START + 5 * _STRIDE  # the images in examples/ (mmspec_cli.demo.examples)
SUITES: tuple[str, ...] = (*SUITE_FAMILIES, "demo-all")
DEFAULT_SUITE_SIZE = 50  # per suite; docs/BENCHMARKS.md shows how the verdicts depend on it
FAMILIES: tuple[str, ...] = ("single", "pair", "story", "followup", "caption")
FAMILY_IMAGES: dict[str, int] = {"single": 1, "pair": 2, "story": 5, "followup": 1, "caption": 1}
TRAINING_WEIGHTS: dict[str, float] = {"single": 35, "pair": 20, "story": 10, "followup": 20, "caption": 15}
MIN_WORDS, MAX_WORDS = 30, 100  # answer length of families 1-4, in word_count units
CAPTION_QUESTION = "Describe the image in one sentence."

NUMBER_WORDS: tuple[str, ...] = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight",
                                 "nine", "ten", "eleven", "twelve")

_TOKEN = re.compile(r"\w+|[^\w\s]")


def word_count(text: str) -> int:
    """Crude token count: runs of word characters plus single punctuation marks."""
    return len(_TOKEN.findall(text))


def number(n: int) -> str:
    return NUMBER_WORDS[n]


# --- samples -------------------------------------------------------------------------------------

@dataclass
class Sample:
    id: str
    family: str  # one of FAMILIES
    category: str  # finer task type, e.g. 'describe', 'count', 'difference', 'edit', 'story', 'followup-text'
    images: list[Scene]
    turns: list[tuple[str, str]]  # (question, reference answer) per turn
    seed: int = 0

    @property
    def questions(self) -> list[str]:
        return [q for q, _ in self.turns]

    @property
    def answers(self) -> list[str]:
        return [a for _, a in self.turns]


def _rng(family: str, seed: int) -> random.Random:
    return random.Random(f"mmspec-demo:{family}:{seed}")


# --- text helpers --------------------------------------------------------------------------------

def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def _low(text: str) -> str:
    return text[:1].lower() + text[1:]


def _join(items: Sequence[str]) -> str:
    items = list(items)
    if len(items) <= 1:
        return "".join(items)
    return ", ".join(items[:-1]) + " and " + items[-1]


def _be(k: int) -> str:
    return "is" if k == 1 else "are"


def _shapes_word(k: int) -> str:
    return "shape" if k == 1 else "shapes"


def _at(shape: Shape) -> str:
    """'a large red circle in the top left'."""
    return f"{shape.indefinite()} in the {shape.position}"


def _the_at(shape: Shape) -> str:
    """'the red circle in the top left' (always unambiguous: one shape per cell)."""
    return f"the {shape.noun()} in the {shape.position}"


class _Text:
    """Sentences, some optional, fitted to MIN_WORDS..MAX_WORDS crude tokens."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.items: list[tuple[str, float | None]] = []

    def add(self, text: str, p: float | None = None) -> None:
        """A required sentence, or (``p`` given) an optional one kept with probability ``p``."""
        self.items.append((text, p))

    def build(self, lo: int = MIN_WORDS, hi: int = MAX_WORDS) -> str:
        keep = [p is None or self.rng.random() < p for _, p in self.items]
        sizes = [word_count(t) for t, _ in self.items]

        def total():
            return sum(s for s, k in zip(sizes, keep) if k)

        for i, (_, p) in enumerate(self.items):  # too short: bring back skipped clauses in order
            if total() >= lo:
                break
            keep[i] = True
        for i in reversed(range(len(self.items))):  # too long: drop optional clauses from the end
            if total() <= hi:
                break
            if self.items[i][1] is not None:
                keep[i] = False
        return " ".join(t for (t, _), k in zip(self.items, keep) if k)


# --- single image: description -------------------------------------------------------------------

def describe(scene: Scene, rng: random.Random) -> str:
    """A detailed description: how many shapes, each shape in reading order, then summaries."""
    t = _Text(rng)
    n = len(scene)
    if n == 1:
        t.add(rng.choice((
            "The image shows a single shape on a plain white background.",
            "There is only one shape in this picture.",
            "This picture contains just one shape, drawn on a white background.",
            "I can see a single shape in the image.",
        )))
    else:
        t.add(rng.choice((
            f"The image shows {number(n)} shapes on a plain white background.",
            f"There are {number(n)} shapes in this picture.",
            f"This picture contains {number(n)} simple shapes, drawn on a white background.",
            f"I can see {number(n)} shapes in the image.",
            f"In this image, {number(n)} shapes are arranged on a grid.",
        )))
        t.add(rng.choice(("Going from the top left to the bottom right, here they are.",
                          "Let me describe them in reading order.",
                          "I will go through them row by row.")), 0.35)
    for i, s in enumerate(scene.shapes):
        a, pos = s.indefinite(), s.position
        sentence = rng.choice((
            f"In the {pos} there is {a}.",
            f"{_cap(a)} sits in the {pos}.",
            f"The {pos} holds {a}.",
            f"At the {pos}, you can see {a}.",
            f"{_cap(a)} is placed in the {pos}.",
        ))
        if n > 1 and i == n - 1 and rng.random() < 0.5:
            sentence = "Finally, " + _low(sentence)
        elif n > 2 and 0 < i < n - 1 and rng.random() < 0.3:
            sentence = rng.choice(("Next, ", "After that, ")) + _low(sentence)
        t.add(sentence)
    if n == 1:
        s = scene.shapes[0]
        t.add(f"It is {s.size}, so it fills {'most' if s.size == 'large' else 'about half'} of its cell.", 0.6)
        t.add(rng.choice(("The rest of the picture is empty.", "Nothing else appears in the picture.",
                          "All the other cells of the grid are empty.")), 0.7)
        t.add(f"Its colour, {s.colour}, stands out clearly against the white background.", 0.5)
    else:
        colours = list(dict.fromkeys(s.colour for s in scene.shapes))
        if len(colours) == 1:
            t.add(f"{'Both' if n == 2 else 'All ' + number(n)} shapes are {colours[0]}.", 0.6)
        else:
            for c in colours:
                k = scene.count(colour=c)
                if k > 1:
                    t.add(rng.choice((f"{_cap(number(k))} of the shapes are {c}.",
                                      f"The colour {c} appears {number(k)} times.")), 0.6)
            t.add(rng.choice((f"The colours used are {_join(colours)}.",
                              f"The picture uses {number(len(colours))} colours: {_join(colours)}.")), 0.4)
        for kind in KINDS:
            k = scene.count(kind=kind)
            if k > 1:
                t.add(f"There are {number(k)} {PLURALS[kind]} in total.", 0.5)
        large = scene.count(size="large")
        if large == 0:
            t.add("All of them are small.", 0.5)
        elif large == n:
            t.add("All of them are large.", 0.5)
        else:
            small = n - large
            t.add(f"{_cap(number(large))} of them {_be(large)} large and {number(small)} {_be(small)} small.", 0.5)
        if scene.at(4) is None:
            t.add("The center of the picture is empty.", 0.3)
        t.add(rng.choice(("That is everything in the image.", "Nothing else appears in the picture.",
                          "The rest of the grid is empty.")), 0.4)
    return t.build()


# --- single image: questions with reasoned answers -----------------------------------------------

def _count_filter(scene: Scene, rng: random.Random, present: bool | None = None) -> tuple[str, dict, str, str]:
    """(what, filter kwargs, noun singular, noun plural) for a count question."""
    what = rng.choices(("all", "colour", "kind", "size"), weights=(35, 35, 20, 10))[0]
    if what == "all":
        return what, {}, "shape", "shapes"
    if what == "colour":
        here = sorted({s.colour for s in scene.shapes}, key=list(COLOURS).index)
        absent = [c for c in COLOURS if c not in here]
        want_present = present if present is not None else (rng.random() < 0.8 or not absent)
        c = rng.choice(here if want_present else absent)
        return what, {"colour": c}, f"{c} shape", f"{c} shapes"
    if what == "kind":
        here = sorted({s.kind for s in scene.shapes}, key=KINDS.index)
        k = rng.choice(here if (rng.random() < 0.85 or len(here) == 4) else [k for k in KINDS if k not in here])
        return what, {"kind": k}, k, PLURALS[k]
    size = rng.choice(("large", "small"))
    return what, {"size": size}, f"{size} shape", f"{size} shapes"


def count_question(scene: Scene, rng: random.Random,
                   what: tuple[str, dict, str, str] | None = None) -> tuple[str, str, int]:
    """(question, answer, count). The answer's only number word is the count."""
    what, filt, one, many = what or _count_filter(scene, rng)
    matches = scene.select(**filt)
    others = [s for s in scene.shapes if s not in matches]
    k = len(matches)
    if what == "all":
        q = rng.choice(("How many shapes are there?", "How many shapes are in the image?",
                        "Count the shapes in the picture. How many are there?"))
    elif what == "colour":
        c = filt["colour"]
        q = rng.choice((f"How many {c} shapes are there?", f"How many shapes in the image are {c}?",
                        f"Count the {c} shapes. How many are there?"))
    elif what == "kind":
        q = rng.choice((f"How many {many} are there?", f"How many {many} can you see in the image?"))
    else:
        q = rng.choice((f"How many {many} are there?", f"How many shapes in the picture are {filt['size']}?"))
    t = _Text(rng)
    if what == "all":
        t.add(rng.choice(("To answer this, I will go through the picture from the top left to the bottom right.",
                          "Let me look at every cell of the grid in turn.",
                          "I will count the shapes by scanning the image row by row.")))
        if rng.random() < 0.5:
            t.add(f"I can see {_join([_at(s) for s in matches])}.")
        else:
            for i, s in enumerate(matches):
                t.add(f"There is {'also ' if i else ''}{_at(s)}.")
        t.add(rng.choice(("Each of them sits in its own cell of the grid.",
                          "The other cells of the grid are empty.")), 0.5)
    else:
        prop = {"colour": "colour", "kind": "kind", "size": "size"}[what]
        t.add(rng.choice((f"To answer this, I look at each shape in the image and check its {prop}.",
                          f"Let me check the {prop} of every shape in the picture.",
                          f"I will go through the shapes from the top left to the bottom right and look at their {prop}.")))
        if k == 0:
            t.add(f"None of the shapes is {'a ' + one if what == 'kind' else one.split()[0]}.")
        elif rng.random() < 0.5:
            if k == 1:
                t.add(f"The only {one} is {_at(matches[0])}.")
            else:
                t.add(f"The {many} are {_join([_at(s) for s in matches])}.")
        else:
            for i, s in enumerate(matches):
                t.add(f"There is {'also ' if i else ''}{_at(s)}.")
        if others:
            if len(others) == 1:
                o = others[0]
                reason = {"colour": f"it is {o.colour}", "kind": f"it is a {o.kind}", "size": f"it is {o.size}"}[what]
                t.add(f"The {o.noun()} in the {o.position} does not count, because {reason}.", 0.7)
            else:
                t.add(f"The other shapes, {_join([o.indefinite() for o in others])}, do not count.", 0.7)
        t.add(rng.choice(("I check every cell of the grid so that no shape is missed.",
                          "The empty cells of the grid do not matter here.")), 0.3)
    if k == 0:
        concl = (f"So there are zero {many}.", f"That makes zero {many} in total.", "So the answer is zero.")
    elif k == 1:
        concl = (f"So there is one {one} in total.", f"That makes one {one}.", f"In total, I count one {one}.",
                 "So the answer is one.")
    else:
        concl = (f"So there are {number(k)} {many} in total.", f"That makes {number(k)} {many}.",
                 f"In total, I count {number(k)} {many}.", f"So the answer is {number(k)}.")
    t.add(rng.choice(concl))
    return q, t.build(), k


def _unique_kind_shapes(scene: Scene) -> list[Shape]:
    return [s for s in scene.shapes if scene.count(kind=s.kind) == 1]


def colour_question(scene: Scene, rng: random.Random) -> tuple[str, str, str]:
    """(question, answer, colour). No other colour word than the answer appears in the answer."""
    unique = _unique_kind_shapes(scene)
    by_kind = bool(unique) and rng.random() < 0.6
    t = _Text(rng)
    n = len(scene)
    if by_kind:
        s = rng.choice(unique)
        q = rng.choice((f"What colour is the {s.kind}?", f"What is the colour of the {s.kind}?",
                        f"Which colour does the {s.kind} have?"))
        t.add(rng.choice((f"There is only one {s.kind} in the image, so the question is about that shape.",
                          f"First I need to find the {s.kind} in the picture.",
                          f"To answer this, I look for the {s.kind}.")))
        t.add(rng.choice((f"It sits in the {s.position} of the picture.", f"The {s.kind} is located in the {s.position}.",
                          f"I can find it in the {s.position}.")))
        t.add(f"It is a {s.size} {s.kind}.", 0.5)
    else:
        s = rng.choice(scene.shapes)
        q = rng.choice((f"What colour is the shape in the {s.position}?",
                        f"What is the colour of the shape in the {s.position}?"))
        t.add(rng.choice((f"I look at the {s.position} of the image.",
                          f"The question asks about the {s.position} cell of the grid.",
                          f"To answer this, I find the shape in the {s.position}.")))
        t.add(rng.choice((f"There I find a {s.size} {s.kind}.", f"The shape there is a {s.size} {s.kind}.")))
    t.add(rng.choice((f"Looking at its colour, it is clearly {s.colour}.", f"Its colour is {s.colour}.",
                      f"It is filled with a solid {s.colour} colour.")))
    if n == 1:
        t.add("It is the only shape in the picture.", 0.5)
    else:
        t.add(f"It shares the picture with {number(n - 1)} other {_shapes_word(n - 1)}.", 0.5)
    subject = f"the {s.kind}" if by_kind else f"the shape in the {s.position}"
    t.add(rng.choice((f"So {subject} is {s.colour}.", f"Therefore, the answer is {s.colour}.",
                      f"So the answer is {s.colour}.")))
    return q, t.build(), s.colour


def _unique_noun_shapes(scene: Scene) -> list[Shape]:
    return [s for s in scene.shapes if scene.count(colour=s.colour, kind=s.kind) == 1]


def position_question(scene: Scene, rng: random.Random) -> tuple[str, str]:
    s = rng.choice(_unique_noun_shapes(scene))
    q = rng.choice((f"Where is the {s.noun()}?", f"Where in the image is the {s.noun()}?",
                    f"In which part of the picture is the {s.noun()}?"))
    t = _Text(rng)
    t.add(rng.choice((f"I need to find the {s.noun()} in the image.", f"Let me look for the {s.noun()}.",
                      f"To answer this, I search the picture for the {s.noun()}.")))
    t.add(rng.choice((f"It is in the {ROWS[s.row]} row of the grid, in the {COLUMNS[s.col]} column.",
                      f"It sits in the {COLUMNS[s.col]} column and the {ROWS[s.row]} row.")))
    t.add(f"It is {s.size}, and it is the only {s.noun()} in the picture.", 0.5)
    near = [scene.at(c) for c in neighbours(s.cell) if scene.at(c) is not None]
    if near:
        o = rng.choice(near)
        t.add(f"Right next to it, in the {o.position}, there is {o.indefinite()}.", 0.5)
    t.add(rng.choice((f"So the {s.noun()} is in the {s.position} of the picture.",
                      f"That means it is in the {s.position}.", f"So the answer is the {s.position}.")))
    return q, t.build()


_KIND_FEATURES = {
    "circle": ("It is perfectly round, with no corners.", "Its outline is a smooth curve without any corners."),
    "square": ("It has four equal sides and four corners.", "Its sides are straight and all the same length."),
    "triangle": ("It has three straight sides and a pointed top.", "It has three corners, with one pointing up."),
    "cross": ("It is made of two bars that cross in the middle, like a plus sign.",
              "It looks like a plus sign, with four short arms."),
}


def shape_question(scene: Scene, rng: random.Random) -> tuple[str, str]:
    s = rng.choice(scene.shapes)
    q = rng.choice((f"What shape is in the {s.position}?", f"Which shape can you see in the {s.position}?",
                    f"What kind of shape is in the {s.position} of the image?"))
    t = _Text(rng)
    t.add(rng.choice((f"I look at the {s.position} of the image.", f"To answer this, I check the {s.position} cell.",
                      f"Let me look at the {s.position} of the picture.")))
    t.add(rng.choice((f"There is {s.indefinite()} there.", f"The shape there is {s.indefinite()}.")))
    t.add(rng.choice(_KIND_FEATURES[s.kind]))
    t.add(f"Its colour is {s.colour} and it is {s.size}.", 0.4)
    t.add(rng.choice((f"So the shape in the {s.position} is a {s.kind}.", f"So the answer is a {s.kind}.",
                      f"Therefore, it is a {s.kind}.")))
    return q, t.build()


def largest_applies(scene: Scene) -> bool:
    return len(scene) >= 2 and scene.count(size="large") == 1


def largest_question(scene: Scene, rng: random.Random) -> tuple[str, str]:
    big = scene.select(size="large")[0]
    small = [s for s in scene.shapes if s != big]
    q = rng.choice(("Which shape is the largest?", "Which shape is the biggest one in the image?",
                    "Which of the shapes is the largest?"))
    t = _Text(rng)
    t.add(rng.choice(("To answer this, I compare the sizes of all the shapes.",
                      "Let me compare how big each shape is.",
                      "I look at the size of every shape in the picture.")))
    t.add(rng.choice((f"Only {_the_at(big)} is large; it fills most of its cell.",
                      f"{_cap(_the_at(big))} is large and fills most of its cell.")))
    t.add(rng.choice((f"The other shapes are small: {_join([_at(s).replace(' small', '', 1) for s in small])}.",
                      f"{_cap(_join([s.indefinite(size=False) for s in small]))} {_be(len(small))} all small.")
                     if len(small) > 1 else
                     (f"The other shape, {small[0].indefinite(size=False)} in the {small[0].position}, is small.",
                      f"{_cap(_the_at(small[0]))} is small by comparison.")))
    t.add(rng.choice((f"So the largest shape is the {big.noun()} in the {big.position}.",
                      f"Therefore, the {big.noun()} is the largest shape.",
                      f"So the answer is the {big.noun()}.")))
    return q, t.build()


def presence_question(scene: Scene, rng: random.Random) -> tuple[str, str, bool]:
    """A yes/no question (POPE-like) with a reasoned answer."""
    combos = {(s.colour, s.kind) for s in scene.shapes}
    yes = rng.random() < 0.5
    if yes:
        s = rng.choice(scene.shapes)
        colour, kind = s.colour, s.kind
    else:
        near = [(c, k) for c in COLOURS for k in KINDS if (c, k) not in combos
                and any(c == s.colour or k == s.kind for s in scene.shapes)]
        colour, kind = rng.choice(near)
    noun = f"{colour} {kind}"
    a = f"{'an' if colour == 'orange' else 'a'} {noun}"
    q = rng.choice((f"Is there {a} in the image?", f"Can you see {a} in the picture?", f"Does the image contain {a}?"))
    t = _Text(rng)
    if yes:
        found = scene.select(colour=colour, kind=kind)
        t.add(rng.choice((f"Yes, there is {a} in the image.", f"Yes, the image does contain {a}.")))
        if len(found) == 1:
            t.add(rng.choice((f"It is {found[0].size} and sits in the {found[0].position}.",
                              f"I can see it in the {found[0].position}, where it is {found[0].size}.")))
        else:
            t.add(f"In fact there are {number(len(found))} of them, in the {_join([f.position for f in found])}.")
        t.add(rng.choice(("To check, I looked at the colour and the kind of every shape.",
                          "I checked each shape in the picture to be sure.")), 0.5)
        t.add(f"Besides it, the picture shows {_join([_at(o) for o in scene.shapes if o not in found])}."
              if len(found) < len(scene) else "There are no other shapes in the picture.", 0.6)
        t.add("So the answer is yes.")
    else:
        t.add(rng.choice((f"No, there is no {noun} in the image.", f"No, I cannot see {a} in the picture.")))
        same_kind = scene.select(kind=kind)
        same_colour = scene.select(colour=colour)
        if same_kind:
            s = same_kind[0]
            t.add(f"There is a {kind} in the {s.position}, but it is {s.colour}, not {colour}.")
        if same_colour:
            s = same_colour[0]
            t.add(f"The {colour} shape in the {s.position} is a {s.kind}, not a {kind}.")
        t.add(f"The image only shows {_join([_at(o) for o in scene.shapes])}.", 0.7)
        t.add("So the answer is no.")
    return q, t.build(), yes


SINGLE_CATEGORIES: dict[str, float] = {
    "describe": 30, "count": 20, "colour": 20, "position": 8, "shape": 8, "largest": 5, "presence": 9,
}


def _single(scene: Scene, rng: random.Random, category: str) -> tuple[str, str]:
    if category == "describe":
        q = rng.choice(("Describe the image in detail.", "What is in this image? Please describe it in detail.",
                        "Give a detailed description of the picture.", "What do you see in this picture?"))
        return q, describe(scene, rng)
    if category == "count":
        q, a, _ = count_question(scene, rng)
        return q, a
    if category == "colour":
        q, a, _ = colour_question(scene, rng)
        return q, a
    if category == "position":
        return position_question(scene, rng)
    if category == "shape":
        return shape_question(scene, rng)
    if category == "largest":
        return largest_question(scene, rng)
    if category == "presence":
        q, a, _ = presence_question(scene, rng)
        return q, a
    raise ValueError(f"unknown single-image category {category!r}")


def single_sample(seed: int) -> Sample:
    """Family 1: one image; a detailed description or a question with a reasoned answer."""
    rng = _rng("single", seed)
    scene = random_scene(rng)
    cats = dict(SINGLE_CATEGORIES)
    if not largest_applies(scene):
        del cats["largest"]
    if not _unique_noun_shapes(scene):
        del cats["position"]
    category = rng.choices(list(cats), weights=list(cats.values()))[0]
    q, a = _single(scene, rng, category)
    return Sample(f"single-{seed}", "single", category, [scene], [(q, a)], seed)


# --- two images ----------------------------------------------------------------------------------

def _difference_sentence(c: Change, rng: random.Random) -> str:
    b, a = c.before, c.after
    if c.kind == "move":
        return rng.choice((
            f"The {b.noun()} moved from the {b.position} to the {a.position}.",
            f"In the first image the {b.noun()} is in the {b.position}, but in the second image it is in the {a.position}.",
            f"The {b.noun()} is no longer in the {b.position}; it has moved to the {a.position}.",
        ))
    if c.kind == "recolour":
        return rng.choice((
            f"The {b.kind} in the {b.position} changed colour from {b.colour} to {a.colour}.",
            f"In the first image the {b.kind} in the {b.position} is {b.colour}, while in the second image it is {a.colour}.",
            f"The {b.colour} {b.kind} in the {b.position} has turned {a.colour}.",
        ))
    if c.kind == "remove":
        return rng.choice((
            f"The {b.noun()} in the {b.position} has disappeared in the second image.",
            f"The second image no longer has the {b.noun()}; it was removed from the {b.position}.",
            f"The {b.noun()} that was in the {b.position} is gone.",
        ))
    if c.kind == "add":
        return rng.choice((
            f"{_cap(a.indefinite())} appeared in the {a.position}.",
            f"A new shape was added: {_at(a)}.",
            f"The second image has an extra shape, {_at(a)}.",
        ))
    grew = a.size == "large"
    return rng.choice((
        f"The {b.noun()} in the {b.position} {'grew from small to large' if grew else 'shrank from large to small'}.",
        f"The {b.noun()} in the {b.position} became {'larger' if grew else 'smaller'}.",
        f"In the second image the {b.noun()} in the {b.position} is {a.size} instead of {b.size}.",
    ))


def _edit_sentence(c: Change, rng: random.Random) -> str:
    b, a = c.before, c.after
    if c.kind == "move":
        return rng.choice((f"Move the {b.noun()} from the {b.position} to the {a.position}.",
                           f"Take the {b.noun()} in the {b.position} and move it to the {a.position}."))
    if c.kind == "recolour":
        return rng.choice((f"Change the colour of the {b.noun()} in the {b.position} from {b.colour} to {a.colour}.",
                           f"Paint the {b.noun()} in the {b.position} {a.colour}.",
                           f"Recolour the {b.kind} in the {b.position} so that it becomes {a.colour}."))
    if c.kind == "remove":
        return rng.choice((f"Remove the {b.noun()} from the {b.position}.", f"Delete the {b.noun()} in the {b.position}.",
                           f"Erase the {b.noun()} that sits in the {b.position}."))
    if c.kind == "add":
        return rng.choice((f"Add {_at(a)}.", f"Draw {a.indefinite()} in the empty {a.position} cell.",
                           f"Put {a.indefinite()} in the {a.position}."))
    grew = a.size == "large"
    return rng.choice((f"Make the {b.noun()} in the {b.position} {a.size}.",
                       f"{'Enlarge' if grew else 'Shrink'} the {b.noun()} in the {b.position} so that it is {a.size}."))


def pair_sample(seed: int) -> Sample:
    """Family 2: two images with one or two controlled changes; 'what changed?' or an edit instruction."""
    rng = _rng("pair", seed)
    first = random_scene(rng)
    second, c1 = change(first, rng)
    changes = [c1]
    touched = {s.cell for s in (c1.before, c1.after) if s is not None}
    if rng.random() < 0.3:
        try:
            second, c2 = change(second, rng, avoid=touched)
            changes.append(c2)
        except ValueError:
            pass
    touched = {s.cell for c in changes for s in (c.before, c.after) if s is not None}
    unchanged = [s for s in first.shapes if s.cell not in touched]
    n1, n2 = len(first), len(second)
    category = rng.choice(("difference", "edit"))
    t = _Text(rng)
    if category == "difference":
        q = rng.choice(("What changed between the two images?",
                        "What is the difference between the first and the second image?",
                        "Explain the disparities between the first and second image.",
                        "Spot the difference: what is different in the second image?"))
        t.add(rng.choice(("Comparing the two images cell by cell, I notice the following.",
                          "Let me compare the two pictures shape by shape.",
                          f"The first image has {number(n1)} {_shapes_word(n1)} and the second has {number(n2)}.")), 0.7)
        for i, c in enumerate(changes):
            s = _difference_sentence(c, rng)
            if len(changes) > 1:
                s = ("First, " if i == 0 else "Also, ") + _low(s)
            t.add(s)
        if unchanged:
            t.add(rng.choice((f"Everything else stays the same: {_join([_the_at(s) for s in unchanged])} "
                              f"{'does' if len(unchanged) == 1 else 'do'} not change.",
                              f"{_cap(_join([_the_at(s) for s in unchanged]))} {_be(len(unchanged))} the same in both images.")), 0.7)
        t.add("That is the only difference between the two images." if len(changes) == 1 else
              "Those are the two differences between the images.", 0.5)
    else:
        q = rng.choice(("How do I turn the first image into the second?",
                        "Please provide instructions for editing the source image to match the target image.",
                        "What edit turns the first picture into the second one?",
                        "Give me instructions to change the first image so that it looks like the second."))
        t.add(rng.choice((f"Start from the first image, which has {number(n1)} {_shapes_word(n1)}.",
                          "Only one edit is needed." if len(changes) == 1 else "Two edits are needed.",
                          "To edit the first image into the second, follow these steps.")), 0.8)
        for i, c in enumerate(changes):
            s = _edit_sentence(c, rng)
            if len(changes) > 1:
                s = ("First, " if i == 0 else "Then, ") + _low(s)
            t.add(s)
            t.add(rng.choice(("This is needed because ", "The reason is that ")) + _low(_difference_sentence(c, rng)), 0.35)
        if unchanged:
            t.add(f"Leave {_join([_the_at(s) for s in unchanged])} as {'it is' if len(unchanged) == 1 else 'they are'}.", 0.7)
        t.add(rng.choice((f"After this, the picture has {number(n2)} {_shapes_word(n2)}, just like the second image.",
                          f"The result matches the second image, with {number(n2)} {_shapes_word(n2)}.")), 0.6)
    return Sample(f"pair-{seed}", "pair", category, [first, second], [(q, t.build())], seed)


# --- five images ---------------------------------------------------------------------------------

def story_sample(seed: int) -> Sample:
    """Family 3: five frames; captions of frames 1-4 in the question, frame 5 in the answer."""
    rng = _rng("story", seed)
    story = make_story(rng)
    frames = "\n".join(f"Frame {i}: {c}" for i, c in enumerate(story.captions[:4], 1))
    q = rng.choice((
        f"Given the progression of the story with the first few images, can you write a fitting end "
        f"considering the last image?\n{frames}\nWhat happens in frame 5?",
        f"Here is a story told in five pictures.\n{frames}\nFinish the story: what happens in frame 5?",
        f"With the narratives paired with the initial images, how would you conclude the story using "
        f"the last picture?\n{frames}\nWhat happens in frame 5?",
    ))
    hero0, hero4, hero3 = story.protagonist, story.hero(4), story.hero(3)
    name = f"the {hero0.noun()}"
    bystanders = [s for s in story.frames[0].shapes if s.kind != hero0.kind]
    event = story.events[4]
    t = _Text(rng)
    if event == "move":
        d = direction(hero3.cell, hero4.cell)
        if story.theme == "meeting":
            f = story.friend
            core = rng.choice((f"{name} moves {d} to the {hero4.position} and finally meets the {f.noun()}, "
                               f"which waits in the {f.position}.",
                               f"{name} steps {d} from the {hero3.position} into the {hero4.position}, right next to "
                               f"the {f.noun()}, and the two friends meet."))
        else:
            core = rng.choice((f"{name} takes one more step {d}, from the {hero3.position} to the {hero4.position}.",
                               f"{name} moves {d}{' again' if direction(story.hero(2).cell, hero3.cell) == d else ''} "
                               f"and arrives in the {hero4.position}."))
    elif event == "recolour":
        core = rng.choice((f"{name} stays in the {hero4.position} and changes colour from {hero3.colour} to {hero4.colour}.",
                           f"{name} stops in the {hero4.position} and suddenly turns {hero4.colour}."))
    elif event == "grow":
        core = rng.choice((f"{name} stays in the {hero4.position} and grows from small to large.",
                           f"{name} stops in the {hero4.position} and suddenly becomes large."))
    else:
        v = story.friend
        core = rng.choice((f"{v.indefinite()} appears in the {v.position}, right next to {name}.",
                           f"a visitor arrives: {v.indefinite()} shows up in the {v.position} to meet {name}."))
    t.add(rng.choice(("In the fifth frame, ", "In the last frame, ", "At the end of the story, ", "To finish the story, ",
                      "The story ends like this: ", "In the fifth picture, ")) + core)
    visited = list(dict.fromkeys(story.path))
    if len(visited) > 2:
        first, middle, last = POSITIONS[visited[0]], [POSITIONS[c] for c in visited[1:-1]], POSITIONS[visited[-1]]
        t.add(rng.choice((f"Over the story, it travelled from the {first} through the {_join(middle)} to the {last}.",
                          f"Its path led from the {first} to the {last}, one cell at a time.")), 0.7)
    if story.theme != "meeting" or len(bystanders) > 1:
        still = [b for b in bystanders if b != story.friend]
        if still:
            t.add(rng.choice((f"Meanwhile, {_join([_the_at(b) for b in still])} {'stays' if len(still) == 1 else 'stay'} "
                              f"where {'it is' if len(still) == 1 else 'they are'} the whole time.",
                              f"{_cap(_join([_the_at(b) for b in still]))} "
                              f"{'does' if len(still) == 1 else 'do'} not move at all.")), 0.6)
    n5 = len(story.frames[4])
    t.add(f"The last frame shows {number(n5)} {_shapes_word(n5)} in total.", 0.4)
    endings = {
        "journey": ("This is the end of its journey across the picture.", "Its long walk is finally over."),
        "meeting": ("The two shapes are now side by side, and the story ends happily.",
                    "After all that walking, the friends are together at last."),
        "recolour": (f"Now it is a {hero4.colour} {hero4.kind}, and the story ends with its new look.",
                     f"The story ends with a brand new {hero4.colour} {hero4.kind}."),
        "grow": (f"Now it is a large {hero4.kind}, much bigger than before.",
                 f"The story ends with the {hero4.kind} standing tall in its cell."),
        "visitor": (f"Now the {hero4.kind} has a new friend, and the story ends.",
                    f"The {hero4.kind} is no longer alone, and the story ends happily."),
    }
    t.add(rng.choice(endings[story.theme]), 0.8)
    return Sample(f"story-{seed}", "story", story.theme, list(story.frames), [(q, _cap(t.build()))], seed)


# --- second turn ---------------------------------------------------------------------------------

_SIDES = {
    "left": (lambda s: s.col == 0, "on the left", "the left column"),
    "right": (lambda s: s.col == 2, "on the right", "the right column"),
    "top": (lambda s: s.row == 0, "at the top", "the top row"),
    "bottom": (lambda s: s.row == 2, "at the bottom", "the bottom row"),
}


def _followup_image(scene: Scene, rng: random.Random) -> tuple[str, str]:
    t = _Text(rng)
    if rng.random() < 0.7:
        side = rng.choice(list(_SIDES))
        test, where, region = _SIDES[side]
        matches = [s for s in scene.shapes if test(s)]
        q = rng.choice((f"Which of those shapes {'is' if rng.random() < 0.5 else 'are'} {where}?",
                        f"Which of them can be found {where} of the image?",
                        f"And which shapes are {where}?"))
        cells = [c for c in range(9) if test(Shape("circle", "red", "small", c))]
        t.add(rng.choice((f"Being {where} means being in {region} of the grid, that is the "
                          f"{_join([POSITIONS[c] for c in cells])}.",
                          f"To answer this, I look at {region} of the grid.",
                          f"The shapes {where} are the ones in {region}.")))
        if not matches:
            t.add(f"None of the shapes I described is {where}.")
            t.add(f"They are in the {_join([s.position for s in scene.shapes])}, so {region} is empty.")
            t.add("So the answer is none of them.")
        else:
            t.add(rng.choice((f"There I find {_join([_at(s) for s in matches])}.",
                              f"In {region} there {_be(len(matches))} {_join([_at(s) for s in matches])}.")))
            rest = [s for s in scene.shapes if s not in matches]
            if rest:
                t.add(f"The other {_shapes_word(len(rest))}, {_join([s.indefinite(size=False) for s in rest])}, "
                      f"{_be(len(rest))} not {where}.", 0.6)
            if len(matches) == 1:
                t.add(f"So the shape {where} is {refer(scene, matches[0])}.")
            else:
                t.add(f"So {number(len(matches))} shapes are {where}: {_join([refer(scene, s) for s in matches])}.")
    else:
        size = rng.choice(("large", "small"))
        matches = scene.select(size=size)
        q = rng.choice((f"Which of them are {size}?", f"Which of those shapes are {size}?"))
        t.add(rng.choice(("To answer this, I look at the size of each shape I described.",
                          f"Let me check which of the shapes are {size}.")))
        t.add("A large shape fills most of its cell, while a small one fills about half of it.", 0.5)
        if not matches:
            t.add(f"None of the shapes is {size}; all of them are {'small' if size == 'large' else 'large'}.")
            t.add(f"The shapes are {_join([_at(s) for s in scene.shapes])}.")
            t.add("So the answer is none of them.")
        else:
            t.add(f"The {size} {_shapes_word(len(matches))} {_be(len(matches))} "
                  f"{_join([f'the {s.noun()} in the {s.position}' for s in matches])}.")
            rest = [s for s in scene.shapes if s not in matches]
            if rest:
                t.add(f"The other {_shapes_word(len(rest))}, {_join([_the_at(s) for s in rest])}, "
                      f"{_be(len(rest))} {'small' if size == 'large' else 'large'}.", 0.7)
            t.add(f"So {number(len(matches))} of the shapes {_be(len(matches))} {size}.")
    return q, t.build()


def _followup_text(scene: Scene, rng: random.Random) -> tuple[str, str]:
    """A text-only arithmetic question about the counts, answered in words with the reasoning."""
    n = len(scene)
    t = _Text(rng)
    kind = rng.choice(("add", "add-colour", "remove", "double", "empty"))
    if kind in ("add", "add-colour"):
        k = rng.choice((1, 2, 3))
        c = rng.choice(list(COLOURS))
        more = f"one more {c} shape" if k == 1 else f"{number(k)} more {c} shapes"
        if kind == "add":
            q = rng.choice((f"If {more} {'was' if k == 1 else 'were'} added, how many shapes would there be?",
                            f"Suppose we add {more}. How many shapes would the picture have then?"))
            t.add(rng.choice((f"Right now the image has {number(n)} {_shapes_word(n)}.",
                              f"As described, there {_be(n)} {number(n)} {_shapes_word(n)} in the picture.")))
            t.add(f"Adding {number(k)} more gives {number(n)} plus {number(k)}, which is {number(n + k)}.")
            have = scene.count(colour=c)
            t.add(f"Of those, {number(have + k)} would be {c}.", 0.5)
            t.add(rng.choice((f"So there would be {number(n + k)} shapes in total.",
                              f"So the answer is {number(n + k)} shapes.")))
            t.add("The empty cells of the grid would have room for them." if n + k <= 9 else
                  "The grid would be too small to hold them all in separate cells.", 0.6)
        else:
            have = scene.count(colour=c)
            q = rng.choice((f"If {more} {'was' if k == 1 else 'were'} added, how many {c} shapes would there be?",
                            f"Suppose we add {more}. How many {c} shapes would there be then?"))
            t.add(rng.choice((f"Right now the image has {number(have)} {c} {_shapes_word(have)}.",
                              f"At the moment there {_be(have)} {number(have)} {c} {_shapes_word(have)}.")))
            t.add(f"Adding {number(k)} more gives {number(have)} plus {number(k)}, which is {number(have + k)}.")
            t.add(rng.choice((f"So there would be {number(have + k)} {c} {_shapes_word(have + k)}.",
                              f"So the answer is {number(have + k)}.")))
            t.add(f"The total number of shapes would then be {number(n + k)}.", 0.6)
    elif kind == "remove":
        s = rng.choice(scene.shapes)
        q = rng.choice((f"If the {s.noun()} in the {s.position} were removed, how many shapes would be left?",
                        f"Suppose we take away the {s.noun()} in the {s.position}. How many shapes remain?"))
        t.add(rng.choice((f"There {_be(n)} {number(n)} {_shapes_word(n)} now.",
                          f"The picture currently has {number(n)} {_shapes_word(n)}.")))
        t.add(f"Removing the {s.noun()} takes away one shape, so {number(n)} minus one is {number(n - 1)}.")
        left = [o for o in scene.shapes if o != s]
        if left:
            t.add(f"The shapes left would be {_join([_the_at(o) for o in left])}.", 0.6)
        else:
            t.add("The picture would be completely empty.", 0.8)
        t.add(rng.choice((f"So {number(n - 1)} {_shapes_word(n - 1)} would be left.",
                          f"So the answer is {number(n - 1)}.")))
    elif kind == "double":
        q = rng.choice(("If every shape were doubled, how many shapes would there be?",
                        "Suppose each shape got a twin. How many shapes would there be then?"))
        t.add(rng.choice((f"There {_be(n)} {number(n)} {_shapes_word(n)} in the image.",
                          f"The picture has {number(n)} {_shapes_word(n)} right now.")))
        t.add(f"Doubling means each shape gets a copy, so I multiply by two: two times {number(n)} is {number(2 * n)}.")
        t.add(f"The grid has nine cells, so {'they would all fit' if 2 * n <= 9 else 'they would not all fit in separate cells'}.", 0.6)
        t.add(rng.choice((f"So there would be {number(2 * n)} shapes.", f"So the answer is {number(2 * n)}.")))
    else:
        q = rng.choice(("How many cells of the grid are empty?", "How many empty cells are left in the grid?"))
        t.add("The picture is a grid of three rows and three columns, which makes nine cells.")
        t.add(f"{_cap(number(n))} of them {'holds' if n == 1 else 'hold'} a shape.")
        t.add(f"So nine minus {number(n)} gives {number(9 - n)}.")
        t.add(rng.choice((f"There are {number(9 - n)} empty cells.", f"So the answer is {number(9 - n)} empty cells.")))
        t.add("Every shape sits in its own cell, so no cell holds more than one shape.", 0.6)
    return q, t.build()


def followup_sample(seed: int) -> Sample:
    """Family 4: two turns; the second depends on the first answer (about the image, or text-only arithmetic)."""
    rng = _rng("followup", seed)
    scene = random_scene(rng)
    if rng.random() < 0.7:
        first = _single(scene, rng, "describe")
    else:
        q, a, _ = count_question(scene, rng, ("all", {}, "shape", "shapes"))
        first = (q, a)
    if rng.random() < 0.5:
        category, second = "followup-image", _followup_image(scene, rng)
    else:
        category, second = "followup-text", _followup_text(scene, rng)
    return Sample(f"followup-{seed}", "followup", category, [scene], [first, second], seed)


# --- captions ------------------------------------------------------------------------------------

def caption(scene: Scene) -> str:
    """The one canonical short caption of a scene (what a captioner should say)."""
    return _cap(_join([_at(s) for s in scene.shapes])) + "."


def caption_sample(seed: int) -> Sample:
    """Family 5: 'Describe the image in one sentence.' -> one short caption."""
    rng = _rng("caption", seed)
    scene = random_scene(rng)
    return Sample(f"caption-{seed}", "caption", "caption", [scene], [(CAPTION_QUESTION, caption(scene))], seed)


FAMILY_BUILDERS: dict[str, Callable[[int], Sample]] = {
    "single": single_sample, "pair": pair_sample, "story": story_sample,
    "followup": followup_sample, "caption": caption_sample,
}


def make_sample(family: str, seed: int) -> Sample:
    try:
        return FAMILY_BUILDERS[family](seed)
    except KeyError:
        raise ValueError(f"unknown family {family!r}; choose from {', '.join(FAMILIES)}") from None


# --- suites, training corpus, quality questions --------------------------------------------------

def suite(name: str, n: int | None = None) -> list[Sample]:
    """A held-out suite: ``n`` (default ``DEFAULT_SUITE_SIZE``) samples of each family in it, from its own seed range."""
    n = DEFAULT_SUITE_SIZE if n is None else n
    if n < 0:
        raise ValueError(f"n must be >= 0, not {n}")
    if name == "demo-all":
        return [s for sub in SUITE_FAMILIES for s in suite(sub, n)]
    if name not in SUITE_FAMILIES:
        raise ValueError(f"unknown suite {name!r}; choose from {', '.join(SUITES)}")
    seeds = SUITE_SEEDS[name]
    return [make_sample(SUITE_FAMILIES[name], s) for s in seeds[:n]]


def training_corpus(n: int, seed: int = 0, weights: dict[str, float] | None = None) -> list[Sample]:
    """``n`` training samples mixing all families (default ``TRAINING_WEIGHTS``), distinct seeds in ``TRAIN_SEEDS``."""
    weights = weights or TRAINING_WEIGHTS
    unknown = set(weights) - set(FAMILIES)
    if unknown:
        raise ValueError(f"unknown families {sorted(unknown)}")
    rng = random.Random(f"mmspec-demo:corpus:{seed}")
    seeds = rng.sample(TRAIN_SEEDS, n)
    families = rng.choices(list(weights), weights=list(weights.values()), k=n)
    return [make_sample(f, s) for f, s in zip(families, seeds)]


class QualityQuestion(NamedTuple):
    scene: Scene
    question: str
    expected: str  # a colour name or a number word


def quality_item(seed: int, kind: str) -> tuple[QualityQuestion, str]:
    """One held-out quality question ('colour' or 'count') and its reference answer."""
    rng = _rng(f"quality-{kind}", seed)
    scene = random_scene(rng)
    if kind == "colour":
        q, a, expected = colour_question(scene, rng)
    elif kind == "count":
        what = _count_filter(scene, rng, present=True)
        while what[0] not in ("all", "colour"):
            what = _count_filter(scene, rng, present=True)
        q, a, k = count_question(scene, rng, what)
        expected = number(k)
    else:
        raise ValueError(f"quality questions are 'colour' or 'count', not {kind!r}")
    return QualityQuestion(scene, q, expected), a


def quality_questions(n: int = 50) -> list[QualityQuestion]:
    """``n`` held-out single-image colour and count questions (alternating), for keyword checks."""
    return [quality_item(s, "colour" if i % 2 == 0 else "count")[0] for i, s in enumerate(QUALITY_SEEDS[:n])]


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z]+", text.lower())


def keyword_match(answer: str, expected: str) -> bool:
    """Whether ``expected`` occurs in ``answer`` as a whole word (case-insensitive)."""
    return expected.lower() in _words(answer)


def final_answer(answer: str, expected: str) -> str | None:
    """The answer's last word of ``expected``'s class (a colour, or a number word), or None.

    The reasoned answers end with their conclusion ("So the answer is red.", "So there are two
    red shapes in total."), so this is the answer a reader takes away.
    """
    vocab = set(COLOURS) if expected in COLOURS else set(NUMBER_WORDS)
    found = [w for w in _words(answer) if w in vocab]
    return found[-1] if found else None


def answer_correct(answer: str, expected: str) -> bool:
    """Strict check: ``expected`` occurs and no other word of its class (colours or number words) does."""
    words = set(_words(answer))
    vocab = set(COLOURS) if expected in COLOURS else set(NUMBER_WORDS)
    return expected in words and not (words & vocab) - {expected}


# --- manifest ------------------------------------------------------------------------------------

def to_manifest(samples: Iterable[Sample], directory: str | Path, size: int = 48, name: str = "manifest.jsonl",
                references: bool = False) -> Path:
    """Render every image as PNG under ``directory/images`` and write a JSONL manifest; returns its path.

    Each line: ``{"id", "images": [paths relative to directory], "turns": [questions], "category"}``
    (the input format of ``mmspec bench``); ``references=True`` adds ``"answers"``.
    """
    root = Path(directory)
    (root / "images").mkdir(parents=True, exist_ok=True)
    path = root / name
    with path.open("w", encoding="utf-8") as f:
        for sample in samples:
            rels = []
            for k, scene in enumerate(sample.images):
                rel = f"images/{sample.id}-{k}.png"
                render(scene, size).save(root / rel, format="PNG")
                rels.append(rel)
            row = {"id": sample.id, "images": rels, "turns": sample.questions, "category": sample.category}
            if references:
                row["answers"] = sample.answers
            f.write(json.dumps(row) + "\n")
    return path
