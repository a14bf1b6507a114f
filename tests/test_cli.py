"""Tests for the ``mmspec`` command line: output modes, flag overrides, error mapping.

Every run uses the tiny float64 LLaVA models of ``conftest.py`` on CPU.
"""

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

from mmspec_cli import __version__, api
from mmspec_cli.cli.app import app
from mmspec_cli.cli.display import (ACCEPTED, EMITTED, REJECTED, IncrementalText, LiveView, color_block,
                                    generation_json, summary_line)
from mmspec_cli.decoding.events import BlockVerified, Generation, TurnFinished, TurnResult, TurnStarted
from mmspec_cli.models.images import load_images
from mmspec_cli.decoding.metrics import RunStats

from tests.helpers import assert_one_line_error, generate_from_text, tiny_files, write_profile

QUESTION = "what is in the image?"
MAX_NEW = 10
STATS_KEYS = {"new_tokens", "blocks", "block_efficiency", "acceptance_rate", "wall_s", "tokens_per_s"}
TURN_KEYS = {"question", "text", "token_ids", "stats", "blocks"}
RAW_PROMPT = "USER: <image>\n<image>\nwhat is it? ASSISTANT:"
ROOT = Path(__file__).resolve().parent.parent

runner = CliRunner()


@pytest.fixture(scope="module")
def files(tiny_dirs, tmp_path_factory) -> dict:
    """Two PNG images, a good profile, and a few broken inputs."""
    files = tiny_files(tmp_path_factory.mktemp("cli"), tiny_dirs, max_new_tokens=MAX_NEW)
    root = files["root"]
    (root / "x.png").write_bytes(b"\x00not a png at all\xff" * 8)
    (root / "malformed.yaml").write_text("target: [unclosed\n")
    (root / "wrong_key.yaml").write_text(f"target: {{model: {tiny_dirs['target']}}}\ndecoding: {{gama: 3}}\n")
    return {**files, "other_tokenizer": write_profile(root / "other.yaml", tiny_dirs["target"],
                                                      tiny_dirs["other_tokenizer"], max_new_tokens=MAX_NEW)}


def invoke(*args: str, env: dict | None = None):
    return runner.invoke(app, ["generate", *args], env=env)


def run_json(files: dict, *extra: str) -> dict:
    result = invoke(*files["images"], "--profile", files["profile"], "--json", *extra)
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def reference_ids(target, image_paths: list[str], question: str, max_new_tokens: int) -> list[int]:
    """The target's own greedy ``generate`` on the same chat prompt."""
    content = [{"type": "image"} for _ in image_paths] + [{"type": "text", "text": question}]
    prompt = target.processor.apply_chat_template([{"role": "user", "content": content}],
                                                  add_generation_prompt=True, tokenize=False)
    return generate_from_text(target, prompt, load_images(image_paths), max_new_tokens)


# --------------------------------------------------------------------------- --json


def test_json_is_one_object_with_the_schema(files):
    data = run_json(files, "-q", QUESTION)
    assert set(data) == {"drafter", "profile", "turns", "stats", "threads"}
    assert (data["drafter"], data["profile"]) == ("m", "tiny")
    assert set(data["stats"]) == STATS_KEYS
    [turn] = data["turns"]
    assert set(turn) == TURN_KEYS and set(turn["stats"]) == STATS_KEYS
    assert turn["question"] == QUESTION and isinstance(turn["text"], str)
    assert all(set(block) == {"draft", "accepted", "emitted"} for block in turn["blocks"])


def test_json_tokens_equal_the_targets_greedy_generate(files, tiny_models):
    data = run_json(files, "-q", QUESTION)
    expected = reference_ids(tiny_models["target"], files["images"], QUESTION, MAX_NEW)
    assert data["turns"][0]["token_ids"] == expected


def test_json_stats_are_consistent(files):
    data = run_json(files, "-q", QUESTION, "-q", "and then?")
    assert [t["question"] for t in data["turns"]] == [QUESTION, "and then?"]
    for turn in data["turns"]:
        stats, blocks = turn["stats"], turn["blocks"]
        kept = sum(b["accepted"] + (b["emitted"] is not None) for b in blocks)
        assert kept == stats["new_tokens"] == len(turn["token_ids"])
        assert stats["blocks"] == len(blocks)
        assert stats["block_efficiency"] == pytest.approx(stats["new_tokens"] / stats["blocks"])
    totals = data["stats"]
    assert totals["new_tokens"] == sum(t["stats"]["new_tokens"] for t in data["turns"])
    assert totals["blocks"] == sum(t["stats"]["blocks"] for t in data["turns"])


