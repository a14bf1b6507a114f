"""The images in ``examples/``: one scene, a before/after pair and a five-frame story.

Drawn from their own held-out seeds (``EXAMPLE_SEED``, disjoint from training and suites), at
``DISPLAY_SIZE``. ``scripts/make_examples.py`` writes them; a test checks the files still
match this generator.
"""

from __future__ import annotations

from pathlib import Path

from PIL import Image

from mmspec_cli.demo.scenes import DISPLAY_SIZE, render
from mmspec_cli.demo.tasks import EXAMPLE_SEED, pair_sample, single_sample, story_sample


def example_images() -> dict[str, Image.Image]:
    """File name -> image, in a stable order."""
    single = single_sample(EXAMPLE_SEED)
    pair = pair_sample(EXAMPLE_SEED)
    story = story_sample(EXAMPLE_SEED)
    images = {"shapes.png": render(single.images[0], DISPLAY_SIZE),
              "before.png": render(pair.images[0], DISPLAY_SIZE),
              "after.png": render(pair.images[1], DISPLAY_SIZE)}
    images.update({f"story-{i}.png": render(scene, DISPLAY_SIZE) for i, scene in enumerate(story.images, 1)})
    return images


def write_examples(folder: str | Path) -> list[Path]:
    """Write :func:`example_images` as PNG files into ``folder``; returns their paths."""
    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, image in example_images().items():
        image.save(root / name, format="PNG")
        paths.append(root / name)
    return paths
