"""``train-head`` from start to end: checks, answers, training, the head written, its acceptance measured.

:func:`train_head` is what the command and ``scripts/train_demo_heads.py`` both call:

1. Check, before any model loads: ``--out`` writable and no other run's (:mod:`.locks`), the
   checkpoint to resume (or one line saying why not), SOURCE not empty.
2. The target answers SOURCE's prompts (:mod:`.answers`), or the answers file already holds them.
   The last ``held_out`` conversations are not answered: acceptance is measured on them. Once
   every process holds its answers the run lets go of the answers file (:mod:`.locks`), so runs of
   other kinds can reuse it while this one trains.
3. The head (its embeddings copied from the target) is measured on the held-out conversations,
   trained (:mod:`.trainer`), written in float16 with ``save_head``, loaded back as a profile
   would load it, and measured again; both figures go into its ``config.json``.

Under ``accelerate launch`` every process loads the target on its own device; the main process
answers the prompts and measures, the others wait.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from mmspec_cli.models.file_lock import OutLock
from mmspec_cli.choices import EAGLE3, IMITATION
from mmspec_cli.drafters.head import HeadDrafter
from mmspec_cli.drafters.ssd import SelfSpeculativeDrafter, check_layer, layer_count
from mmspec_cli.errors import InputError, MmspecError
from mmspec_cli.models.head import DEFAULT_NUM_Q, DraftHead
from mmspec_cli.models.eagle3 import DEFAULT_DRAFT_VOCAB, Eagle3Head, default_layers, draft_vocabulary
from mmspec_cli.models.eagle3 import head_config as eagle3_config
from mmspec_cli.models.head_files import head_config, load_head, save_head
from mmspec_cli.models.imitation import ImitationNetwork, load_imitation, save_imitation
from mmspec_cli.models.loading import LoadedModel, load_model, resolve_device
from mmspec_cli.models.profiles import Profile
from mmspec_cli.models.prompts import shorten
from mmspec_cli.models.target_identity import canonical_name, signature
from mmspec_cli.models.writing import WriteFailed
from mmspec_cli.training import acceptance
from mmspec_cli.training.answers import AnswerFile, AnswerSettings, answers_path, generate_answers
from mmspec_cli.training.checkpoint import check_settings, check_start, checkpoint_path
from mmspec_cli.training.out_folder import CHECKPOINT, check_out, clean_up, make_parents
from mmspec_cli.training.corpus import Conversation, conversations, split_held_out
from mmspec_cli.training.eagle3 import Eagle3Objective, answer_token_counts, eagle3_reader
from mmspec_cli.training.imitation import ImitationObjective, layer_reader
from mmspec_cli.training.limits import check_steps
from mmspec_cli.training.locks import lock_answers, lock_out
from mmspec_cli.training.progress import Phase, TrainingNotes
from mmspec_cli.training.sequences import SequenceStore, Turn, placeholder_answers, read_sequence, trainable
from mmspec_cli.training.trainer import TrainConfig, TrainingInterrupted, copy_embeddings, make_accelerator, train

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
    draft_vocab: int | None = None  # eagle3: the draft vocabulary's size (None: 32,000 or the target's if smaller)


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
    answers_file = s.answers_file or answers_path(s.out)
    check_out(s.out, answers_file)
    target_name = canonical_name(profile.target.model)  # what the answers, checkpoints and the head name
    # one accelerator for the run: under `accelerate launch` (or torchrun) it knows the processes, on CPUs too
    accelerator = make_accelerator(resolve_device(profile.target.device) == "cpu", s.kind == "vispec")
    if not accelerator.is_main_process:
        resume = check_start(s.out, s.resume, s.kind, target_name)
        return _train_head(profile, s, target_name, resume, answers_file, accelerator, log, progress, on_target, on_step)
    made = Leftovers(s.out, answers_file)  # what this run made and holds: let go of, and removed if it fails unused
    try:
        made.make_parents(s.out)  # for DIR's lock beside it
        made.out_lock = lock_out(s.out)  # one run per DIR, so what check_start reads there is this run's
        resume = check_start(s.out, s.resume, s.kind, target_name)
        made.make_parents(answers_file)
        made.hold_answers(lock_answers(answers_file, log))  # one run at a time answers into the file
        return _train_head(profile, s, target_name, resume, answers_file, accelerator, log, progress, on_target,
                           on_step, made.let_go_of_answers)
    except BaseException as exc:
        made.clean_up(exc, s.answers, target_name)  # under the locks, which it lets go before the folders go
        if isinstance(exc, KeyboardInterrupt) and not isinstance(exc, TrainingInterrupted):
            raise TrainingInterrupted(made.kept()) from None  # outside training: say what stays
        raise
    finally:
        made.let_go()


class Leftovers:
    """What a train-head run made and holds (``out_folder`` and ``locks`` module docs). When it fails: an answers file
    this run created that holds no answer is removed under the run's lock, then the locks are let go of, then the
    folders made for them and an empty DIR it made are removed; answers that stay are named in the error line (the
    next run reuses them)."""

    def __init__(self, out: Path, answers_file: Path):
        self.out, self.answers_file = out, answers_file
        self.out_existed, self.answers_existed = out.exists(), answers_file.exists()  # the latter again, once held
        self.chains: list[list[Path]] = []  # the folders each make_parents created, in the order it was called
        self.out_lock: OutLock | None = None
        self.answers_lock: OutLock | None = None
        self.holds_answers = False  # the answers file is this run's to write (and to judge)
        self.answered: int | None = None  # the answers it holds, counted when the run let go of the file

    def make_parents(self, path: Path) -> None:
        self.chains.append(make_parents(path))

    def hold_answers(self, lock: OutLock | None) -> None:
        """The answers file is this run's now: whether it existed is judged again, as another run may have answered
        into it while this one waited (a file it made is never this run's to remove)."""
        self.answers_lock, self.holds_answers = lock, True
        self.answers_existed = self.answers_file.exists()

    def let_go_of_answers(self, answered: int) -> None:
        """Every process holds its ``answered`` answers: other runs may use the file now (``locks`` module doc)."""
        self.answered, self.holds_answers = answered, False
        if self.answers_lock is not None:
            self.answers_lock.release()
            self.answers_lock = None

    def let_go(self) -> None:
        """Release both locks (those still held)."""
        for lock in (self.answers_lock, self.out_lock):
            if lock is not None:
                lock.release()
        self.answers_lock = self.out_lock = None
        self.holds_answers = False

    def answers(self, settings: AnswerSettings, target_name: str) -> int:
        """How many answers the answers file holds for this run (0: none, or not a file of these settings); read
        only while the run holds the file (another run may be writing it)."""
        if self.answered is not None:
            return self.answered
        if not self.holds_answers or not self.answers_file.is_file():
            return 0
        try:
            return AnswerFile(self.answers_file, settings, target_name).answered()
        except MmspecError:  # another run's file, refused before this run wrote to it
            return 0

    def kept(self) -> str | None:
        """What stays on disk for the next run, in words (None: nothing), once :meth:`clean_up` has counted it."""
        if (self.out / CHECKPOINT).is_file():
            return f"the checkpoint in {self.out} is kept"
        kept = self.answered or 0
        if kept:
            return (f"{kept} answer{'s' if kept != 1 else ''} {'is' if kept == 1 else 'are'} saved in "
                    f"{self.answers_file} and reused when the run starts again")
        return None

    def clean_up(self, exc: BaseException, settings: AnswerSettings, target_name: str) -> None:
        kept = self.answered = self.answers(settings, target_name)
        if self.holds_answers and not kept and not self.answers_existed:
            self.answers_file.unlink(missing_ok=True)
        self.let_go()
        if not self.out_existed:
            clean_up([self.out])  # made by a first checkpoint that failed: removed while empty
        for chain in reversed(self.chains):  # the last made first: an earlier one may hold it
            clean_up(chain)
        said = isinstance(exc, WriteFailed) and exc.path == self.answers_file  # its own line says they are kept
        if kept and not said and isinstance(exc, MmspecError) and exc.args:
            exc.args = (f"{exc.args[0]}; the {kept} answer{'s' if kept != 1 else ''} in "
                        f"{shorten(str(self.answers_file))} are kept and reused by the next run",)


def _train_head(profile: Profile, s: TrainHeadSettings, target_name: str, resume: dict[str, Any] | None,
                answers_file: Path, accelerator: Any, log: Callable[[str], None], progress: bool | None,
                on_target: Callable[[LoadedModel], Any] | None,
                on_step: Callable[[int, int, list[dict]], None] | None,
                answers_read: Callable[[int], None] = lambda answered: None) -> dict[str, Any]:
    found = conversations(s.source, s.limit)
    if s.evaluate is not None:
        training, held = found, list(s.evaluate)
    else:
        if s.held_out is not None and s.held_out >= len(found) and s.held_out > 0:
            raise InputError(f"--held-out {s.held_out}: SOURCE {shorten(s.source)} has {len(found)} sample"
                             f"{'s' if len(found) != 1 else ''} and at least one must be trained on; pass "
                             f"--held-out {len(found) - 1} or less (0: measure on none)")
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
    draft_vocab = _draft_vocab_size(s, target) if s.kind == EAGLE3 else None  # refused before the answers
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
    accelerator.wait_for_everyone()  # every process holds its answers: the file is free for other runs (.locks)
    if main:
        answers_read(len(records) - len(failed))
    if failed:
        log(f"skipped {len(failed)} of {len(records)} turns whose inputs failed (recorded in "
            f"{shorten(str(answers_file))}); first: {failed[0].error}")
    placeholders = placeholder_answers(target, usable)
    if placeholders:
        log(f"{placeholders} of {len(usable)} answers hold the target's image placeholder id; read as the ordinary "
            f"tokens they were when the target produced them (after the prompt, with no image)")
    by_id = {c.id: c for c in training}
    layers = default_layers(layer_count(target.model)) if s.kind == EAGLE3 else ()  # the layers an eagle3 head reads
    if s.kind == IMITATION:
        reader = layer_reader(s.ssd_layer)
    else:
        reader = eagle3_reader(layers) if s.kind == EAGLE3 else read_sequence
    store = SequenceStore(target, [Turn(by_id[a.id], a) for a in usable], reader=reader)
    batch_size = min(s.batch_size, len(store))
    if batch_size < s.batch_size:
        log(f"--batch-size {s.batch_size} is more than the {len(store)} answered turns there are to train on; each "
            f"step takes all {len(store)} (batch size {batch_size})")
    epochs = s.epochs if s.epochs is not None else DEFAULT_EPOCHS
    steps = s.steps if s.steps is not None else epochs * math.ceil(len(store) / batch_size)
    check_steps(steps, "--steps" if s.steps is not None else "--epochs")
    config = TrainConfig(steps=steps, batch_size=batch_size, lr=s.lr, passes=s.mtp, noise=s.noise, loss=s.loss,
                         warmup=s.warmup, seed=s.seed, checkpoint_every=s.checkpoint_every)
    if resume is not None:
        vocabulary = {} if draft_vocab is None else {"draft_vocab": draft_vocab}
        check_settings(resume, {**asdict(config), "sequences": len(store), "answers": asdict(s.answers), **vocabulary},
                       f"{shorten(str(s.out))}/checkpoint.pt")

    report: dict[str, Any] = {
        "process": accelerator.process_index, "processes": accelerator.num_processes, "source": s.source,
        "conversations": len(training), "turns": len(records), "skipped": len(failed),
        "sequences": len(store), "placeholder_answers": placeholders, "steps": steps,
        "epochs": round(steps * batch_size / len(store), 2), "batch_size": batch_size, "lr": s.lr, "noise": s.noise, "seed": s.seed,
        "answers": {k: v for k, v in asdict(s.answers).items()},
    }
    if s.kind == IMITATION:
        return _train_imitation(target, target_name, store, config, s, held, resume, max_new, report, clock,
                                answers_s, accelerator, log, progress, on_step)
    if s.kind == EAGLE3:
        return _train_eagle3(target, target_name, store, usable, layers, draft_vocab, config, s, held, resume,
                             max_new, report, clock, answers_s, accelerator, log, progress, on_step)
    report.update(mtp=s.mtp, loss=s.loss)
    torch.manual_seed(s.seed)
    head = DraftHead(head_config(target), s.kind, s.num_q)
    copy_embeddings(head, target)
    head.to(device=target.model.get_output_embeddings().weight.device)
    identity = {"kind": s.kind, "num_q": s.num_q, "target": target_name, "sequences": len(store),
                "answers": asdict(s.answers)}
    keep: dict[str, Any] = {}
    if s.measure_before and held and resume is None and main:
        keep["before"] = _measure(target, HeadDrafter(target, head.eval()), held, max_new, log,
                                  "acceptance before training", "(γ = 5, greedy)")
    result = _train_with_progress(head, target, store, config, s.out, identity, resume, keep, accelerator, log,
                                  progress, on_step)
    report.update(final=result.tail(), seconds={"answers": round(answers_s, 1), "training": round(result.seconds, 1)})
    if main:
        _write_and_measure(lambda: save_head(head, s.out, target_name, dtype=torch.float16, extra={"training": report},
                                             target_signature=signature(target.model)),
                           target, s, config.steps, held, max_new, report, result.kept, log)
    report["seconds"]["total"] = round(time.perf_counter() - clock, 1)
    accelerator.wait_for_everyone()
    return report


def _write_and_measure(save: Callable[[], None], target: LoadedModel, s: TrainHeadSettings, steps: int,
                       held: Sequence[Conversation], max_new: int, report: dict[str, Any], kept: dict[str, Any],
                       log: Callable[[str], None]) -> None:
    """Write a trained head (``save``), measure its τ on the held-out conversations loaded back from disk, write it
    again with that in its report, and drop the checkpoint."""
    def write() -> None:
        with finished_training(s.out, steps):
            save()

    write()
    if held:
        loaded = load_head(str(s.out), s.kind, None if s.kind == EAGLE3 else s.num_q, target)
        after = _measure(target, HeadDrafter(target, loaded), held, max_new, log, "acceptance after training")
        report["acceptance"] = {"held_out": len(held), "gamma": 5, "greedy": True, "before": kept.get("before"),
                                "after": after}
        write()
    checkpoint_path(s.out).unlink(missing_ok=True)


@contextlib.contextmanager
def finished_training(out: Path, steps: int) -> Iterator[None]:
    """Writing the trained network: a failed write says that training is done and its last checkpoint kept."""
    try:
        yield
    except WriteFailed as exc:
        raise WriteFailed(exc.path, f"{exc.reason}; training finished and its checkpoint (step {steps}) is kept in "
                                    f"{shorten(str(out))}: free some space and run the same command with --resume "
                                    f"to write it") from None


def _measure(target: LoadedModel, drafter: Any, held: Sequence[Conversation], max_new: int,
             log: Callable[[str], None], what: str, how: str = "") -> dict[str, Any] | None:
    """:func:`.acceptance.measure` on the held-out conversations, told in one line; its dict (None: none decoded)."""
    found = acceptance.measure(target, drafter, held, max_new)
    log(acceptance.described(found, len(held), what) + (f" {how}" if how and found is not None else ""))
    return None if found is None else found.as_dict()


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
    hidden = target.model.config.get_text_config().hidden_size
    objective = ImitationObjective(ImitationNetwork(hidden), target, s.noise)
    identity = {"kind": IMITATION, "layer": layer, "target": target_name, "sequences": len(store),
                "answers": asdict(s.answers)}
    keep: dict[str, Any] = {}
    if s.measure_before and held and resume is None and main:  # an untrained network is the plain draft
        keep["before"] = _measure(target, SelfSpeculativeDrafter(target, layer), held, max_new, log,
                                  "acceptance without the network", f"(ssd at layer {layer}, γ = 5, greedy)")
    result = _train_with_progress(objective, target, store, config, s.out, identity, resume, keep, accelerator, log,
                                  progress, on_step, objective=objective)
    report.update(layer=layer, final=result.tail(),
                  seconds={"answers": round(answers_s, 1), "training": round(result.seconds, 1)})
    if main:
        with finished_training(s.out, config.steps):
            save_imitation(objective.network, s.out, layer, target, target_name, extra={"training": report})
        if held:
            network = load_imitation(str(s.out), layer, target)
            after = _measure(target, SelfSpeculativeDrafter(target, layer, network), held, max_new, log,
                             "acceptance through the network")
            report["acceptance"] = {"held_out": len(held), "gamma": 5, "greedy": True, "layer": layer,
                                    "before": result.kept.get("before"), "after": after}
            with finished_training(s.out, config.steps):
                save_imitation(objective.network, s.out, layer, target, target_name, extra={"training": report})
        checkpoint_path(s.out).unlink(missing_ok=True)
    report["seconds"]["total"] = round(time.perf_counter() - clock, 1)
    accelerator.wait_for_everyone()
    return report


def _draft_vocab_size(s: TrainHeadSettings, target: LoadedModel) -> int:
    """``--draft-vocab``, or 32,000 (EAGLE-3's) or the target's vocabulary if smaller; more than the target's is one
    line."""
    vocab = target.vocab_size
    if s.draft_vocab is None:
        return min(DEFAULT_DRAFT_VOCAB, vocab)
    if s.draft_vocab > vocab:
        raise InputError(f"--draft-vocab {s.draft_vocab} is larger than the target's vocabulary ({vocab} tokens); pass "
                         f"--draft-vocab {vocab} or less")
    return s.draft_vocab


def _train_eagle3(target: LoadedModel, target_name: str, store: SequenceStore, usable: Sequence[Any],
                  layers: tuple[int, ...], size: int, config: TrainConfig, s: TrainHeadSettings,
                  held: Sequence[Conversation],
                  resume: dict[str, Any] | None, max_new: int, report: dict[str, Any], clock: float, answers_s: float,
                  accelerator: Any, log: Callable[[str], None], progress: bool | None,
                  on_step: Callable[[int, int, list[dict]], None] | None) -> dict[str, Any]:
    """An EAGLE-3 head (:mod:`.eagle3`): its draft vocabulary chosen from the answers, trained by the training-time
    test on the same loop, checkpoints and progress as the other heads; written by ``save_eagle3``."""
    from mmspec_cli.models.eagle3_files import save_eagle3

    main = accelerator.is_main_process
    vocab = target.vocab_size
    kept, share = draft_vocabulary(answer_token_counts(usable), size, vocab)
    log(f"draft vocabulary: {size} of the target's {vocab} tokens, covering {100 * share:.1f}% of the answer tokens")
    torch.manual_seed(s.seed)
    text = target.model.config.get_text_config()
    head = Eagle3Head(eagle3_config(text, vocab), layers, size, text.hidden_size)
    head.set_vocabulary(kept)
    copy_embeddings(head, target)
    head.to(device=target.model.get_output_embeddings().weight.device)
    # noise: what is applied, none (EAGLE-3's training adds no feature noise; training/eagle3.py)
    report.update(mtp=s.mtp, loss="soft cross-entropy over the draft vocabulary", noise=0.0, layers=list(layers),
                  draft_vocab=size, draft_vocab_share=round(share, 4))
    identity = {"kind": EAGLE3, "target": target_name, "sequences": len(store), "answers": asdict(s.answers),
                "layers": list(layers), "draft_vocab": size}
    keep: dict[str, Any] = {}
    if s.measure_before and held and resume is None and main:
        keep["before"] = _measure(target, HeadDrafter(target, head.eval()), held, max_new, log,
                                  "acceptance before training", "(γ = 5, greedy)")
    objective = Eagle3Objective(head, target.model.get_output_embeddings(), s.mtp)
    result = _train_with_progress(head, target, store, config, s.out, identity, resume, keep, accelerator, log,
                                  progress, on_step, objective=objective)
    report.update(final=result.tail(), seconds={"answers": round(answers_s, 1), "training": round(result.seconds, 1)})
    if main:
        extra = {"target_layers": layer_count(target.model), "target_model_type": target.model.config.model_type}
        _write_and_measure(lambda: save_eagle3(head, s.out, target_name, dtype=torch.float16,
                                               extra={"training": report, **extra},
                                               target_signature=signature(target.model)),
                           target, s, config.steps, held, max_new, report, result.kept, log)
    report["seconds"]["total"] = round(time.perf_counter() - clock, 1)
    accelerator.wait_for_everyone()
    return report