def test_ar_gives_the_same_tokens_and_no_acceptance_rate(files):
    m = run_json(files, "-q", QUESTION)
    ar = run_json(files, "-q", QUESTION, "--drafter", "ar")
    assert ar["drafter"] == "ar" and ar["stats"]["acceptance_rate"] is None
    assert ar["turns"][0]["token_ids"] == m["turns"][0]["token_ids"]


def test_gamma_schedule_cost_says_when_nothing_is_measured_and_drafts_from_the_cached_costs(files, tiny_dirs,
                                                                                           tmp_path, monkeypatch):
    from mmspec_cli.bench import latency
    from mmspec_cli.decoding.schedules import OPENING_BLOCKS

    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path))
    args = (*files["images"], "--profile", files["profile"], "--json", "-q", QUESTION, "--threads", "1", "--gamma", "4",
            "--max-new-tokens", "32")
    constant = invoke(*args)
    unmeasured = invoke(*args, "--gamma-schedule", "cost")
    assert unmeasured.exit_code == 0, unmeasured.stderr
    [note] = [line for line in unmeasured.stderr.splitlines() if line.startswith("note:")]
    assert note.startswith("note: --gamma-schedule cost has no step costs measured on this machine (cpu-")
    assert note.endswith(f"it uses the constant γ = 4 (run mmspec profile-latency --profile {files['profile']} "
                         f"--threads 1 first)")
    [unmeasured_turn], [constant_turn] = json.loads(unmeasured.stdout)["turns"], json.loads(constant.stdout)["turns"]
    assert unmeasured_turn["blocks"] == constant_turn["blocks"]  # the constant γ
    # verification priced at 10 ms per token
    latency.save(latency.LatencyResult(latency.device_name("cpu", 1), tiny_dirs["target"], tiny_dirs["perturbed"],
                                       {f"{s},{n}": 10.0 * n for s in (16, 256) for n in range(1, 8)},
                                       {"1,16": 0.5, "1,256": 0.5}))
    measured = invoke(*args, "--gamma-schedule", "cost")
    assert measured.exit_code == 0 and "note: --gamma-schedule" not in measured.stderr, measured.stderr
    [turn] = json.loads(measured.stdout)["turns"]
    assert turn["token_ids"] == constant_turn["token_ids"]  # lossless
    drafted = [len(block["draft"]) for block in turn["blocks"]]
    opening, chosen = drafted[:OPENING_BLOCKS], drafted[OPENING_BLOCKS:]  # the opening blocks draft γ
    # then the costs choose: at 10 ms per verified token γ = 1 gives the most tokens per ms, whatever the acceptance
    # (blocks measured far below that price leave each price at 1% of its own: the same choice)
    assert opening == [4] * OPENING_BLOCKS and 1 in chosen and set(chosen) <= {0, 1}  # 0: the last block, cut


def test_ensemble_blocks_carry_their_weights(files):
    ar = run_json(files, "-q", QUESTION, "--drafter", "ar")
    mt = run_json(files, "-q", QUESTION, "--drafter", "mt")
    assert mt["turns"][0]["token_ids"] == ar["turns"][0]["token_ids"]
    assert all(len(b["weights"]) == 2 for b in mt["turns"][0]["blocks"] if b["draft"])


def test_flags_override_the_profile(files, tiny_models):
    default = run_json(files, "-q", QUESTION)
    assert len(default["turns"][0]["blocks"][0]["draft"]) == 5  # the profile's default gamma
    short = run_json(files, "-q", QUESTION, "--gamma", "2", "--max-new-tokens", "7")
    turn = short["turns"][0]
    assert all(len(b["draft"]) <= 2 for b in turn["blocks"])
    eos = tiny_models["target"].model.generation_config.eos_token_id
    assert len(turn["token_ids"]) == 7 or turn["token_ids"][-1] == eos


def test_raw_prompt_with_two_images(files):
    data = run_json(files, "--raw-prompt", RAW_PROMPT)
    [turn] = data["turns"]
    assert turn["question"] == RAW_PROMPT and turn["stats"]["new_tokens"] > 0


