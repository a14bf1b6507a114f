"""``train-head``'s run (``mmspec_cli/training/run.py``) as a new user meets it: other people's folders, full
disks, long names, wild numbers, Ctrl-C, edited samples and heads used with the wrong target. Each fault is one line
(exit 2, or 130 for Ctrl-C) and leaves nothing behind that a later run would trust.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from mmspec_cli.models import writing
from mmspec_cli.cli.app import app
from mmspec_cli.models.head import DraftHead
from mmspec_cli.models.head_files import head_config, load_head, save_head
from mmspec_cli.models.profiles import load_profile
from mmspec_cli.training import answers as answers_mod
from mmspec_cli.training.answers import AnswerSettings, generate_answers
from mmspec_cli.training.corpus import Conversation
from mmspec_cli.training.run import TrainHeadSettings, train_head
from mmspec_cli.training.trainer import CtrlC, TrainingInterrupted

from tests import tiny
from tests.helpers import assert_one_line_error, tiny_files, write_profile

runner = CliRunner()
QUESTIONS = ["what is in the image?", "describe the picture in detail", "how many shapes are there?"]
ANSWERS = AnswerSettings(temperature=1.0, max_new_tokens=6, suffix="", seed=0, batch_size=2)


@pytest.fixture(scope="module")
def files(tiny_dirs, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hardening")
    files = tiny_files(root, tiny_dirs, max_new_tokens=8)
    manifest = root / "manifest.jsonl"
    manifest.write_text("".join(json.dumps({"id": f"s{i}", "images": [Path(files["images"][i % 2]).name],
                                            "turns": [q], "category": "demo"}) + "\n" for i, q in enumerate(QUESTIONS)))
    return {**files, "manifest": str(manifest)}


def command(files, out, *args: str, kind: str = "eagle", source: str | None = None) -> list[str]:
    return ["train-head", kind, source or files["manifest"], "--out", str(out), "--profile", files["profile"],
            "--steps", "2", "--answer-tokens", "6", "--answer-suffix", "", "--held-out", "0", "--batch-size", "2",
            "--lr", "1e-2", *args]


def run(files, out, *args: str, **kw):
    return runner.invoke(app, command(files, out, *args, **kw))


def one_line(result, fragment: str, code: int = 2) -> str:
    return assert_one_line_error(result, fragment, code=code, stdout_allowed=True)


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def settings(out: Path, source: str, **kw) -> TrainHeadSettings:
    base = dict(kind="eagle", source=source, out=out, steps=4, lr=1e-2, mtp=2, batch_size=2, checkpoint_every=2,
                held_out=0, answers=ANSWERS, measure_before=False)
    return TrainHeadSettings(**{**base, **kw})


# --------------------------------------------------------------------------- nothing a user owns is overwritten


def test_a_model_folder_is_refused_and_left_untouched(files, tiny_dirs, tmp_path):
    model = tmp_path / "my-model"
    shutil.copytree(tiny_dirs["target"], model)
    before = digest(model)
    one_line(run(files, model), "holds files train-head did not write")
    one_line(run(files, model, "--resume"), "holds files train-head did not write")
    assert digest(model) == before
    assert not (tmp_path / "my-model.answers.jsonl").exists()


def test_a_folder_with_one_foreign_file_is_refused(files, tmp_path):
    out = tmp_path / "notes"
    out.mkdir()
    (out / "todo.txt").write_text("mine")
    one_line(run(files, out), "todo.txt")
    assert (out / "todo.txt").read_text() == "mine"


@pytest.mark.parametrize("out, fragment", [("", "--out is empty"), ("/", "the root folder"),
                                           (".", "holds files train-head did not write"),
                                           ("..", "holds files train-head did not write")])
def test_special_outs_are_one_line(files, tmp_path, monkeypatch, out, fragment):
    work = tmp_path / "work"
    work.mkdir()
    (work / "keep.txt").write_text("x")
    monkeypatch.chdir(work)
    one_line(run(files, out), fragment)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"]  # nothing written beside it either


def test_a_failed_run_leaves_nothing_behind(files, tmp_path):
    out = tmp_path / "new" / "deeper" / "head"
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not a png")
    source = tmp_path / "all-broken.jsonl"
    source.write_text(json.dumps({"id": "bad", "images": [str(broken)], "turns": ["what?"], "category": "x"}) + "\n")
    one_line(run(files, out, source=str(source)), "all 1 failed")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["all-broken.jsonl", "broken.png"]


def test_a_finished_head_is_trained_again_in_place(files, tmp_path):
    out = tmp_path / "head"
    assert run(files, out).exit_code == 0
    first = digest(out)
    result = run(files, out, "--lr", "2e-2")
    assert result.exit_code == 0, result.stderr
    assert digest(out) != first and set(digest(out)) == {"config.json", "model.safetensors"}


def test_weights_alone_are_not_train_heads_and_are_refused(files, tmp_path):
    out = tmp_path / "weights"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"someone's weights")
    one_line(run(files, out), "holds files train-head did not write (model.safetensors)")
    assert (out / "model.safetensors").read_bytes() == b"someone's weights"


def test_answers_paths_that_cant_be_used_are_one_line(files, tmp_path):
    one_line(run(files, tmp_path / "h", "--answers", str(Path(files["images"][0]) / "a.jsonl")),
             "is a file, not a folder")
    one_line(run(files, tmp_path / "h", "--answers", files["images"][0]), "is not an answers file of mmspec")
    one_line(run(files, tmp_path / "h", "--answers", str(tmp_path)), "is a folder")
    assert not (tmp_path / "h").exists()


def test_a_name_too_long_under_new_folders_leaves_none_of_them(files, tmp_path):
    out = tmp_path / "new" / "sub" / ("y" * 241)  # the folder fits; DIR.answers.jsonl beside it does not
    one_line(run(files, out), "the answers file beside it")
    assert not (tmp_path / "new").exists()


# --------------------------------------------------------------------------- full disks and long names


def full_disk_for(monkeypatch, name: str) -> None:
    """Writes of the temporary file of ``name`` go to /dev/full (the disk fills right there)."""
    real = writing.open_for_writing

    def opener(path: Path):
        return open("/dev/full", "wb") if path.name == name + ".tmp" else real(path)

    monkeypatch.setattr(writing, "open_for_writing", opener)


def test_a_full_disk_at_a_checkpoint_keeps_the_previous_one(files, tiny_dirs, tmp_path, monkeypatch):
    profile = load_profile(files["profile"])
    out = tmp_path / "head"
    checkpoints: list[int] = []

    def fill_after_first(step, total, stats):
        if step == 3:  # the checkpoint of step 2 is written; the one of step 4 meets a full disk
            full_disk_for(monkeypatch, "checkpoint.pt")
        checkpoints.append(step)

    with pytest.raises(writing.WriteFailed, match="the disk is full; the checkpoint of step 2 is kept; free some "
                                                   "space and run the same command with --resume"):
        train_head(profile, settings(out, files["manifest"]), progress=False, on_step=fill_after_first)
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint.pt"]
    assert torch.load(out / "checkpoint.pt", weights_only=True)["step"] == 2
    monkeypatch.undo()
    steps = []
    train_head(profile, settings(out, files["manifest"], resume=True), progress=False,
               on_step=lambda step, total, stats: steps.append(step))
    assert steps == [3, 4]


def test_a_full_disk_for_the_head_keeps_the_checkpoint_and_the_old_head(files, tmp_path, monkeypatch):
    out = tmp_path / "head"
    assert run(files, out).exit_code == 0
    before = digest(out)
    full_disk_for(monkeypatch, "model.safetensors")
    line = one_line(run(files, out, "--lr", "3e-2"), "the disk is full")
    assert "training finished and its checkpoint (step 2) is kept" in line and "--resume" in line
    assert "answers" in line and "are kept and reused" in line  # the answers stay, and the line says so
    after = digest(out)
    assert after.pop("checkpoint.pt") and after == before  # the old head whole, the new training's checkpoint kept
    monkeypatch.undo()
    assert run(files, out, "--lr", "3e-2", "--resume").exit_code == 0
    assert set(digest(out)) == {"config.json", "model.safetensors"}


def test_a_full_disk_for_the_answers_cuts_back_to_whole_records(files, tiny_models, tmp_path, monkeypatch):
    path = tmp_path / "a.jsonl"
    conversations = [Conversation(f"c{i}", (QUESTIONS[i % 3],), (), lambda: tiny.images(1)) for i in range(4)]
    writes = []
    real = writing.open_for_appending

    def fills_on_second_batch(p: Path):
        writes.append(p)
        return open("/dev/full", "ab") if len(writes) == 2 else real(p)

    monkeypatch.setattr(writing, "open_for_appending", fills_on_second_batch)
    with pytest.raises(writing.WriteFailed, match="the disk is full; the 2 answers written before are kept"):
        generate_answers(tiny_models["target"], "t", conversations, path, ANSWERS)
    lines = path.read_text().splitlines()
    assert len(lines) == 1 + 2 and all(json.loads(line) for line in lines)


@pytest.fixture
def file_size_limit():
    """Files of this process may grow to ``limit`` bytes (``ulimit -f``): a real write failure, and one that a
    large checkpoint meets inside torch's zip writer (which raises its own RuntimeError over the OSError)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    assert signal.getsignal(signal.SIGXFSZ) == signal.SIG_IGN  # Python ignores it: a write fails with EFBIG

    def limit(size: int) -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, hard))

    yield limit
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_a_checkpoint_too_large_to_write_is_one_line_and_leaves_no_folder(files, tmp_path, file_size_limit):
    profile = load_profile(files["profile"])
    out = tmp_path / "head"
    answers = tmp_path / "answers.jsonl"
    file_size_limit(64_000)  # the answers fit, the tiny head's first checkpoint (weights and AdamW state) doesn't
    with pytest.raises(writing.WriteFailed, match="larger than this process may write .*no earlier checkpoint was "
                                                  "written.*answers .* are kept and reused"):
        train_head(profile, settings(out, files["manifest"], answers_file=answers), progress=False)
    assert not out.exists()  # made by the failed checkpoint, removed again
    assert answers.is_file()


