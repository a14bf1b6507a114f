"""Images as users give them: decompression bombs, symlink loops, URLs, long bad paths, 16- and 32-bit images and
transparency; each bad one ends in one clear line, each odd one is converted right.

Tiny float64 LLaVA models of ``conftest.py`` on CPU.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mmspec_cli.errors import InputError
from mmspec_cli.models.images import load_image, to_rgb

from tests.helpers import assert_one_line_error, cli

QUESTION = "what is in the image?"
MAX_NEW = 5


def bomb_png(path: Path, side: int = 30000) -> Path:
    """A valid all-black 1-bit greyscale PNG of side x side pixels (900 million at 30000): ~110 KB on disk.

    Written chunk by chunk, so the test never holds the pixels in memory."""

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    row = bytes(1 + side // 8)  # filter byte 0, then side bits packed into bytes
    packer = zlib.compressobj(9)
    data = b"".join(packer.compress(row) for _ in range(side)) + packer.flush()
    header = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)  # 1-bit greyscale
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", data) + chunk(b"IEND", b""))
    return path


def test_a_decompression_bomb_is_one_line_naming_the_limit(one_image_files, no_model_loading):
    bomb = bomb_png(one_image_files["root"] / "bomb.png")
    assert bomb.stat().st_size < 200_000
    limit = Image.MAX_IMAGE_PIXELS
    line = assert_one_line_error(cli("generate", str(bomb), "-q", QUESTION, "--profile", one_image_files["profile"]),
                                 f"more pixels than PIL's limit of {2 * limit:,}")
    assert "resize it" in line
    assert Image.MAX_IMAGE_PIXELS == limit  # PIL's global limit is left as it is


def test_a_symlink_loop_and_a_url_say_what_they_are(one_image_files, no_model_loading, tmp_path):
    (tmp_path / "a.png").symlink_to(tmp_path / "b.png")
    (tmp_path / "b.png").symlink_to(tmp_path / "a.png")
    assert_one_line_error(cli("generate", str(tmp_path / "a.png"), "-q", QUESTION, "--profile", one_image_files["profile"]),
                          "is a symbolic link loop")
    url = "https://example.com/cat.png"
    line = assert_one_line_error(cli("generate", url, "-q", QUESTION, "--profile", one_image_files["profile"]), "is a URL")
    assert "download the file first" in line
    (tmp_path / "dangling.png").symlink_to(tmp_path / "gone.png")
    with pytest.raises(InputError, match="is a link to .*gone.png', which does not exist"):
        load_image(tmp_path / "dangling.png")


def test_a_long_bad_path_is_quoted_short(one_image_files, no_model_loading):
    deep = "folder/" * 300 + "photo.png"  # 2109 characters, each name short: it just does not exist
    line = assert_one_line_error(cli("generate", deep, "-q", QUESTION, "--profile", one_image_files["profile"]), "does not exist")
    assert len(line) < 200 and "/photo.png' does not exist" in line
    line = assert_one_line_error(cli("generate", "x" * 5000 + ".png", "-q", QUESTION, "--profile", one_image_files["profile"]),
                                 "can't be looked up (File name too long)")
    assert len(line) < 200


def test_16_bit_grey_is_scaled_not_clipped_to_white(tmp_path):
    values = np.array([[0, 257 * 100, 65535]], dtype=np.uint16)
    Image.fromarray(values).save(tmp_path / "grey16.png")
    assert Image.open(tmp_path / "grey16.png").mode == "I;16"
    image = load_image(tmp_path / "grey16.png")
    assert image.mode == "RGB" and [image.getpixel((x, 0)) for x in range(3)] == [(0,) * 3, (100,) * 3, (255,) * 3]


def test_32_bit_integer_and_float_images_are_scaled_to_8_bits(tmp_path):
    sixteen = Image.fromarray(np.array([[0, 257 * 100, 65535]], dtype=np.int32))  # 16-bit data held as mode I
    Image.fromarray(np.array([[0, 257 * 100, 65535]], dtype=np.int32)).save(tmp_path / "int32.tif")
    wide = Image.fromarray(np.array([[-1000, 0, 1_000_000]], dtype=np.int32))  # beyond 16 bits: its own range
    unit = Image.fromarray(np.array([[0.0, 0.5, 1.0]], dtype=np.float32))  # float in [0, 1]
    other = Image.fromarray(np.array([[np.nan, -2.0, 2.0]], dtype=np.float32))  # float elsewhere: its own range
    assert (sixteen.mode, unit.mode) == ("I", "F")

    def row(image):
        return [to_rgb(image).getpixel((x, 0))[0] for x in range(3)]

    assert row(sixteen) == row(load_image(tmp_path / "int32.tif")) == [0, 100, 255]
    assert row(wide) == [0, 0, 255]
    assert row(unit) == [0, 128, 255]
    assert row(other) == [0, 0, 255]  # NaN is black


def test_transparent_images_are_composited_onto_white(tmp_path):
    clear = Image.new("RGBA", (2, 2), (0, 0, 0, 0))
    half = Image.new("RGBA", (2, 2), (0, 0, 0, 128))
    opaque = Image.new("RGBA", (2, 2), (10, 20, 30, 255))
    grey_alpha = Image.new("LA", (2, 2), (0, 0))
    palette = Image.new("P", (2, 2), 0)
    palette.putpalette([0, 0, 0] * 256)
    palette.info["transparency"] = 0
    palette.save(tmp_path / "palette.png")
    clear.save(tmp_path / "clear.png")
    assert load_image(tmp_path / "clear.png").getpixel((0, 0)) == (255, 255, 255)
    assert load_image(tmp_path / "palette.png").getpixel((0, 0)) == (255, 255, 255)
    assert to_rgb(grey_alpha).getpixel((0, 0)) == (255, 255, 255)
    assert to_rgb(half).getpixel((0, 0)) == (127, 127, 127)
    assert to_rgb(opaque).getpixel((0, 0)) == (10, 20, 30)