# --------------------------------------------------------------------------- plain output


def test_plain_mode_streams_the_text_and_a_summary(files):
    expected = run_json(files, "-q", QUESTION)["turns"][0]["text"]
    result = invoke(*files["images"], "-q", QUESTION, "--profile", files["profile"], "--no-live")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.strip() == expected
    assert f"{MAX_NEW} new tokens" in result.stderr and "block efficiency" in result.stderr


# --------------------------------------------------------------------------- errors

ERRORS = {
    "missing image": (lambda f: ["nope.png", "-q", QUESTION], "does not exist"),
    "directory image": (lambda f: [str(f["root"]), "-q", QUESTION], "is a directory"),
    "corrupt image": (lambda f: [str(f["root"] / "x.png"), "-q", QUESTION], "could not be read as an image"),
    "no question": (lambda f: f["images"], "no question given; pass one with -q TEXT"),
    "gamma 0": (lambda f: [*f["images"], "-q", QUESTION, "--gamma", "0"], "--gamma: expected"),
    "gamma 65": (lambda f: [*f["images"], "-q", QUESTION, "--gamma", "65"], "--gamma: expected"),
    "max new tokens 0": (lambda f: [*f["images"], "-q", QUESTION, "--max-new-tokens", "0"], "--max-new-tokens: expected"),
    "negative temperature": (lambda f: [*f["images"], "-q", QUESTION, "--temperature", "-1"], "--temperature: expected"),
    "top-p 0": (lambda f: [*f["images"], "-q", QUESTION, "--top-p", "0"], "--top-p: expected"),
    "top-p 1.5": (lambda f: [*f["images"], "-q", QUESTION, "--top-p", "1.5"], "--top-p: expected"),
    "unknown drafter": (lambda f: [*f["images"], "-q", QUESTION, "--drafter", "zz"], "drafter 'zz'"),
    "unknown gamma schedule": (lambda f: [*f["images"], "-q", QUESTION, "--gamma-schedule", "cosine"],
                               "--gamma-schedule: expected one of constant, heuristic, fastvlm"),
}
PROFILE_ERRORS = {
    "unknown profile": ("no-such-profile", 'unknown profile "no-such-profile"'),
    "malformed yaml": ("malformed.yaml", "is not valid YAML"),
    "wrong key": ("wrong_key.yaml", "decoding.gama: unknown key"),
}


@pytest.mark.parametrize("case", ERRORS)
def test_bad_input_is_one_line_before_loading(files, no_model_loading, case):
    args, fragment = ERRORS[case]
    assert_one_line_error(invoke(*args(files), "--profile", files["profile"]), fragment)


@pytest.mark.parametrize("case", PROFILE_ERRORS)
def test_bad_profile_is_one_line_before_loading(files, no_model_loading, case):
    name, fragment = PROFILE_ERRORS[case]
    path = files["root"] / name
    profile = str(path) if path.suffix else name
    assert_one_line_error(invoke(*files["images"], "-q", QUESTION, "--profile", profile), fragment)


def test_mismatched_tokenizers(files):
    result = invoke(*files["images"], "-q", QUESTION, "--profile", files["other_tokenizer"])
    assert_one_line_error(result, "another tokenizer than the target")


def test_raw_prompt_with_the_wrong_placeholder_count(files):
    result = invoke(*files["images"], "--raw-prompt", "USER: <image>\nwhat? ASSISTANT:", "--profile", files["profile"])
    assert_one_line_error(result, "--raw-prompt has 1 '<image>' placeholder(s) but 2 image(s)")


def test_debug_env_shows_the_traceback(files):
    result = invoke("nope.png", "-q", QUESTION, "--profile", files["profile"], env={"MMSPEC_DEBUG": "1"})
    assert result.exit_code == 2
    assert "Traceback (most recent call last)" in result.stderr and "InputError" in result.stderr


def raising(exc: BaseException):
    def fail(*args, **kwargs):
        raise exc

    return fail


def test_cuda_out_of_memory_is_one_line(files, monkeypatch):
    monkeypatch.setattr(api, "decoder_from_profile", raising(torch.cuda.OutOfMemoryError("CUDA out of memory.")))
    assert_one_line_error(invoke(*files["images"], "-q", QUESTION, "--profile", files["profile"]), "quantization")