def test_names_too_long_are_one_line(files, tmp_path):
    long = "x" * 300
    one_line(run(files, tmp_path / long), "too long for the file system")
    one_line(run(files, tmp_path / "o", source=str(tmp_path / long)), "too long for the file system")
    args = command(files, tmp_path / "o")
    args[args.index("--profile") + 1] = str(tmp_path / (long + ".yaml"))
    one_line(runner.invoke(app, args), "too long for the file system")
    bench = runner.invoke(app, ["bench", files["manifest"], "--drafters", "ar", "--profile", files["profile"],
                                "--out", str(tmp_path / (long + ".jsonl"))])
    one_line(bench, "too long for the file system")


# --------------------------------------------------------------------------- numbers


@pytest.mark.parametrize("args, fragment", [
    (["--lr", "inf"], "--lr: expected a finite positive number"), (["--lr", "nan"], "--lr"),
    (["--answer-temperature", "inf"], "--answer-temperature"), (["--steps", str(10**23)], "would never finish"),
    (["--epochs", str(10**9)], "would never finish")])
def test_numbers_that_cant_work_are_refused_before_loading(files, tmp_path, no_model_loading, args, fragment):
    full = command(files, tmp_path / "o")
    for flag in ("--lr", "--steps"):
        if flag in args:
            i = full.index(flag)
            del full[i:i + 2]
    one_line(runner.invoke(app, full + args), fragment)
    assert not (tmp_path / "o").exists()


