"""SOURCE -> the conversations a head is trained on: ``bench``'s sources plus the demo training corpus.

``demo-train`` names the demo family's training corpus (:func:`demo_training`): samples drawn
from ``demo.tasks.TRAIN_SEEDS``, disjoint from every held-out suite (``demo-single``, ...). Any other
SOURCE is resolved as ``bench`` resolves it (a manifest, a built-in suite, a dataset id). Images
load only when a conversation is answered or its features are computed, so a corpus of thousands
of samples costs no memory up front and an unreadable image fails its own sample alone.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmspec_cli.inputs.samples import Sample, load_sample_images, load_turn_images
from mmspec_cli.decoding.conversation import images_per_user_turn, images_shown
from mmspec_cli.models.images import load_image
from mmspec_cli.inputs.sources import resolve
from mmspec_cli.errors import InputError

DEMO_TRAIN = "demo-train"
DEMO_TRAIN_SIZE = 2000  # samples of demo-train when --limit is not given
DEMO_TRAIN_SEED = 1  # the corpus seed (the demo target was trained on corpus seed 0)
#: The families of demo-train and their weights: the four the held-out suites measure, no captions.
DEMO_TRAIN_WEIGHTS = {"single": 30, "pair": 25, "story": 20, "followup": 25}


@dataclass(frozen=True)
class Conversation:
    """What the target answers: ``turns`` (questions) after the given ``history``, about the images
    ``load_images()`` returns (it raises the one-line InputError of an unreadable image).

    ``describe_images()`` gives their number and a fingerprint of their content without decoding them
    where it can (:func:`fingerprint`); by default both come from ``load_images()``. A stored answer is
    reused only while the fingerprint is unchanged (:mod:`.answers`).
    """

    id: str
    turns: tuple[str, ...]
    history: tuple[tuple[str, str], ...]
    load_images: Callable[[], list[Any]]
    describe_images: Callable[[], tuple[int, str]] | None = None
    #: how many of ``load_images()``'s images each question brings in its own user turn (question index -> count),
    #: taken from the end of the list in order; the rest open the conversation
    brought: tuple[tuple[int, int], ...] = ()

    def image_counts(self, n_images: int) -> list[int]:
        """Images per user turn (``render_prompt``'s ``n_images``) when the conversation holds ``n_images``."""
        opening = n_images - sum(count for _, count in self.brought)
        return images_per_user_turn(opening, {index: range(count) for index, count in self.brought},
                                    len(self.history), len(self.turns))

    def split_images(self, images: Sequence[Any]) -> tuple[list[Any], dict[int, list[Any]]]:
        """``load_images()``'s images as (the opening ones, {question index: the images it brings})."""
        at = len(images) - sum(count for _, count in self.brought)
        opening, brought = list(images[:at]), {}
        for index, count in self.brought:
            brought[index], at = list(images[at:at + count]), at + count
        return opening, brought

    def shown(self, images: Sequence[Any], turn: int) -> list[Any]:
        """The images question ``turn``'s prompt shows, in order."""
        return images_shown(*self.split_images(images), turn)

    def images(self) -> tuple[int, str]:
        """(number of images, fingerprint of their content); an unreadable image raises its one-line InputError."""
        if self.describe_images is not None:
            return self.describe_images()
        images = self.load_images()
        return len(images), fingerprint(images)


def fingerprint(images: Sequence[Any]) -> str:
    """A digest of the images' content: a file's bytes (read, not decoded), a PIL image's mode, size and pixels,
    anything else (a demo scene) by its ``repr``. The same images give the same digest in every process."""
    digest = hashlib.sha256()
    for image in images:
        if isinstance(image, (str, Path)):
            digest.update(b"file:" + read_image_bytes(image))
        elif hasattr(image, "tobytes") and hasattr(image, "mode"):
            digest.update(f"pil:{image.mode}:{image.size}:".encode() + image.tobytes())
        else:
            digest.update(f"repr:{image!r}".encode())
        digest.update(b"\0")
    return digest.hexdigest()[:32]


def read_image_bytes(path: str | Path) -> bytes:
    """An image file's bytes, or the one-line InputError the image loader gives for a file it can't read."""
    try:
        return Path(path).expanduser().read_bytes()
    except OSError:
        load_image(path)  # raises the loader's own one-line error for this file
        raise


def from_sample(sample: Sample) -> Conversation:
    """A bench sample as a conversation: its opening images, then the images its later questions bring."""
    turns = len(sample.turns)
    brought = sample.brought(turns)
    files = images_shown(sample.images, brought, turns - 1)  # every image, in the order the last prompt shows them
    return Conversation(sample.id, tuple(sample.turns), tuple(sample.history),
                        lambda: images_shown(load_sample_images(sample), load_turn_images(sample, turns), turns - 1),
                        lambda: (len(files), fingerprint(files)),
                        tuple((index, len(brought[index])) for index in sorted(brought)))


def demo_training(n: int, seed: int = DEMO_TRAIN_SEED) -> list[Conversation]:
    """``n`` demo training samples in the held-out suites' format: the last turn is asked, earlier turns
    (a follow-up's first) are history with their reference answers, as ``bench``'s ``demo-followup``."""
    from mmspec_cli.demo import scenes, tasks

    def images(sample: tasks.Sample) -> Callable[[], list[Any]]:
        return lambda: [scenes.render(scene, scenes.DISPLAY_SIZE) for scene in sample.images]

    return [Conversation(f"train-{s.family}-{s.seed}", (s.questions[-1],), tuple(s.turns[:-1]), images(s),
                         (lambda s=s: (len(s.images), fingerprint(s.images))))  # a scene by its description
            for s in tasks.training_corpus(n, seed=seed, weights=DEMO_TRAIN_WEIGHTS)]


def conversations(source: str, limit: int | None = None) -> list[Conversation]:
    """The conversations SOURCE names (the first ``limit``); refuses an empty source, or one that names nothing, in
    one line (bench's, listing ``demo-train`` among the suites)."""
    if source == DEMO_TRAIN:
        found = demo_training(DEMO_TRAIN_SIZE if limit is None else limit)
    else:
        found = [from_sample(s) for s in resolve(source, limit, other_suites=(DEMO_TRAIN,))]
    if not found:
        raise InputError(f"SOURCE {source} holds no samples{' (--limit ' + str(limit) + ')' if limit else ''}; "
                         f"pass a source with at least one")
    return found


def split_held_out(items: Sequence[Conversation], held_out: int) -> tuple[list[Conversation], list[Conversation]]:
    """The last ``held_out`` conversations are kept out of training (to measure acceptance on)."""
    if held_out <= 0 or held_out >= len(items):
        return list(items), []
    return list(items[:-held_out]), list(items[-held_out:])