def test_ctrl_c_exits_130_quietly(files, monkeypatch):
    monkeypatch.setattr(api, "decoder_from_profile", raising(KeyboardInterrupt()))
    result = invoke(*files["images"], "-q", QUESTION, "--profile", files["profile"])
    assert result.exit_code == 130 and result.stderr == "" and result.stdout == ""


# --------------------------------------------------------------------------- app


def test_version_and_help():
    assert runner.invoke(app, ["--version"]).stdout == f"mmspec {__version__}\n"
    assert "generate" in runner.invoke(app, []).stdout


def test_help_and_the_package_name_every_family_the_tool_runs():
    """Not "(LLaVA family)": the Qwen-VL families run too, and the package's description says so as the help does."""
    families = ("LLaVA-1.5", "LLaVA-NeXT", "LLaVA-OneVision", "Qwen2-VL", "Qwen2.5-VL", "Qwen3-VL")
    shown = " ".join(runner.invoke(app, ["--help"], terminal_width=200).stdout.split())
    [description] = [line for line in (ROOT / "pyproject.toml").read_text().splitlines()
                     if line.startswith("description = ")]
    for text in (shown, description):
        assert all(family in text for family in families), text
        assert "LLaVA family" not in text


def test_the_readmes_raw_prompt_example_gives_bash_a_newline():
    """The README's --raw-prompt line, split as bash splits it, holds a real newline where LLaVA's prompt has one
    (a "\\n" inside double quotes stays two characters in bash)."""
    [line] = [line for line in (ROOT / "README.md").read_text().splitlines()
              if line.startswith("mmspec generate") and "--raw-prompt" in line]
    command = line.split(" #")[0].replace("mmspec generate", "printf '%s\\0'", 1)
    argv = subprocess.run(["bash", "-c", command], capture_output=True, text=True, check=True).stdout.split("\0")
    prompt = argv[argv.index("--raw-prompt") + 1]
    assert prompt == "USER: <image>\nWhat is this? ASSISTANT:"


