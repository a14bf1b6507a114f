"""Reading the user's image files, with one-line errors for every way that can fail.

Every image becomes 8-bit RGB the way an image viewer shows it: high-bit-depth grey is
scaled down (``convert("RGB")`` would clip 16-bit values at 255, all white), and transparent
images are composited onto white (``convert("RGB")`` would drop the alpha, leaving black
wherever the transparent pixels' colour is black).
"""

from __future__ import annotations

import errno
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from mmspec_cli.errors import InputError
from mmspec_cli.models.prompts import shorten

#: Modes that carry an alpha channel (``P`` and others can also carry a transparent colour in ``info``).
ALPHA_MODES = ("RGBA", "RGBa", "LA", "La", "PA")

URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")

#: File name endings of video files, refused before they are opened (Qwen-VL's video path is not built yet).
VIDEO_SUFFIXES = (".mp4", ".m4v", ".mov", ".avi", ".mkv", ".webm", ".mpeg", ".mpg", ".wmv", ".flv", ".3gp")


def load_image(path: str | Path) -> Image.Image:
    """Open an image file fully (so corrupt files fail here, not mid-decoding) as 8-bit RGB (:func:`to_rgb`).

    A file of a known format whose data is cut short or broken is called damaged (or truncated) in its error, not
    "not an image". A file of several frames (an animated GIF, PNG or WebP, a multi-page TIFF; not a camera's MPO
    JPEG, whose other frames are maps of the same picture) is read as its first frame, with one ``warning:`` line
    on stderr saying so: the first frame is what a viewer shows still and what a thumbnail holds, and nothing the
    user asked for is refused; video files are refused (see ``VIDEO_SUFFIXES``).
    """
    p = Path(path).expanduser()
    shown = shorten(str(path))
    try:
        is_dir, exists = p.is_dir(), p.exists()
    except OSError as exc:  # e.g. a name longer than the file system allows
        raise InputError(f"image '{shown}' can't be looked up ({exc.strerror or type(exc).__name__}); "
                         f"check the path") from None
    if is_dir:
        raise InputError(f"image '{shown}' is a directory; pass image files (e.g. {shorten(str(p))}/*.png)")
    if not exists:
        raise InputError(_missing(str(path), p))
    if p.suffix.lower() in VIDEO_SUFFIXES:
        raise InputError(f"'{shown}' is a video; video input is not supported yet: pass still frames of it "
                         f"(PNG or JPEG files) as images")
    try:
        with Image.open(p) as img:
            try:
                # a phone camera's JPEG (MPO) holds a depth or gain map as its second frame: one picture all the same
                frames = 1 if img.format == "MPO" else getattr(img, "n_frames", 1)
                img.load()
                image = to_rgb(img)
            except (OSError, SyntaxError, ValueError, EOFError) as exc:  # its header was read, its data is broken
                raise InputError(damaged(shown, img.format, exc)) from exc
    except Image.DecompressionBombError:
        # PIL refuses (rather than warns about) images over twice its MAX_IMAGE_PIXELS; the limit stays as it is
        limit = 2 * Image.MAX_IMAGE_PIXELS
        raise InputError(f"image '{shown}' has more pixels than PIL's limit of {limit:,} (a guard against "
                         f"decompression bombs); resize it (e.g. to 4096x4096 or smaller) and pass that file") from None
    except PermissionError:
        raise InputError(f"image '{shown}' can't be read (permission denied); check the file's permissions") from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:  # no format could read its header
        if isinstance(exc, OSError) and exc.errno is not None:  # the system's error (EIO, ...), not PIL's
            raise InputError(f"image '{shown}' can't be read ({exc.strerror or exc}); check the file") from exc
        kind = format_by_signature(p)
        if kind is not None:  # a known signature PIL could not get past: the file is cut or broken early on
            raise InputError(damaged(shown, kind, exc)) from exc
        raise InputError(f"image '{shown}' could not be read as an image: its first bytes are not those of a PNG, "
                         f"JPEG, GIF, WebP, BMP or TIFF file, nor of another format PIL reads; pass a PNG or JPEG "
                         f"file") from exc
    if frames > 1:
        print(f"warning: image '{shown}' has {frames} frames (an animation or a multi-page file); only its first "
              f"frame is used: to ask about another, save that frame as a PNG and pass it", file=sys.stderr)
    return image


