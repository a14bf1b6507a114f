"""``train-head`` from start to end: checks, answers, training, the head written, its acceptance measured.

:func:`train_head` is what the command and ``scripts/train_demo_heads.py`` both call:

1. Check, before any model loads: ``--out`` writable, the checkpoint to resume (or one line saying
   why not), SOURCE not empty.
2. The target answers SOURCE's prompts (:mod:`.answers`), or the answers file already holds them.
   The last ``held_out`` conversations are not answered: acceptance is measured on them.
3. The head (its embeddings copied from the target) is measured on the held-out conversations,
   trained (:mod:`.trainer`), written in float16 with ``save_head``, loaded back as a profile
   would load it, and measured again; both figures go into its ``config.json``.

Under ``accelerate launch`` every process loads the target on its own device; the main process
answers the prompts and measures, the others wait.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from mmspec_cli.bench.records import OutLock
from mmspec_cli.choices import IMITATION
from mmspec_cli.drafters.head import HeadDrafter
from mmspec_cli.drafters.ssd import SelfSpeculativeDrafter, check_layer, layer_count
from mmspec_cli.errors import InputError
from mmspec_cli.models.head import DEFAULT_NUM_Q, DraftHead
from mmspec_cli.models.head_files import head_config, load_head, save_head
from mmspec_cli.models.imitation import ImitationNetwork, load_imitation, save_imitation
from mmspec_cli.models.loading import LoadedModel, load_model, resolve_device
from mmspec_cli.models.profiles import Profile
from mmspec_cli.models.prompts import shorten
from mmspec_cli.training import acceptance
from mmspec_cli.training.answers import AnswerSettings, answers_path, generate_answers
from mmspec_cli.training.checkpoint import check_settings, check_start, checkpoint_path
from mmspec_cli.training.corpus import Conversation, conversations, split_held_out
from mmspec_cli.training.imitation import ImitationObjective, layer_reader
from mmspec_cli.training.progress import Phase, TrainingNotes
from mmspec_cli.training.sequences import SequenceStore, Turn, read_sequence, trainable
from mmspec_cli.training.trainer import TrainConfig, copy_embeddings, make_accelerator, train

DEFAULT_EPOCHS = 20  # ViSpec
DEFAULT_LR = 3e-5  # ViSpec's training script; tiny heads (the demo's) want about 1e-3
DEFAULT_MTP = 3
MAX_HELD_OUT = 10


@dataclass(frozen=True)
class TrainHeadSettings:
    """Everything ``train-head`` is told. ``steps`` wins over ``epochs``; ``held_out`` None: a tenth of
    SOURCE, at most 10; ``evaluate`` replaces the held-out part by other conversations (nothing held out)."""

    kind: str
    source: str
    out: Path
    epochs: int | None = None
    steps: int | None = None
    lr: float = DEFAULT_LR
    mtp: int = DEFAULT_MTP
    resume: bool = False
    limit: int | None = None
    seed: int = 0
    batch_size: int = 8
    checkpoint_every: int = 200
    held_out: int | None = None
    loss: str = "vispec"
    noise: float = 0.2
    warmup: float = 0.05
    num_q: int = DEFAULT_NUM_Q
    answers: AnswerSettings = field(default_factory=AnswerSettings)
    answers_file: Path | None = None
    evaluate: Sequence[Conversation] | None = None
    eval_max_new_tokens: int | None = None  # None: the profile's decoding.max_new_tokens
    measure_before: bool = True
    ssd_layer: int | None = None  # imitation: the exit layer the network follows


def check_out(out: Path) -> None:
    """``--out`` is (or can become) a writable folder, and its parent takes the answers file."""
    shown = shorten(str(out))
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {shown} is a file; name a folder for the head")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".mmspec-write-probe"
        probe.write_bytes(b"")
        probe.unlink()
        probe = out.parent / f".{out.name}.mmspec-write-probe"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise InputError(f"--out {shown} can't be written ({exc.strerror or exc}); pick another folder") from None


def _load_target(profile: Profile, accelerator: Any) -> LoadedModel:
    spec = profile.target
    if accelerator.num_processes > 1:  # one copy per process, on its own device
        device = accelerator.device
        spec = replace(spec, device="cpu" if device.type == "cpu" else str(device))
    target = load_model(spec, "target")
    for param in target.model.parameters():
        param.requires_grad_(False)
    return target


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def train_head(profile: Profile, settings: TrainHeadSettings, log: Callable[[str], None] = _stderr,
               progress: bool | None = None, on_target: Callable[[LoadedModel], Any] | None = None,
               on_step: Callable[[int, int, list[dict]], None] | None = None) -> dict[str, Any]:
    """Train a head for the profile's target; returns the report (also stored in the head's config.json).

    ``progress`` None: bars on a terminal; ``on_target(target)`` once the target is loaded (the command
    chooses its CPU threads there); ``on_step(step, total, pass_stats)`` after each step.
    """
    s = settings
    check_out(s.out)
    answers_file = s.answers_file or answers_path(s.out)
    # one accelerator for the run: under `accelerate launch` (or torchrun) it knows the processes, on CPUs too
    accelerator = make_accelerator(resolve_device(profile.target.device) == "cpu", s.kind == "vispec")
    lock = OutLock.acquire(answers_file) if accelerator.is_main_process else None  # one run per answers file
    try:
        return _train_head(profile, s, answers_file, accelerator, log, progress, on_target, on_step)
    finally:
        if lock is not None:
            lock.release()


def _train_head(profile: Profile, s: TrainHeadSettings, answers_file: Path, accelerator: Any,
                log: Callable[[str], None], progress: bool | None, on_target: Callable[[LoadedModel], Any] | None,
                on_step: Callable[[int, int, list[dict]], None] | None) -> dict[str, Any]:
    target_name = profile.target.model
    resume = check_start(s.out, s.resume, s.kind, target_name)
    found = conversations(s.source, s.limit)
    if s.evaluate is not None:
        training, held = found, list(s.evaluate)
    else:
        held_out = min(MAX_HELD_OUT, len(found) // 10) if s.held_out is None else s.held_out
        training, held = split_held_out(found, held_out)
    clock = time.perf_counter()
    target = _load_target(profile, accelerator)
    main = accelerator.is_main_process
    if s.kind == IMITATION:
        check_layer(s.ssd_layer, layer_count(target.model))  # out of range: refused before the answers
        if resume is not None and resume.get("layer") != s.ssd_layer:
            raise InputError(f"--resume: {shorten(str(s.out))} is the checkpoint of an imitation network for layer "
                             f"{resume.get('layer')}, not {s.ssd_layer}; pass --ssd-layer {resume.get('layer')} or "
                             f"pick another --out")
    if on_target is not None:
        on_target(target)
    max_new = s.eval_max_new_tokens or profile.decoding.max_new_tokens

    turns_total = sum(len(c.turns) for c in training)
    if main:
        with Phase("answers", turns_total, enabled=progress, log=log) as phase:
            records = generate_answers(target, target_name, training, answers_file, s.answers, phase.advance)
    accelerator.wait_for_everyone()
    if not main:
        records = generate_answers(target, target_name, training, answers_file, s.answers)  # reads them back
    answers_s = time.perf_counter() - clock
    failed = [r for r in records if r.error is not None]
    usable = trainable(records)
    if not usable:
        first = failed[0].error if failed else "every answer is empty"
        raise InputError(f"no sample of SOURCE {shorten(s.source)} could be used: all {len(records)} failed "
                         f"(first: {first})")
    if failed:
        log(f"skipped {len(failed)} of {len(records)} turns whose inputs failed (recorded in "
            f"{shorten(str(answers_file))}); first: {failed[0].error}")
    by_id = {c.id: c for c in training}
    reader = layer_reader(s.ssd_layer) if s.kind == IMITATION else read_sequence
    store = SequenceStore(target, [Turn(by_id[a.id], a) for a in usable], reader=reader)
    epochs = s.epochs if s.epochs is not None else DEFAULT_EPOCHS
    steps = s.steps if s.steps is not None else epochs * math.ceil(len(store) / s.batch_size)
    config = TrainConfig(steps=steps, batch_size=s.batch_size, lr=s.lr, passes=s.mtp, noise=s.noise, loss=s.loss,
                         warmup=s.warmup, seed=s.seed, checkpoint_every=s.checkpoint_every)
    if resume is not None:
        check_settings(resume, {**asdict(config), "sequences": len(store)}, f"{shorten(str(s.out))}/checkpoint.pt")

    report: dict[str, Any] = {
        "process": accelerator.process_index, "processes": accelerator.num_processes, "source": s.source,
        "conversations": len(training), "turns": len(records), "skipped": len(failed),
        "sequences": len(store), "steps": steps, "epochs": round(steps * s.batch_size / len(store), 2),
        "batch_size": s.batch_size, "lr": s.lr, "noise": s.noise, "seed": s.seed,
        "answers": {k: v for k, v in asdict(s.answers).items()},
    }
    if s.kind == IMITATION:
        return _train_imitation(target, target_name, store, config, s, held, resume, max_new, report, clock,
                                answers_s, accelerator, log, progress, on_step)
    report.update(mtp=s.mtp, loss=s.loss)
    torch.manual_seed(s.seed)
    head = DraftHead(head_config(target), s.kind, s.num_q)
    copy_embeddings(head, target)
    head.to(device=target.model.get_output_embeddings().weight.device)
    identity = {"kind": s.kind, "num_q": s.num_q, "target": target_name, "sequences": len(store)}
    keep: dict[str, Any] = {}
    if s.measure_before and held and resume is None and main:
        keep["before"] = acceptance.measure(target, HeadDrafter(target, head.eval()), held, max_new).as_dict()
        log(f"acceptance before training: τ {keep['before']['block_efficiency']:.3f} on {len(held)} held-out "
            f"conversations (γ = 5, greedy)")
    result = _train_with_progress(head, target, store, config, s.out, identity, resume, keep, accelerator, log,
                                  progress, on_step)
    report.update(final=result.tail(), seconds={"answers": round(answers_s, 1), "training": round(result.seconds, 1)})
    if main:
        extra = {"training": report}
        save_head(head, s.out, target_name, dtype=torch.float16, extra=extra)
        if held:
            loaded = load_head(str(s.out), s.kind, s.num_q, target)
            after = acceptance.measure(target, HeadDrafter(target, loaded), held, max_new).as_dict()
            report["acceptance"] = {"held_out": len(held), "gamma": 5, "greedy": True,
                                    "before": result.kept.get("before"), "after": after}
            log(f"acceptance after training: τ {after['block_efficiency']:.3f} on {len(held)} held-out conversations"
                + (f" (before: {result.kept['before']['block_efficiency']:.3f})" if result.kept.get("before") else ""))
            save_head(head, s.out, target_name, dtype=torch.float16, extra={"training": report})
        checkpoint_path(s.out).unlink(missing_ok=True)
    report["seconds"]["total"] = round(time.perf_counter() - clock, 1)
    accelerator.wait_for_everyone()
    return report


def _train_with_progress(trained: torch.nn.Module, target: LoadedModel, store: SequenceStore, config: TrainConfig,
                         out: Path, identity: dict[str, Any], resume: dict[str, Any] | None, keep: dict[str, Any],
                         accelerator: Any, log: Callable[[str], None], progress: bool | None,
                         on_step: Callable[[int, int, list[dict]], None] | None,
                         objective: torch.nn.Module | None = None):
    """:func:`.trainer.train` under the training phase's progress bar (a head, or an imitation network's objective)."""
    notes = TrainingNotes()
    with Phase("training", config.steps, done=0 if resume is None else int(resume["step"]), enabled=progress,
               log=log) as phase:
        def step_done(step: int, total: int, stats: list[dict]) -> None:
            phase.note(notes.add(stats))
            phase.advance(1)
            if on_step is not None:
                on_step(step, total, stats)

        return train(trained, target, store, config, out, identity, resume, keep, on_step=step_done,
                     objective=objective, accelerator=accelerator)


def _train_imitation(target: LoadedModel, target_name: str, store: SequenceStore, config: TrainConfig,
                     s: TrainHeadSettings, held: Sequence[Conversation], resume: dict[str, Any] | None, max_new: int,
                     report: dict[str, Any], clock: float, answers_s: float, accelerator: Any,
                     log: Callable[[str], None],
                     progress: bool | None, on_step: Callable[[int, int, list[dict]], None] | None) -> dict[str, Any]:
    """FastVLM's imitation network after layer ``s.ssd_layer`` (:mod:`.imitation`): trained on the same answers,
    with the same loop, checkpoints and progress as the heads; written with ``save_imitation``."""
    layer = s.ssd_layer
    main = accelerator.is_main_process
    torch.manual_seed(s.seed)
    hidden = (getattr(target.model.config, "text_config", None) or target.model.config).hidden_size
    objective = ImitationObjective(ImitationNetwork(hidden), target, s.noise)
    identity = {"kind": IMITATION, "layer": layer, "target": target_name, "sequences": len(store)}
    keep: dict[str, Any] = {}
    if s.measure_before and held and resume is None and main:  # an untrained network is the plain draft
        plain = SelfSpeculativeDrafter(target, layer)
        keep["before"] = acceptance.measure(target, plain, held, max_new).as_dict()
        log(f"acceptance without the network: τ {keep['before']['block_efficiency']:.3f} on {len(held)} held-out "
            f"conversations (ssd at layer {layer}, γ = 5, greedy)")
    result = _train_with_progress(objective, target, store, config, s.out, identity, resume, keep, accelerator, log,
                                  progress, on_step, objective=objective)
    report.update(layer=layer, final=result.tail(),
                  seconds={"answers": round(answers_s, 1), "training": round(result.seconds, 1)})
    if main:
        save_imitation(objective.network, s.out, layer, target, target_name, extra={"training": report})
        if held:
            network = load_imitation(str(s.out), layer, target)
            after = acceptance.measure(target, SelfSpeculativeDrafter(target, layer, network), held, max_new).as_dict()
            report["acceptance"] = {"held_out": len(held), "gamma": 5, "greedy": True, "layer": layer,
                                    "before": result.kept.get("before"), "after": after}
            log(f"acceptance through the network: τ {after['block_efficiency']:.3f} on {len(held)} held-out "
                f"conversations" + (f" (without: {result.kept['before']['block_efficiency']:.3f})"
                                    if result.kept.get("before") else ""))
            save_imitation(objective.network, s.out, layer, target, target_name, extra={"training": report})
        checkpoint_path(s.out).unlink(missing_ok=True)
    report["seconds"]["total"] = round(time.perf_counter() - clock, 1)
    accelerator.wait_for_everyone()
    return report