def test_console_script_runs():
    script = Path(sys.executable).parent / "mmspec"
    out = subprocess.run([str(script), "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"mmspec {__version__}"


# --------------------------------------------------------------------------- display


def block(draft, accepted, emitted, turn=0):
    tokens = draft[:accepted] + ([] if emitted is None else [emitted])
    return BlockVerified(turn=turn, index=0, draft=draft, accepted=accepted, emitted=emitted, tokens=tokens,
                         draft_s=0.0, verify_s=0.0)


def test_incremental_text_handles_split_characters(tiny_models):
    tokenizer = tiny_models["target"].tokenizer
    ids = tokenizer("the café is ünder a star", add_special_tokens=False)["input_ids"]
    text = IncrementalText(tokenizer)
    pieces = [text.add([i]) for i in ids]
    assert "".join(pieces) == "the café is ünder a star"
    assert all("\ufffd" not in p for p in pieces)


def test_color_block_styles_accepted_emitted_and_rejected(tiny_models):
    tokenizer = tiny_models["target"].tokenizer
    the, red, blue = (tokenizer(w, add_special_tokens=False)["input_ids"] for w in ["the", " red", " blue"])
    kept, rejected = color_block(IncrementalText(tokenizer), block(the + blue, len(the), red[0]))
    assert kept.plain == "the red" and rejected.plain == " blue"
    assert [(kept.plain[s.start:s.end], s.style) for s in kept.spans] == [("the", ACCEPTED), (" red", EMITTED)]
    assert rejected.style == REJECTED


def test_live_view_strikes_rejected_drafts_until_the_turn_ends(tiny_models):
    tokenizer = tiny_models["target"].tokenizer
    the, red, blue = (tokenizer(w, add_special_tokens=False)["input_ids"] for w in ["the", " red", " blue"])
    console = Console(file=io.StringIO(), width=100)
    stats = RunStats(new_tokens=len(the) + 1, blocks=1, drafted=len(the) + 1, accepted=len(the), wall_s=0.5)
    with LiveView(tokenizer, console) as view:
        view.handle(TurnStarted(turn=0, question=QUESTION, prompt=""))
        view.handle(block(the + blue, len(the), red[0]))
        assert view.live.get_renderable().plain == "the red blue"
        view.handle(TurnFinished(turn=0, result=TurnResult(QUESTION, "the red", the + red, stats)))
    out = console.file.getvalue()  # off a terminal, Live writes only its final frame
    assert out.startswith(f"> {QUESTION}\nthe red") and out.endswith(summary_line(stats) + "\n")
    assert "blue" not in out


def test_summary_line_shows_a_dash_without_drafts():
    line = summary_line(RunStats(new_tokens=6, blocks=6, drafted=0, accepted=0, wall_s=2.0))
    assert "6 new tokens" in line and "acceptance rate -" in line and "3.0 tokens/s" in line


def test_generation_json_includes_ensemble_weights():
    weighted = BlockVerified(turn=0, index=0, draft=[5], accepted=1, emitted=7, tokens=[5, 7], draft_s=0.0,
                             verify_s=0.0, weights=[0.25, 0.75])
    stats = RunStats(new_tokens=2, blocks=1, drafted=1, accepted=1, wall_s=1.0)
    data = generation_json(Generation("mt", [TurnResult("q", "ab", [5, 7], stats, [weighted])]), "p")
    assert data["turns"][0]["blocks"] == [{"draft": [5], "accepted": 1, "emitted": 7, "weights": [0.25, 0.75]}]


def test_weight_bars_show_each_member():
    from mmspec_cli.cli.display import weight_bars

    bars = weight_bars(["m", "t"], [0.7, 0.3]).plain
    assert bars.startswith("m ███████··· 0.70") and "t ███······· 0.30" in bars


# --------------------------------------------------------------------------- what a new user broke (inputs, flags)


def test_a_truncated_png_is_called_truncated_and_named(files, no_model_loading, tmp_path):
    from PIL import Image

    from mmspec_cli.errors import InputError
    from mmspec_cli.models.images import load_image

    whole = tmp_path / "whole.png"
    Image.effect_noise((64, 48), 40).convert("RGB").save(whole)
    data = whole.read_bytes()
    (tmp_path / "cut.png").write_bytes(data[: len(data) // 2])  # a download that stopped halfway
    line = assert_one_line_error(invoke(str(tmp_path / "cut.png"), "-q", QUESTION, "--profile", files["profile"]),
                                 "cut.png' is a truncated (cut short) PNG file")
    assert "could not be read" not in line and "pass a PNG or JPEG" not in line
    (tmp_path / "header.png").write_bytes(data[:40])  # cut inside its first chunk: PIL can't even identify it
    with pytest.raises(InputError, match=r"header.png' is a damaged or truncated PNG file \(its header can't be "
                                         r"read\)"):
        load_image(tmp_path / "header.png")


def test_an_animated_gif_is_read_as_its_first_frame_with_one_warning(tmp_path, capsys):
    from PIL import Image

    from mmspec_cli.models.images import load_image

    red, green = Image.new("RGB", (8, 8), (255, 0, 0)), Image.new("RGB", (8, 8), (0, 255, 0))
    red.save(tmp_path / "anim.gif", save_all=True, append_images=[green], duration=100, loop=0)
    assert load_image(tmp_path / "anim.gif").getpixel((0, 0)) == (255, 0, 0)
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("warning: image '") and "anim.gif' has 2 frames" in line
    assert "only its first frame is used" in line
    red.save(tmp_path / "still.gif")
    load_image(tmp_path / "still.gif")
    red.save(tmp_path / "camera.jpg", format="MPO", save_all=True, append_images=[green])  # a phone's depth map
    assert load_image(tmp_path / "camera.jpg").size == (8, 8)
    assert capsys.readouterr().err == ""


def test_more_threads_than_twice_the_cores_are_refused_before_loading(files, no_model_loading, monkeypatch):
    from mmspec_cli.errors import InputError
    from mmspec_cli.models import threads

    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    line = assert_one_line_error(invoke(*files["images"], "-q", QUESTION, "--profile", files["profile"],
                                        "--threads", "1000"), "--threads: 1000 CPU threads is more than 2 per core")
    assert "(2 cores: at most 4)" in line and "use 2 or fewer" in line
    assert_one_line_error(invoke(*files["images"], "-q", QUESTION, "--profile", files["profile"],
                                 env={"MMSPEC_THREADS": "5"}), "MMSPEC_THREADS: 5 CPU threads is more than")
    assert threads.check_count(4, "--threads", cores=2) == 4
    with pytest.raises(InputError, match="at most 4"):
        api.load_decoder(files["profile"], threads=5)


def test_tree_settings_that_disagree_are_refused_before_loading_named_as_given(files, tiny_dirs, no_model_loading,
                                                                               tmp_path):
    from mmspec_cli.errors import InputError

    def refused(profile: str, *flags: str) -> str:
        return assert_one_line_error(invoke(*files["images"], "-q", QUESTION, "--profile", profile, *flags), "")

    chain_of_3 = write_profile(tmp_path / "chain3.yaml", tiny_dirs["target"], tiny_dirs["perturbed"], tree="chain",
                               tree_width=3)
    assert refused(files["profile"], "--tree", "chain", "--tree-width", "3") == (
        "error: --tree chain and --tree-width 3 disagree; drop --tree-width, or use --tree width")
    assert refused(chain_of_3) == ("error: decoding.tree: chain and decoding.tree_width: 3 disagree; in the profile, "
                                   "set decoding.tree_width: 1 or decoding.tree: width")
    assert refused(chain_of_3, "--tree", "dynamic") == (
        "error: --tree dynamic shapes its own tree, the profile's decoding.tree_width: 3 does not apply; add "
        "--tree-width 1 (--tree-topk sets its breadth)")
    assert refused(files["profile"], "--tree", "width").endswith("--tree width needs --tree-width 2 or more "
                                                                 "(branches per block)")
    with pytest.raises(InputError, match=r"^--tree chain and the profile's decoding.tree_width: 3 disagree"):
        api.load_decoder(chain_of_3, tree="chain")
    manifest = tmp_path / "m.jsonl"  # every command that decodes refuses it as early (the check is apply_overrides')
    manifest.write_text(json.dumps({"id": "a", "images": [], "turns": [QUESTION], "category": "x"}) + "\n")
    for command in (["bench", str(manifest), "--out", str(tmp_path / "r.jsonl")], ["select-layer", str(manifest)]):
        assert_one_line_error(runner.invoke(app, [*command, "--profile", chain_of_3]),
                              "decoding.tree: chain and decoding.tree_width: 3 disagree")


def test_turn_image_quotes_its_value_once_and_tree_lists_only_the_words_it_takes(files, no_model_loading):
    args = [*files["images"], "-q", QUESTION, "--profile", files["profile"]]
    line = assert_one_line_error(invoke(*args, "--turn-image", "x"), "--turn-image takes N:IMAGE")
    assert "got 'x';" in line
    line = assert_one_line_error(invoke(*args, "--tree", "bushy"), "--tree: expected one of")
    assert line == 'error: --tree: expected one of chain, width, dynamic, got "bushy"'


# --------------------------------------------------------------------------- an inductor cache that can't be made, a full disk


def mmspec_process(*args: str, stdout=subprocess.PIPE, **env: str) -> subprocess.CompletedProcess:
    """``mmspec ARGS`` in a process of its own (its own first import of torch and transformers), with ``env`` added."""
    import os

    environment = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), **env)
    return subprocess.run([sys.executable, "-c", "from mmspec_cli.cli.app import main; main()", *args], stdout=stdout,
                          stderr=subprocess.PIPE, text=True, env=environment, timeout=300)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full here")
def test_generate_runs_past_an_unmakeable_inductor_cache_and_a_full_stdout_is_one_line(files, tmp_path):
    """Importing transformers makes TORCHINDUCTOR_CACHE_DIR (torch._dynamo's import does); without --compile nothing
    is written there, so the command runs to its output, which goes to a full disk (/dev/full): one line, exit 2,
    and nothing from Python's last flush of stdout at exit. One process checks both, as each costs its imports."""
    (tmp_path / "file").write_text("")
    with open("/dev/full", "w") as full:
        done = mmspec_process("generate", *files["images"], "-q", QUESTION, "--profile", files["profile"], "--json",
                              "--max-new-tokens", "2", stdout=full,
                              TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "file" / "cache"))
    assert (done.returncode, done.stderr) == (2, "error: writing the output failed: the disk is full; free some "
                                                 "space, or send the output to another disk\n")


def test_a_write_that_finds_no_room_is_one_line_in_every_command(tmp_path, monkeypatch, capsys):
    import errno

    import typer

    from mmspec_cli.cli.errors import handles_errors

    def writes(stream):
        return handles_errors(lambda: typer.echo("x" * 100, file=stream))

    if Path("/dev/full").exists():  # stdout on a full disk: its last flush at exit must not fail again
        full = open("/dev/full", "w")
        monkeypatch.setattr(sys, "stdout", full)
        with pytest.raises(typer.Exit) as info:
            writes(full)()
        assert info.value.exit_code == 2 and sys.stdout is not full
        sys.stdout.close()  # the null device it was set aside to
        with pytest.raises(OSError):  # what the failed write left is still there: closed here, not by the collector
            full.close()
        assert capsys.readouterr().err == ("error: writing the output failed: the disk is full; free some space, or "
                                           "send the output to another disk\n")

    def no_room(*args, **kwargs):
        raise OSError(errno.EDQUOT, "Disk quota exceeded", str(tmp_path / "out.yaml"))

    with pytest.raises(typer.Exit):
        handles_errors(no_room)()
    assert capsys.readouterr().err == (f"error: writing '{tmp_path / 'out.yaml'}' failed: the disk is full; free some "
                                       f"space and run the command again\n")


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["generate", "--help"]])
def test_help_and_version_on_a_full_disk_are_one_line(args, monkeypatch, capsys):
    """Printed by click while it parses, outside any command: the program's entry point maps them as commands do."""
    import errno

    from mmspec_cli.cli.app import main

    class Full(io.StringIO):
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sys, "argv", ["mmspec", *args])
    monkeypatch.setattr(sys, "stdout", Full())
    with pytest.raises(SystemExit) as info:
        main()
    assert info.value.code == 2
    assert capsys.readouterr().err == ("error: writing the output failed: the disk is full; free some space, or "
                                       "send the output to another disk\n")


