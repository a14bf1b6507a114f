"""Issue 13, inputs: bad images, questions and profile values end in one clear line (or are handled right).

Tiny float64 LLaVA models of ``conftest.py`` on CPU (context: 1024 positions, 2 decoder layers).
"""

from __future__ import annotations

import json
import os
import resource
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image
from typer.testing import CliRunner

from mmspec_cli import api
from mmspec_cli.bench.peers import PEERS
from mmspec_cli.cli.app import app
from mmspec_cli.decoding.engine import SpeculativeDecoder
from mmspec_cli.decoding.sampling import SamplingParams, TokenPicker
from mmspec_cli.drafters import build_drafter
from mmspec_cli.choices import BENCH_PEERS
from mmspec_cli.errors import InputError, ProfileError
from mmspec_cli.models.images import load_image, to_rgb
from mmspec_cli.models.profiles import MAX_SEED, _show, apply_overrides, load_profile, profile_from_dict
from mmspec_cli.models.prompts import process, render_prompt

from tests.conftest import load
from tests.helpers import assert_one_line_error, save_images, tiny_files, write_profile

REPO = Path(__file__).resolve().parents[1]
QUESTION = "what is in the image?"
MAX_NEW = 5
CONTEXT = 1024  # tests/tiny.py: max_position_embeddings

runner = CliRunner()


@pytest.fixture(scope="module")
def files(tiny_dirs, tmp_path_factory) -> dict:
    return tiny_files(tmp_path_factory.mktemp("hardening"), tiny_dirs, images=1, max_new_tokens=MAX_NEW)


def cli(*args: str):
    return runner.invoke(app, list(args))


# --------------------------------------------------------------------------- images


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


def test_a_decompression_bomb_is_one_line_naming_the_limit(files, no_model_loading):
    bomb = bomb_png(files["root"] / "bomb.png")
    assert bomb.stat().st_size < 200_000
    limit = Image.MAX_IMAGE_PIXELS
    line = assert_one_line_error(cli("generate", str(bomb), "-q", QUESTION, "--profile", files["profile"]),
                                 f"more pixels than PIL's limit of {2 * limit:,}")
    assert "resize it" in line
    assert Image.MAX_IMAGE_PIXELS == limit  # PIL's global limit is left as it is


def test_a_symlink_loop_and_a_url_say_what_they_are(files, no_model_loading, tmp_path):
    (tmp_path / "a.png").symlink_to(tmp_path / "b.png")
    (tmp_path / "b.png").symlink_to(tmp_path / "a.png")
    assert_one_line_error(cli("generate", str(tmp_path / "a.png"), "-q", QUESTION, "--profile", files["profile"]),
                          "is a symbolic link loop")
    url = "https://example.com/cat.png"
    line = assert_one_line_error(cli("generate", url, "-q", QUESTION, "--profile", files["profile"]), "is a URL")
    assert "download the file first" in line
    (tmp_path / "dangling.png").symlink_to(tmp_path / "gone.png")
    with pytest.raises(InputError, match="is a link to .*gone.png', which does not exist"):
        load_image(tmp_path / "dangling.png")


