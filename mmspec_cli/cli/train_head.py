"""``mmspec train-head``: train an EAGLE or ViSpec draft head for a profile's target (:mod:`mmspec_cli.training`).

This module reads and checks the flags; everything else happens in
:func:`mmspec_cli.training.run.train_head`, which refuses a bad ``--out``, a checkpoint of another
head and an empty SOURCE before any model loads.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated

import typer

from mmspec_cli.choices import EAGLE3, HEAD_KINDS, IMITATION, TRAIN_LOSSES
from mmspec_cli.cli.errors import shorten
from mmspec_cli.cli.options import ProfileName, Threads, check_threads, command_line
from mmspec_cli.errors import InputError
from mmspec_cli.models.profiles import load_profile
from mmspec_cli.models.prompts import shorten as shorten_path
from mmspec_cli.training.out_folder import CHECKPOINT, resolve_out
from mmspec_cli.training.limits import check_steps


def train_head(
    ctx: typer.Context,
    kind: Annotated[str, typer.Argument(metavar="KIND", show_default=False, help=(
        "vispec (ViSpec's head: vision adaptor, global image feature), eagle (EAGLE-2's head), eagle3 (EAGLE-3's "
        "head: three target layers fused, its own draft vocabulary; what vLLM and SGLang serve), or imitation "
        "(FastVLM's imitation network for ssd, after --ssd-layer N)."))],
    source: Annotated[str, typer.Argument(metavar="SOURCE", show_default=False, help=(
        "Prompts the target answers: a JSONL manifest, a built-in suite, demo-train (the demo family's "
        "training corpus) or a dataset id."))],
    out: Annotated[str, typer.Option(metavar="DIR", show_default=False, help=(
        "A new or empty folder for the head (config.json, model.safetensors), or one train-head wrote; answers go "
        "beside it, to DIR.answers.jsonl."))],
    profile: ProfileName = None,
    epochs: Annotated[int | None, typer.Option(metavar="N", help="Passes over the answers (default 20, ViSpec's).")] = None,
    steps: Annotated[int | None, typer.Option(metavar="N", help="Optimizer steps; overrides --epochs.")] = None,
    lr: Annotated[float, typer.Option(metavar="X", help=(
        "Peak learning rate (ViSpec's script: 3e-5 for 7B targets; tiny heads want about 1e-3)."))] = 3e-5,
    mtp: Annotated[int | None, typer.Option(metavar="K", help=(
        "Multi-token prediction passes: 1 = teacher forcing only; K feeds the head its own outputs K-1 times "
        "(default 3; eagle3: 7, EAGLE-3's training-time test)."))] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the training whose checkpoint DIR holds.")] = False,
    limit: Annotated[int | None, typer.Option(metavar="N", help="Use the first N samples of SOURCE.")] = None,
    seed: Annotated[int, typer.Option(metavar="N", help="Seed of the answers' sampling, the head and the data order.")] = 0,
    batch_size: Annotated[int, typer.Option(metavar="N", help="Sequences per optimizer step.")] = 8,
    checkpoint_every: Annotated[int, typer.Option(metavar="N", help="Write a checkpoint every N steps.")] = 200,
    held_out: Annotated[int | None, typer.Option(metavar="N", help=(
        "Keep the last N samples of SOURCE out of training and measure acceptance on them (default: a tenth, "
        "at most 10; 0: none)."))] = None,
    loss: Annotated[str | None, typer.Option(metavar="vispec|ce", help=(
        "vispec (default): 10·L1 + 0.1·ListMLE (ViSpec's code); ce: cross-entropy (ViSpec's paper). eagle and vispec "
        "heads only: eagle3 trains on soft cross-entropy over its draft vocabulary."))] = None,
    answer_temperature: Annotated[float, typer.Option(metavar="T", help=(
        "Temperature the target answers at (0: greedy)."))] = 1.0,
    answer_suffix: Annotated[str | None, typer.Option(metavar="TEXT", help=(
        "Appended to every prompt (default: ViSpec's \"Please answer with at least 1000 words.\"; '' for none)."))] = None,
    answer_tokens: Annotated[int, typer.Option(metavar="N", help="At most N tokens per answer.")] = 1024,
    answers: Annotated[str | None, typer.Option(metavar="FILE", show_default=False, help=(
        "The answers file (default: DIR.answers.jsonl): name the same file in runs of several kinds to answer "
        "once (a run waits while another answers into it, then reuses its answers)."))] = None,
    ssd_layer: Annotated[int | None, typer.Option(metavar="N", help=(
        "imitation: the exit layer the network follows (ssd.layer of the profiles that will use it)."))] = None,
    draft_vocab: Annotated[int | None, typer.Option(metavar="N", help=(
        "eagle3: the draft vocabulary, the N most frequent tokens of the target's answers (default 32000, or the "
        "target's vocabulary if smaller)."))] = None,
    threads: Threads = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as one JSON object.")] = False,
) -> None:
    """Train a draft head (ViSpec, EAGLE-2 or EAGLE-3) for the profile's target with ViSpec's recipe, or FastVLM's imitation network for ssd.

    The target answers SOURCE's prompts (sampled, stored as JSONL beside DIR, reused and resumed); the head learns from the target's own features and distributions over those answers, with multi-token passes. Run it under `accelerate launch` on several GPUs.
    """
    if kind not in (*HEAD_KINDS, IMITATION):
        raise InputError(f"KIND: expected one of {', '.join((*HEAD_KINDS, IMITATION))}, got {shorten(kind)}")
    if kind == IMITATION and ssd_layer is None:
        raise InputError("train-head imitation needs --ssd-layer N, the exit layer the network follows "
                         "(`mmspec select-layer` suggests one)")
    if kind != IMITATION and ssd_layer is not None:
        raise InputError(f"--ssd-layer is for train-head imitation; a {shorten(kind)} head reads the target's last layer")
    if kind != EAGLE3 and draft_vocab is not None:
        raise InputError(f"--draft-vocab is for train-head eagle3; a {shorten(kind)} head drafts over the target's "
                         f"whole vocabulary")
    if kind == EAGLE3 and loss is not None:
        raise InputError("--loss is for eagle and vispec heads; an eagle3 head trains on soft cross-entropy over its "
                         "draft vocabulary (EAGLE-3's): drop --loss")
    loss = loss or "vispec"
    if loss not in TRAIN_LOSSES:
        raise InputError(f"--loss: expected one of {', '.join(TRAIN_LOSSES)}, got {shorten(loss)}")
    for flag, value in (("--epochs", epochs), ("--steps", steps), ("--limit", limit), ("--mtp", mtp),
                        ("--batch-size", batch_size), ("--checkpoint-every", checkpoint_every),
                        ("--answer-tokens", answer_tokens), ("--draft-vocab", draft_vocab)):
        if value is not None and value < 1:
            raise InputError(f"{flag}: expected an integer >= 1, got {value}")
    for flag, value in (("--epochs", epochs), ("--steps", steps)):
        if value is not None:
            check_steps(value, flag)
    if held_out is not None and held_out < 0:
        raise InputError(f"--held-out: expected an integer >= 0, got {held_out}")
    if not (math.isfinite(lr) and lr > 0):
        raise InputError(f"--lr: expected a finite positive number, got {lr:g}")
    if not (math.isfinite(answer_temperature) and answer_temperature >= 0):
        raise InputError(f"--answer-temperature: expected a finite number >= 0, got {answer_temperature:g}")
    if not 0 <= seed < 2**63:
        raise InputError(f"--seed: expected an integer in [0, 2^63), got {seed}")
    folder = resolve_out(out)
    answers_at = None if answers is None else answers_file(answers)
    chosen = load_profile(profile)
    threads = check_threads(threads)

    from mmspec_cli.models.threads import apply_threads
    from mmspec_cli.training.answers import LONG_ANSWER_SUFFIX, AnswerSettings
    from mmspec_cli.training.eagle3 import DEFAULT_TTT_STEPS
    from mmspec_cli.training.run import DEFAULT_MTP, TrainHeadSettings, train_head as run

    settings = TrainHeadSettings(
        kind=kind, source=source, out=folder, epochs=epochs, steps=steps, lr=lr, resume=resume, draft_vocab=draft_vocab,
        mtp=mtp if mtp is not None else (DEFAULT_TTT_STEPS if kind == EAGLE3 else DEFAULT_MTP),
        limit=limit, seed=seed, batch_size=batch_size, checkpoint_every=checkpoint_every, held_out=held_out,
        loss=loss, ssd_layer=ssd_layer, answers=AnswerSettings(temperature=answer_temperature, max_new_tokens=answer_tokens,
                                          suffix=LONG_ANSWER_SUFFIX if answer_suffix is None else answer_suffix,
                                          seed=seed),
        answers_file=answers_at)
    try:
        report = run(chosen, settings, on_target=lambda target: apply_threads(threads, target.model))
    except KeyboardInterrupt as exc:
        saved = getattr(exc, "saved", None)  # training/run.py says what stays on disk
        if saved is None:
            typer.echo("interrupted: nothing was saved yet", err=True)
        else:  # the answers are reused by the same command; a checkpoint is continued with --resume
            again = command_line(ctx, resume=(folder / CHECKPOINT).is_file())
            typer.echo(f"interrupted: {saved}; to continue, run: {again}", err=True)
        raise
    if report["process"] != 0:  # under accelerate launch the main process reports
        return
    typer.echo(json.dumps(report) if as_json else _summary(report, kind, chosen.target.model, folder))


def answers_file(text: str) -> Path:
    """``--answers FILE``: a file path (not a folder, not empty) in a folder that exists: train-head makes the
    folders above DIR (the user named them), not those of a file named apart from it (``--answers /typo/a.jsonl``)."""
    if not text.strip():
        raise InputError("--answers is empty; name a JSONL file, or leave it out (DIR.answers.jsonl)")
    path = Path(text).expanduser()
    if path.is_dir():
        raise InputError(f"--answers {shorten(text)} is a folder; name a JSONL file")
    if not path.parent.exists():  # one that is a file is said by training/out_folder.py
        raise InputError(f"--answers {shorten(text)}: folder {shorten_path(str(path.parent))} doesn't exist; create "
                         f"it or pick another path")
    return path


def _summary(report: dict, kind: str, target: str, folder: Path) -> str:
    size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
    what = f"imitation network after layer {report['layer']}" if kind == IMITATION else f"{kind} head"
    lines = [f"wrote {folder} ({what} for {target}, {size / 1e6:.2f} MB)",
             f"trained on {report['sequences']} answered turns of {report['source']} ({report['skipped']} skipped): "
             f"{report['steps']} steps, {report['epochs']} epochs, in {report['seconds']['training']:.0f} s "
             f"(answers {report['seconds']['answers']:.0f} s)"]
    final = report["final"]
    if final["loss"]:
        lines.append("last steps: " + ", ".join(f"pass {k + 1} loss {l:.3f} top-1 {t:.3f}"
                                                 for k, (l, t) in enumerate(zip(final["loss"], final["top1"]))))
    held = report.get("placeholder_answers")
    if held:
        lines.append(f"{held} answer{'s' if held != 1 else ''} held the target's image placeholder id (read as "
                     f"ordinary tokens, as the target produced them)")
    acc = report.get("acceptance")
    if acc and acc["after"] is not None:
        before = acc.get("before")
        lines.append(f"block efficiency τ on {acc['held_out']} held-out samples (γ = 5, greedy): "
                     f"{acc['after']['block_efficiency']:.3f}"
                     + (f" (before training: {before['block_efficiency']:.3f})" if before else ""))
    elif acc:
        lines.append(f"no acceptance measurement: none of the {acc['held_out']} held-out samples could be decoded "
                     f"(their images failed to load)")
    else:
        lines.append("no held-out samples, so no acceptance measurement (pass --held-out N to keep N out)")
    return "\n".join(lines)