@pytest.mark.parametrize("where", ["flag", "profile"])
def test_compiling_with_an_inductor_cache_folder_that_cant_be_made_is_one_line(files, tiny_dirs, tmp_path,
                                                                                no_model_loading, where):
    (tmp_path / "file").write_text("")
    compiling = (["--profile", write_profile(tmp_path / "c.yaml", tiny_dirs["target"], tiny_dirs["perturbed"],
                                             compile=True)] if where == "profile"
                 else ["--profile", files["profile"], "--compile"])
    for cache in (tmp_path / "file" / "cache", tmp_path / "file"):
        result = invoke(*files["images"], "-q", QUESTION, *compiling, env={"TORCHINDUCTOR_CACHE_DIR": str(cache)})
        line = assert_one_line_error(result, f"error: TORCHINDUCTOR_CACHE_DIR '{cache}' ")
        assert line.endswith("set TORCHINDUCTOR_CACHE_DIR to a folder you can write to, or unset it")


def test_a_reader_gone_from_the_pipe_ends_a_command_quietly(tmp_path, monkeypatch):
    """``mmspec ... | head -c 10``: the write after head left fails with EPIPE; click ends the command, exit 1, with
    nothing on stderr (as a command killed by SIGPIPE says nothing)."""
    import errno

    import typer

    records = tmp_path / "r.jsonl"
    records.write_text(json.dumps({"id": "a", "category": "x", "drafter": "m", "turn": 0, "token_ids": [1, 2],
                                   "new_tokens": 2, "blocks": 1, "wall_s": 0.1}) + "\n")  # a run that exits 0
    written = []

    def gone(*args, **kwargs):
        written.append(args)
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    monkeypatch.setattr(typer, "echo", gone)
    result = runner.invoke(app, ["bench", "--summarize", str(records), "--format", "json"])
    assert (result.exit_code, result.stderr, len(written)) == (1, "", 1)