def test_a_long_bad_path_is_quoted_short(files, no_model_loading):
    deep = "folder/" * 300 + "photo.png"  # 2109 characters, each name short: it just does not exist
    line = assert_one_line_error(cli("generate", deep, "-q", QUESTION, "--profile", files["profile"]), "does not exist")
    assert len(line) < 200 and "/photo.png' does not exist" in line
    line = assert_one_line_error(cli("generate", "x" * 5000 + ".png", "-q", QUESTION, "--profile", files["profile"]),
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


# --------------------------------------------------------------------------- questions


def test_a_question_holding_the_image_placeholder_keeps_it_as_text(files):
    question = "What is <image> this?"
    result = cli("generate", *files["images"], "-q", question, "--profile", files["profile"], "--json")
    assert result.exit_code == 0, (result.stderr, result.exception)
    assert json.loads(result.stdout)["turns"][0]["question"] == question


@pytest.mark.parametrize("processor_of", ["target", "no_template"])
def test_questions_and_answers_holding_the_placeholder_keep_one_slot_per_image(tiny_models, processor_of):
    processor = tiny_models[processor_of].processor
    image_id = tiny_models["target"].image_token_id
    images = [to_rgb(Image.new("RGB", (28, 28), (200, 30, 30)))]
    plain = process(processor, render_prompt(processor, ["what is it?"], [], 1), images)
    text = render_prompt(processor, ["what is <image>?", "and <image><image>?"], ["an <image> tag"], 1,
                         history=[("a <image>?", "<image>")])
    quoted = process(processor, text, images)
    assert quoted.ids.count(image_id) == plain.ids.count(image_id) > 0


def test_a_history_holding_the_placeholder_is_decoded(tiny_models):
    target = tiny_models["target"]
    decoder = SpeculativeDecoder(target, build_drafter("t", target, tiny_models["perturbed"]), gamma=3,
                                 max_new_tokens=MAX_NEW)
    images = [Image.new("RGB", (28, 28), (30, 30, 200))]
    generation = decoder.generate(images, ["and now?"], history=[("what is <image>?", "an <image> tag")])
    assert generation.turns[0].stats.new_tokens > 0


@pytest.mark.parametrize("question", ["", "   \n\t"])
def test_an_empty_question_is_one_line(files, no_model_loading, question):
    for command in ("generate", "compare"):
        assert_one_line_error(cli(command, *files["images"], "-q", question, "--profile", files["profile"]),
                              "is empty; write the question after -q")
    assert_one_line_error(cli("generate", *files["images"], "-q", QUESTION, "-q", question,
                              "--profile", files["profile"]), "question 2 (-q) is empty")
    assert_one_line_error(cli("generate", "--raw-prompt", question, "--profile", files["profile"]),
                          "--raw-prompt is empty")


def test_an_empty_question_is_one_line_for_select_layer(files):
    assert_one_line_error(cli("select-layer", *files["images"], "-q", " ", "--profile", files["profile"]),
                          "is empty; write the question after -q")


# --------------------------------------------------------------------------- context


def long_question(processor, images, tokens: int) -> str:
    """A question whose prompt (with ``images``) is exactly ``tokens`` tokens."""
    words = ["red"]
    while len(process(processor, render_prompt(processor, [" ".join(words)], [], len(images)), images).ids) < tokens:
        words.append("red")
    question = " ".join(words)
    assert len(process(processor, render_prompt(processor, [question], [], len(images)), images).ids) == tokens
    return question


def test_a_question_longer_than_the_context_is_one_line(files):
    line = assert_one_line_error(cli("generate", *files["images"], "-q", "describe " * 5000, "--profile",
                                     files["profile"]), f"max_new_tokens is {MAX_NEW}")
    assert f"more than the target's context of {CONTEXT}; shorten the question" in line


def test_the_context_check_refuses_one_token_past_the_boundary_only(tiny_models):
    target = tiny_models["target"]
    images = [Image.new("RGB", (28, 28), (30, 200, 30))]
    question = long_question(target.processor, images, CONTEXT - 3)
    decoder = SpeculativeDecoder(target, build_drafter("ar", target, None), max_new_tokens=4)
    assert decoder.generate(images, [question]).turns  # reads 1021 + 4 - 1 = 1024 positions: fits
    with pytest.raises(InputError, match=rf"the prompt is {CONTEXT - 3} tokens \(4 for its image, {CONTEXT - 7} for "
                                         rf"the text\) and max_new_tokens is 5: "
                                         f"{CONTEXT + 1} tokens, more than the target's context of {CONTEXT}; "
                                         f"lower --max-new-tokens to 4"):
        decoder.generate(images, [question], max_new_tokens=5)


@pytest.mark.parametrize("drafter", ["t", "mt"])
def test_the_drafts_own_prompt_must_fit_the_drafts_context(tiny_dirs, tiny_models, drafter):
    target = tiny_models["target"]
    draft = load(tiny_dirs["perturbed"], "draft")  # a fresh copy: its context is shrunk below
    draft.model.config.text_config.max_position_embeddings = 64
    images = [Image.new("RGB", (28, 28), (200, 200, 30))]
    decoder = SpeculativeDecoder(target, build_drafter(drafter, target, draft), gamma=2, max_new_tokens=MAX_NEW)
    fits = long_question(target.processor, images, 60)  # the text-only view is shorter: it fits the draft too
    assert decoder.generate(images, [fits]).turns
    with pytest.raises(InputError, match=f"as drafter {drafter} shows it to the draft is .* more than the draft's "
                                         f"context of 64"):
        decoder.generate(images, [long_question(target.processor, images, 200)])


def test_bench_records_a_sample_too_long_for_the_context_and_goes_on(files, tmp_path):
    [image] = save_images(tmp_path, 1)
    rows = [{"id": "long", "images": [Path(image).name], "turns": ["red " * 3000], "category": "x"},
            {"id": "short", "images": [Path(image).name], "turns": [QUESTION], "category": "x"}]
    manifest = tmp_path / "manifest.jsonl"
    manifest.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    result = cli("bench", str(manifest), "--drafters", "ar", "--out", str(out), "--profile", files["profile"])
    assert result.exit_code == 1, result.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["id"], "error" in r) for r in records] == [("long", True), ("short", False)]
    assert f"more than the target's context of {CONTEXT}" in records[0]["error"]


