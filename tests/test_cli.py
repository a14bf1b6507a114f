"""Tests for the ``mmspec`` command line: output modes, flag overrides, error mapping.

Every run uses the tiny float64 LLaVA models of ``conftest.py`` on CPU.
"""

import io
import json
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

from tests.helpers import assert_one_line_error, tiny_files, write_profile

QUESTION = "what is in the image?"
MAX_NEW = 10
STATS_KEYS = {"new_tokens", "blocks", "block_efficiency", "acceptance_rate", "wall_s", "tokens_per_s"}
TURN_KEYS = {"question", "text", "token_ids", "stats", "blocks"}
RAW_PROMPT = "USER: <image>\n<image>\nwhat is it? ASSISTANT:"

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
    batch = target.processor(images=load_images(image_paths), text=prompt, return_tensors="pt")
    batch["pixel_values"] = batch["pixel_values"].to(torch.float64)
    out = target.model.generate(**batch, do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, batch["input_ids"].shape[1]:].tolist()


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
    assert_one_line_error(result, "tokenizers differ")


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