def test_a_diverging_run_writes_no_head_and_no_unusable_checkpoint(files, tmp_path):
    """--lr 1e30: the first update throws the weights past float16's range; nothing of it is written."""
    out = tmp_path / "head"
    args = command(files, out, "--checkpoint-every", "1")
    args[args.index("--lr") + 1] = "1e30"
    line = one_line(runner.invoke(app, args), "training stopped at step 1: the weights grew past float16's range")
    assert "no checkpoint was written" in line and "lower --lr" in line
    assert not out.exists()


def test_a_loss_turning_nan_stops_before_its_update_keeping_the_last_checkpoint(files, tmp_path, monkeypatch):
    from mmspec_cli.training import passes

    real = passes.HeadObjective.forward
    calls = []

    def nan_at_third_step(self, batch, generator=None):
        loss, stats = real(self, batch, generator)
        calls.append(1)
        return (loss * float("nan") if len(calls) == 3 else loss), stats

    monkeypatch.setattr(passes.HeadObjective, "forward", nan_at_third_step)
    profile = load_profile(files["profile"])
    out = tmp_path / "head"
    with pytest.raises(Exception, match="training stopped at step 3: the loss is nan .*the checkpoint of step 2 is "
                                        "kept") as raised:
        train_head(profile, settings(out, files["manifest"], steps=4, checkpoint_every=2), progress=False)
    assert type(raised.value).__name__ == "TrainingDiverged"
    state = torch.load(out / "checkpoint.pt", weights_only=True)
    assert state["step"] == 2 and all(torch.isfinite(v).all() for v in state["head"].values())
    assert not (out / "model.safetensors").exists()