# --------------------------------------------------------------------------- a closed stdout


def mmspec_with_stdout_closed(*args: str) -> subprocess.CompletedProcess:
    """``mmspec ARGS >&-`` through the console entry point, with this worktree's code."""
    command = " ".join(["exec", sys.executable, "-c", "'from mmspec_cli.cli.app import main; main()'",
                        *(f"'{a}'" for a in args), ">&-"])
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(["sh", "-c", command], capture_output=False, stderr=subprocess.PIPE, text=True, env=env,
                          timeout=300)


def test_generate_with_stdout_closed_runs_to_the_end(files):
    done = mmspec_with_stdout_closed("generate", *files["images"], "-q", QUESTION, "--profile", files["profile"])
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "isatty" not in done.stderr
    assert "new tokens" in done.stderr  # the summary line still reaches stderr


def test_bench_summarize_with_stdout_closed_exits_with_its_own_code(tmp_path):
    records = tmp_path / "r.jsonl"
    records.write_text(json.dumps({"id": "a", "category": "x", "drafter": "m", "error": "boom"}) + "\n")
    done = mmspec_with_stdout_closed("bench", "--summarize", str(records))
    assert done.returncode == 1, done.stderr  # a failed sample, as with stdout open
    assert "Traceback" not in done.stderr and "NoneType" not in done.stderr