# --------------------------------------------------------------------------- profile values


def test_a_seed_torch_cannot_take_is_refused_by_the_key_check(files, no_model_loading, tmp_path):
    too_big = str(MAX_SEED + 1)
    expected = f"expected an integer between 0 and {MAX_SEED} (the range torch's manual_seed takes), got {too_big}"
    assert_one_line_error(cli("generate", *files["images"], "-q", QUESTION, "--profile", files["profile"],
                              "--seed", too_big), f"--seed: {expected}")
    profile = tmp_path / "seed.yaml"
    profile.write_text(Path(files["profile"]).read_text().replace("decoding:", f"decoding:\n  seed: {too_big}"))
    assert_one_line_error(cli("generate", *files["images"], "-q", QUESTION, "--profile", str(profile)),
                          f"decoding.seed: {expected}")
    assert TokenPicker(SamplingParams(), MAX_SEED)  # the largest accepted seed is one torch takes


def test_unhashable_ensemble_members_are_the_usual_key_path_error():
    with pytest.raises(ProfileError, match=r'^ensemble.members: expected a list of at least two distinct letters '
                                           r'from m, t, c, p \(e.g. \[m, t\]\), got \[\["m"\], "t"\]$'):
        profile_from_dict({"target": {"model": "x"}, "ensemble": {"members": [["m"], "t"]}})


def billion_laughs(levels: int = 10, width: int = 10) -> str:
    """A profile whose target.dtype expands to width**levels strings (10**10: tens of gigabytes)."""
    lines = ["x0: &a0 [" + ", ".join(["lol"] * width) + "]"]
    lines += [f"x{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]" for i in range(1, levels)]
    return "bomb:\n" + "".join(f"  {line}\n" for line in lines) + f"target: {{model: x, dtype: *a{levels - 1}}}\n"