def test_a_head_with_nan_weights_is_refused(tiny_models, tmp_path):
    target = tiny_models["target"]
    head = DraftHead(head_config(target), "eagle")
    with torch.no_grad():
        head.fc.weight[0, 0] = float("nan")
    save_head(head, tmp_path / "nan", target=target.name, dtype=torch.float32)
    with pytest.raises(Exception, match="fc.weight holds NaN or infinite values"):
        load_head(str(tmp_path / "nan"), None, None, target)


def test_a_batch_larger_than_the_samples_is_capped_and_said(files, tmp_path):
    result = run(files, tmp_path / "h", "--batch-size", "100000", "--json")
    assert result.exit_code == 0, result.stderr
    assert "--batch-size 100000 is more than the 3 answered turns" in result.stderr
    assert json.loads(result.stdout)["batch_size"] == 3


def test_held_out_must_leave_samples_to_train_on(files, tmp_path):
    args = command(files, tmp_path / "o")
    args[args.index("--held-out") + 1] = "3"
    one_line(runner.invoke(app, args), "--held-out 3: SOURCE")
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.answers.jsonl").exists()


def test_held_out_samples_that_all_fail_are_not_a_block_efficiency_of_zero(files, tmp_path):
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not a png")
    source = tmp_path / "m.jsonl"
    lines = [json.loads(line) for line in Path(files["manifest"]).read_text().splitlines()]
    lines = [{**x, "images": [files["images"][0]]} for x in lines] + [
        {"id": "bad", "images": [str(broken)], "turns": ["what?"], "category": "x"}]
    source.write_text("".join(json.dumps(x) + "\n" for x in lines))
    args = command(files, tmp_path / "h", source=str(source))
    args[args.index("--held-out") + 1] = "1"
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.stderr
    assert "none of the 1 held-out samples could be decoded" in result.stdout
    assert "0.000" not in result.stdout


def test_the_answer_tokens_hint_names_its_own_flag(files, tmp_path):
    result = run(files, tmp_path / "o", "--answer-tokens", "5000")
    line = one_line(result, "--answer-tokens is 5000")
    assert "lower --answer-tokens to" in line and "--max-new-tokens" not in line


# --------------------------------------------------------------------------- --resume


def test_resume_with_nothing_to_resume_is_one_line(files, tmp_path, no_model_loading):
    one_line(run(files, tmp_path / "none", "--resume"), "nothing to resume; drop --resume")
    assert not (tmp_path / "none").exists()


def test_resume_accepts_the_same_target_with_a_trailing_slash(files, tiny_dirs, tmp_path):
    profile = load_profile(files["profile"])
    out = tmp_path / "head"

    def stop(step, total, stats):
        if step == 3:
            raise KeyboardInterrupt

    with pytest.raises(TrainingInterrupted):
        train_head(profile, settings(out, files["manifest"]), progress=False, on_step=stop)
    slashed = load_profile(write_profile(tmp_path / "slash.yaml", tiny_dirs["target"] + "/", tiny_dirs["perturbed"],
                                         max_new_tokens=8))
    steps = []
    train_head(slashed, settings(out, files["manifest"], resume=True), progress=False,
               on_step=lambda step, total, stats: steps.append(step))
    assert steps == [4]


def test_resume_over_a_finished_imitation_network_names_it(files, tmp_path):
    out = tmp_path / "in"
    assert run(files, out, "--ssd-layer", "1", kind="imitation").exit_code == 0
    one_line(run(files, out, "--resume"), "is an imitation network's, not an eagle head's")
    one_line(run(files, out, "--ssd-layer", "1", "--resume", kind="imitation"),
             "holds a finished imitation network and no checkpoint")