def test_is_terminal_is_false_for_missing_or_closed_streams(tmp_path):
    from mmspec_cli.cli.display import is_terminal

    closed = open(tmp_path / "f", "w")
    closed.close()
    assert not is_terminal(None) and not is_terminal(closed) and not is_terminal(object())


# --------------------------------------------------------------------------- flag errors and help


@pytest.mark.parametrize("args, expected", [
    (["generate", "--gamma", "five"], "error: --gamma: 'five' is not a valid integer; see `mmspec generate --help`"),
    (["compare", "--temperature", "warm"], "error: --temperature: 'warm' is not a valid number"),
    (["profile-latency", "--repeat", "x" * 300], "error: --repeat: 'xxxxxxxx"),
    (["generate", "--no-such-flag"], "error: No such option: --no-such-flag"),
    (["no-such-command"], "error: No such command 'no-such-command'"),
])
def test_type_and_usage_errors_are_one_line(args, expected):
    line = assert_one_line_error(runner.invoke(app, args), "")
    assert line.startswith(expected) and len(line) < 160  # a long bad value is quoted cut short


@pytest.mark.parametrize("command", [[], ["generate"], ["compare"], ["bench"], ["profile-latency"],
                                     ["select-layer"]])
def test_flags_show_no_metavar_in_help(command):
    result = runner.invoke(app, [*command, "--help"])
    assert result.exit_code == 0 and "--help" in result.stdout
    assert "<bool>" not in result.stdout


# --------------------------------------------------------------------------- progress bars at 80 and 60 columns


def rendered(progress, width: int) -> str:
    console = Console(file=io.StringIO(), width=width, color_system=None)
    with console.capture() as capture:
        console.print(progress.make_tasks_table(progress.tasks))
    return capture.get()


TIME = r"\d+:\d\d:\d\d"


@pytest.mark.parametrize("width", [80, 60])
def test_the_bench_bar_keeps_count_elapsed_and_eta_readable(width):
    from mmspec_cli.bench.progress import BenchProgress

    bar = BenchProgress(400, ["ar", "m", "t", "tabed:mtcp"], enabled=True,
                        console=Console(file=io.StringIO(), width=width))
    for drafter, blocks in (("ar", 30), ("m", 10), ("t", 11), ("tabed:mtcp", 9)):
        bar.turn_done({"drafter": drafter, "new_tokens": 30, "blocks": blocks})
    bar.sample("llava-bench-in-the-wild-[042]-a-long-sample-id", "tabed:mtcp")
    [line] = rendered(bar._progress, width).splitlines()
    assert len(line) <= width
    assert re.search(rf" 4/400 {TIME} ETA {TIME} ", line), line  # whole, not cut to "…"
    assert line.startswith("tabed:mt") and "…" in line  # the description (drafter first) and the τ note gave way


@pytest.mark.parametrize("width", [80, 60])
def test_the_train_head_bar_keeps_count_elapsed_and_eta_readable(width):
    from mmspec_cli.training.progress import Phase

    phase = Phase("training vispec head", 12000, done=250, enabled=True)
    phase.note("loss 0.123 top-1 0.456 | pass 3: loss 0.789 top-1 0.321 and more text to make it long")
    phase.advance(3)
    [line] = rendered(phase._progress, width).splitlines()
    assert len(line) <= width
    assert re.search(rf"  253/12000 {TIME} ETA ({TIME}|-:--:--) ", line), line
    assert "…" in line