#: The first bytes of the image formats users pass, to tell a damaged file of a known format from a file that is
#: no image at all.
SIGNATURES = {b"\x89PNG\r\n\x1a\n": "PNG", b"\xff\xd8\xff": "JPEG", b"GIF87a": "GIF", b"GIF89a": "GIF",
              b"BM": "BMP", b"II*\x00": "TIFF", b"MM\x00*": "TIFF"}


def format_by_signature(path: Path) -> str | None:
    """The image format ``path``'s first bytes announce (WebP: ``RIFF....WEBP``), or None."""
    try:
        with open(path, "rb") as file:
            head = file.read(12)
    except OSError:
        return None
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "WebP"
    return next((kind for signature, kind in SIGNATURES.items() if head.startswith(signature)), None)


def damaged(shown: str, kind: str | None, exc: BaseException) -> str:
    """The line for a file whose format is known but whose data can't be decoded: cut short (a download or copy
    that stopped) or otherwise corrupt."""
    if isinstance(exc, UnidentifiedImageError):  # PIL's text only repeats the file name
        reason = "its header can't be read"
    else:
        reason = shorten(str(exc).splitlines()[0]) if str(exc).strip() else type(exc).__name__
    what = "truncated (cut short)" if "truncated" in reason else "damaged or truncated"
    return (f"image '{shown}' is a {what} {kind or 'image'} file ({reason}); copy or download it again, "
            f"or re-save it from an image editor")


def _missing(path: str, p: Path) -> str:
    """Why nothing can be opened at ``p``: a URL, a symbolic link loop, a broken link, or no file there."""
    shown = shorten(path)
    if URL.match(path):
        return f"image '{shown}' is a URL; URLs are not fetched: download the file first and pass its path"
    if p.is_symlink():
        try:
            p.stat()
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                return f"image '{shown}' is a symbolic link loop (it leads back to itself); pass the image file itself"
        return (f"image '{shown}' is a link to '{shorten(os.readlink(p))}', which does not exist; "
                f"fix the link or pass the image file itself")
    return f"image '{shown}' does not exist; check the path"


def is_image_file(path: Path) -> bool:
    """Whether ``path`` is a file that PIL recognises as an image, by its name's ending or its first bytes."""
    if not path.is_file():
        return False
    if path.suffix.lower() in Image.registered_extensions():
        return True
    try:
        with Image.open(path):  # reads the header only
            return True
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        return False


def to_rgb(img: Image.Image) -> Image.Image:
    """``img`` as 8-bit RGB as a viewer shows it: high bit depths scaled to 8 bits, transparency over white."""
    if img.mode.startswith("I") or img.mode == "F":
        img = eight_bit(img)
    palette_alpha = img.mode == "P" and img.palette is not None and img.palette.mode.endswith("A")
    if img.mode in ALPHA_MODES or "transparency" in img.info or palette_alpha:
        white = Image.new("RGBA", img.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, img.convert("RGBA")).convert("RGB")
    return img.convert("RGB")


def eight_bit(img: Image.Image) -> Image.Image:
    """A 16-bit grey (``I;16*``), 32-bit integer (``I``) or float (``F``) image scaled to 8-bit grey (``L``).

    The full scale is 0..65535 for 16-bit grey, and for ``I`` images whose values fit in it (16-bit
    PNG and TIFF data often arrive as ``I``); 0..1 for ``F`` images whose values fit in it (the usual
    float convention); otherwise the image's own minimum..maximum. NaN and infinities become black.
    """
    import numpy as np  # only for such images: `mmspec --help` imports this module and stays fast

    values = np.asarray(img, dtype=np.float64)  # (H, W)
    finite = np.isfinite(values)
    seen = values[finite]
    lo, hi = (float(seen.min()), float(seen.max())) if seen.size else (0.0, 1.0)
    if img.mode.startswith("I;16") or (img.mode == "I" and lo >= 0 and hi <= 65535):
        lo, hi = 0.0, 65535.0
    elif img.mode == "F" and lo >= 0 and hi <= 1:
        lo, hi = 0.0, 1.0
    scaled = np.where(finite, (values - lo) / ((hi - lo) or 1.0) * 255.0, 0.0)
    return Image.fromarray(np.clip(np.rint(scaled), 0, 255).astype(np.uint8))  # uint8 (H, W): mode L


def load_images(paths: Sequence[str | Path]) -> list[Image.Image]:
    return [load_image(p) for p in paths]