# --------------------------------------------------------------------------- Ctrl-C


@pytest.fixture
def interruptible():
    """Ctrl-C as a terminal delivers it: a shell starts background jobs with SIGINT ignored, and Python then installs
    no KeyboardInterrupt handler (nor does mmspec its own), so a suite run as a background job sets it here."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_ctrl_c_in_training_saves_a_checkpoint_and_resume_finishes_as_if_uninterrupted(files, tmp_path, interruptible):
    profile = load_profile(files["profile"])
    whole = tmp_path / "whole"
    train_head(profile, settings(whole, files["manifest"], steps=5, checkpoint_every=100), progress=False)
    out = tmp_path / "cut"

    def ctrl_c_at_3(step, total, stats):
        if step == 3:
            os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C, between steps 3 and 4

    with pytest.raises(TrainingInterrupted, match="the checkpoint of step 3 of 5 is saved"):
        train_head(profile, settings(out, files["manifest"], steps=5, checkpoint_every=100), progress=False,
                   on_step=ctrl_c_at_3)
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint.pt"]  # no checkpoint was due before step 5
    steps = []
    train_head(profile, settings(out, files["manifest"], steps=5, checkpoint_every=100, resume=True),
               progress=False, on_step=lambda step, total, stats: steps.append(step))
    assert steps == [4, 5]
    assert (out / "model.safetensors").read_bytes() == (whole / "model.safetensors").read_bytes()


def test_ctrl_c_waits_for_an_update_to_finish(interruptible):
    with CtrlC() as ctrl_c:
        with pytest.raises(KeyboardInterrupt):
            with ctrl_c.deferred():
                os.kill(os.getpid(), signal.SIGINT)
                finished = True  # reached: the signal waited for the block's end
        assert finished
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):  # outside the block it lands at once
                pass


def test_the_command_says_what_ctrl_c_saved_and_how_to_continue(files, tmp_path, monkeypatch):
    from mmspec_cli.training import run as run_mod

    out = tmp_path / "head"

    def interrupted(profile, settings, **kw):
        out.mkdir()
        (out / "checkpoint.pt").write_bytes(b"")
        raise TrainingInterrupted(f"the checkpoint of step 7 of 9 is saved in {out}")

    monkeypatch.setattr(run_mod, "train_head", interrupted)
    result = run(files, out)
    assert result.exit_code == 130
    [line] = result.stderr.strip().splitlines()[-1:]
    assert line.startswith(f"interrupted: the checkpoint of step 7 of 9 is saved in {out}; to continue, run: "
                           f"mmspec train-head eagle")
    assert line.endswith("--resume")


def test_ctrl_c_after_training_says_the_checkpoint_is_kept_and_resume_finishes(files, tmp_path, monkeypatch):
    from mmspec_cli.training import acceptance

    real = acceptance.measure
    out = tmp_path / "head"
    calls = []

    def ctrl_c_after_training(*args, **kw):  # the first call measures before training, the second after it
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kw)

    monkeypatch.setattr(acceptance, "measure", ctrl_c_after_training)
    args = command(files, out)
    args[args.index("--held-out") + 1] = "1"
    result = runner.invoke(app, args)
    assert result.exit_code == 130
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"interrupted: the checkpoint in {out} is kept; to continue, run: ") and line.endswith(
        "--resume")
    monkeypatch.setattr(acceptance, "measure", real)
    resumed = runner.invoke(app, args + ["--resume"])
    assert resumed.exit_code == 0, resumed.stderr
    assert set(digest(out)) == {"config.json", "model.safetensors"}


def test_ctrl_c_while_answering_says_the_answers_are_kept(files, tmp_path, monkeypatch):
    real = answers_mod.sample_batch
    calls = []

    def ctrl_c_on_second_batch(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kw)

    monkeypatch.setattr(answers_mod, "sample_batch", ctrl_c_on_second_batch)
    source = tmp_path / "two-turns.jsonl"  # the second turns are a second batch
    source.write_text("".join(json.dumps({"id": f"s{i}", "images": [files["images"][0]], "turns": QUESTIONS[:2],
                                          "category": "x"}) + "\n" for i in range(2)))
    result = run(files, tmp_path / "head", source=str(source))
    assert result.exit_code == 130
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("interrupted: 2 answers are saved in") and "reused" in line
    assert not line.endswith("--resume")  # no checkpoint yet: the same command again


# --------------------------------------------------------------------------- what is reused must still be true


def test_answers_are_reused_only_for_the_same_prompt_and_image_bytes(files, tiny_models, tmp_path, monkeypatch):
    target = tiny_models["target"]
    image = tmp_path / "img.png"
    shutil.copy(files["images"][0], image)
    manifest = tmp_path / "m.jsonl"

    def write(question: str) -> list:
        manifest.write_text(json.dumps({"id": "a", "images": [str(image)], "turns": [question],
                                        "category": "x"}) + "\n")
        from mmspec_cli.training.corpus import conversations

        return conversations(str(manifest))

    sampled = []
    real = answers_mod.sample_batch
    monkeypatch.setattr(answers_mod, "sample_batch", lambda *a, **k: sampled.append(1) or real(*a, **k))
    path = tmp_path / "answers.jsonl"
    generate_answers(target, "t", write(QUESTIONS[0]), path, ANSWERS)
    generate_answers(target, "t", write(QUESTIONS[0]), path, ANSWERS)
    assert len(sampled) == 1  # unchanged: reused
    [edited] = generate_answers(target, "t", write(QUESTIONS[1]), path, ANSWERS)
    assert len(sampled) == 2 and QUESTIONS[1] in edited.prompt
    shutil.copy(files["images"][1], image)  # another picture under the same name
    generate_answers(target, "t", write(QUESTIONS[1]), path, ANSWERS)
    assert len(sampled) == 3
    image.write_bytes(b"broken")
    [failed] = generate_answers(target, "t", write(QUESTIONS[1]), path, ANSWERS)
    assert failed.error is not None
    lines = len(path.read_text().splitlines())
    generate_answers(target, "t", write(QUESTIONS[1]), path, ANSWERS)
    assert len(path.read_text().splitlines()) == lines  # the same failure is not recorded twice
    shutil.copy(files["images"][1], image)  # fixed: answered, not the old failure
    [fixed] = generate_answers(target, "t", write(QUESTIONS[1]), path, ANSWERS)
    assert fixed.error is None and fixed.answer_ids


def test_runs_of_two_kinds_share_one_answers_file(files, tmp_path, monkeypatch):
    shared = tmp_path / "answers" / "shared.jsonl"
    shared.parent.mkdir()  # --answers makes no folder
    assert run(files, tmp_path / "eagle", "--answers", str(shared)).exit_code == 0
    monkeypatch.setattr(answers_mod, "sample_batch", lambda *a, **k: pytest.fail("answered again"))
    result = run(files, tmp_path / "vispec", "--answers", str(shared), kind="vispec")
    assert result.exit_code == 0, result.stderr
    assert not (tmp_path / "eagle.answers.jsonl").exists() and not (tmp_path / "vispec.answers.jsonl").exists()


# --------------------------------------------------------------------------- a network used with another target


def test_a_head_used_with_another_target_of_the_same_shape_warns(files, tiny_dirs, tiny_models, tmp_path, capsys):
    out = tmp_path / "head"
    assert run(files, out).exit_code == 0
    capsys.readouterr()
    load_head(str(out), None, None, tiny_models["target"])
    assert "warning" not in capsys.readouterr().err
    load_head(str(out), None, None, tiny_models["perturbed"])  # same shape, other weights
    err = capsys.readouterr().err
    assert err.startswith("warning: head") and "trained for another target" in err and err.count("\n") == 1


def test_an_imitation_network_used_with_another_target_warns(files, tiny_models, tmp_path, capsys):
    from mmspec_cli.models.imitation import load_imitation

    out = tmp_path / "in"
    assert run(files, out, "--ssd-layer", "1", kind="imitation").exit_code == 0
    capsys.readouterr()
    load_imitation(str(out), 1, tiny_models["target"])
    assert "warning" not in capsys.readouterr().err
    load_imitation(str(out), 1, tiny_models["perturbed"])
    assert "warning: ssd.imitation" in capsys.readouterr().err
