"""Files the CLI tests share: tiny-model profiles and saved test images."""

from __future__ import annotations

from pathlib import Path

import yaml

from tests import tiny


def write_profile(path: Path, target: str, draft: str, **decoding) -> str:
    """A float64 CPU profile for the tiny ``target``/``draft`` directories; ``decoding`` keys as given."""
    spec = {"dtype": "float64", "device": "cpu"}
    data = {"target": {"model": target, **spec}, "draft": {"model": draft, **spec}, "decoding": decoding}
    path.write_text(yaml.safe_dump(data))
    return str(path)


def save_images(root: Path, n: int) -> list[str]:
    """``tiny.images(n)`` saved as root/img0.png, root/img1.png, ...; their paths."""
    paths = []
    for i, image in enumerate(tiny.images(n)):
        paths.append(str(root / f"img{i}.png"))
        image.save(paths[-1])
    return paths
