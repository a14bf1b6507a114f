"""SOURCE -> the conversations a head is trained on: ``bench``'s sources plus the demo training corpus.

``demo-train`` names the demo family's training corpus (:func:`demo_training`): samples drawn
from ``demo.tasks.TRAIN_SEEDS``, disjoint from every held-out suite (``demo-single``, ...). Any other
SOURCE is resolved as ``bench`` resolves it (a manifest, a built-in suite, a dataset id). Images
load only when a conversation is answered or its features are computed, so a corpus of thousands
of samples costs no memory up front and an unreadable image fails its own sample alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mmspec_cli.bench.samples import Sample, load_sample_images
from mmspec_cli.bench.sources import resolve
from mmspec_cli.errors import InputError

DEMO_TRAIN = "demo-train"
DEMO_TRAIN_SIZE = 2000  # samples of demo-train when --limit is not given
DEMO_TRAIN_SEED = 1  # the corpus seed (the demo target was trained on corpus seed 0)
#: The families of demo-train and their weights: the four the held-out suites measure, no captions.
DEMO_TRAIN_WEIGHTS = {"single": 30, "pair": 25, "story": 20, "followup": 25}


@dataclass(frozen=True)
class Conversation:
    """What the target answers: ``turns`` (questions) after the given ``history``, about the images
    ``load_images()`` returns (it raises the one-line InputError of an unreadable image)."""

    id: str
    turns: tuple[str, ...]
    history: tuple[tuple[str, str], ...]
    load_images: Callable[[], list[Any]]


def from_sample(sample: Sample) -> Conversation:
    return Conversation(sample.id, tuple(sample.turns), tuple(sample.history), lambda: load_sample_images(sample))


def demo_training(n: int, seed: int = DEMO_TRAIN_SEED) -> list[Conversation]:
    """``n`` demo training samples in the held-out suites' format: the last turn is asked, earlier turns
    (a follow-up's first) are history with their reference answers, as ``bench``'s ``demo-followup``."""
    from mmspec_cli.demo import scenes, tasks

    def images(sample: tasks.Sample) -> Callable[[], list[Any]]:
        return lambda: [scenes.render(scene, scenes.DISPLAY_SIZE) for scene in sample.images]

    return [Conversation(f"train-{s.family}-{s.seed}", (s.questions[-1],), tuple(s.turns[:-1]), images(s))
            for s in tasks.training_corpus(n, seed=seed, weights=DEMO_TRAIN_WEIGHTS)]


def conversations(source: str, limit: int | None = None) -> list[Conversation]:
    """The conversations SOURCE names (the first ``limit``); refuses an empty source in one line."""
    if source == DEMO_TRAIN:
        found = demo_training(DEMO_TRAIN_SIZE if limit is None else limit)
    else:
        found = [from_sample(s) for s in resolve(source, limit)]
    if not found:
        raise InputError(f"SOURCE {source} holds no samples{' (--limit ' + str(limit) + ')' if limit else ''}; "
                         f"pass a source with at least one")
    return found


def split_held_out(items: Sequence[Conversation], held_out: int) -> tuple[list[Conversation], list[Conversation]]:
    """The last ``held_out`` conversations are kept out of training (to measure acceptance on)."""
    if held_out <= 0 or held_out >= len(items):
        return list(items), []
    return list(items[:-held_out]), list(items[-held_out:])
