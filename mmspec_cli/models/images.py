"""Reading the user's image files, with one-line errors for every way that can fail."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from mmspec_cli.errors import InputError


def load_image(path: str | Path) -> Image.Image:
    """Open an image file fully (so corrupt files fail here, not mid-decoding) as RGB."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise InputError(f"image '{path}' is a directory; pass image files (e.g. {p}/*.png)")
    if not p.exists():
        raise InputError(f"image '{path}' does not exist; check the path")
    try:
        with Image.open(p) as img:
            img.load()
            return img.convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise InputError(f"image '{path}' could not be read as an image ({type(exc).__name__}); pass a PNG or JPEG file") from exc


def load_images(paths: Sequence[str | Path]) -> list[Image.Image]:
    return [load_image(p) for p in paths]