def run_capped(*args: str) -> subprocess.CompletedProcess:
    """``python *args`` in a process capped at 2 GiB of address space: a value built or printed whole
    (tens of gigabytes) kills that process with a MemoryError, not the machine."""

    def cap_memory():
        resource.setrlimit(resource.RLIMIT_AS, (2 * 2**30, 2 * 2**30))

    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120,
                          preexec_fn=cap_memory, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_a_yaml_alias_bomb_is_refused_before_it_is_built(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(billion_laughs())
    code = "import sys; from mmspec_cli.cli.app import main; sys.argv[0] = 'mmspec'; main()"
    result = run_capped("-c", code, "generate", "-q", QUESTION, "--profile", str(bomb))
    assert result.returncode == 2, result.stderr[-2000:]
    [line] = result.stderr.splitlines()
    assert line.startswith("error: profile ") and "expands, through its aliases, to more than 10,000 values" in line


def test_a_value_built_from_aliases_is_quoted_short_without_being_serialised_whole(tmp_path):
    """What ``yaml.safe_load`` builds from a bomb (10**10 strings, shared) handed to ``profile_from_dict``."""
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(billion_laughs())
    code = ("import sys, yaml; from mmspec_cli.models.profiles import profile_from_dict\n"
            "data = yaml.safe_load(open(sys.argv[1]).read()); del data['bomb']\n"
            "try:\n    profile_from_dict(data)\nexcept Exception as exc:\n    print(exc)")
    result = run_capped("-c", code, str(bomb))
    assert result.returncode == 0, result.stderr[-2000:]
    [line] = result.stdout.splitlines()
    assert line.startswith("target.dtype: expected one of float32, float16, bfloat16, float64, got [[[[")
    assert len(line) < 200


def test_a_self_containing_yaml_value_is_one_line(tmp_path):
    loop = tmp_path / "loop.yaml"
    loop.write_text("target: {model: x, dtype: &a [*a]}\n")
    with pytest.raises(ProfileError, match="has an alias inside its own anchor"):
        load_profile(str(loop))


def test_bad_values_are_quoted_short_without_being_serialised_whole():
    loop: list = []
    loop.append(loop)
    for value in (loop, 10**5000, "x" * 10**6, {"k" * 10**6: 1}):
        with pytest.raises(ProfileError) as caught:
            profile_from_dict({"target": {"model": "x", "dtype": value}})
        assert len(str(caught.value)) < 200
    assert _show({"a": [1, None, True, 1.5]}) == '{"a": [1, null, true, 1.5]}'


def test_yaml_too_deep_or_with_unreadable_numbers_is_one_line(tmp_path):
    deep = tmp_path / "deep.yaml"
    deep.write_text("target: {model: x, dtype: " + "[" * 5000 + "]" * 5000 + "}\n")
    with pytest.raises(ProfileError, match="nested too deeply"):
        load_profile(str(deep))
    digits = tmp_path / "digits.yaml"
    digits.write_text("target: {model: x}\ndecoding: {seed: " + "1" * 5000 + "}\n")
    with pytest.raises(ProfileError, match="holds a value that can't be read"):
        load_profile(str(digits))
    with pytest.raises(ProfileError, match="decoding.temperature: expected a number >= 0, got an integer of about"):
        profile_from_dict({"target": {"model": "x"}, "decoding": {"temperature": 10**400}})


# --------------------------------------------------------------------------- drafters and ssd.layer


def test_hf_assisted_outside_bench_says_it_is_a_bench_peer(files, no_model_loading):
    fragment = "'hf-assisted' is a bench-only peer row"
    line = assert_one_line_error(cli("generate", *files["images"], "-q", QUESTION, "--profile", files["profile"],
                                     "--drafter", "hf-assisted"), fragment)
    assert "mmspec bench SOURCE --drafters ar,hf-assisted" in line
    assert_one_line_error(cli("compare", *files["images"], "-q", QUESTION, "--profile", files["profile"],
                              "--drafters", "ar,hf-assisted"), fragment)
    assert set(BENCH_PEERS) == set(PEERS)  # the registry knows every bench peer by name


def test_an_ssd_layer_the_target_lacks_is_refused_for_any_drafter(files):
    for drafter in ("m", "ar"):
        assert_one_line_error(cli("generate", *files["images"], "-q", QUESTION, "--profile", files["profile"],
                                  "--drafter", drafter, "--ssd-layer", "99"), "ssd.layer 99 is outside [1, 1]")


def test_select_layer_ignores_a_stale_ssd_layer_in_the_profile(files, tmp_path):
    stale = tmp_path / "stale.yaml"
    stale.write_text(Path(files["profile"]).read_text() + "ssd: {layer: 99}\n")
    result = cli("select-layer", *files["images"], "-q", QUESTION, "--profile", str(stale), "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["chosen"] == 1


def test_a_draft_that_is_the_target_gives_one_warning_line(files, tiny_dirs, tmp_path):
    same = write_profile(tmp_path / "same.yaml", tiny_dirs["target"], tiny_dirs["target"], max_new_tokens=MAX_NEW)
    result = cli("generate", *files["images"], "-q", QUESTION, "--profile", same, "--json")
    assert result.exit_code == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if line and not line.startswith("Loading weights")]
    assert len(lines) == 1 and lines[0].startswith("warning: the draft is the target itself")
    for args in (["--profile", same, "--drafter", "ar"], ["--profile", files["profile"]]):
        quiet = cli("generate", *files["images"], "-q", QUESTION, *args, "--json")
        assert quiet.exit_code == 0 and "warning" not in quiet.stderr
    data = yaml.safe_load(Path(same).read_text())
    assert data["draft"]["model"] == data["target"]["model"]
