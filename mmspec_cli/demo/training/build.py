"""The whole demo build: tokenizer, vision pretraining, target, draft, saved for shipping (issue 5).

``scripts/train_demo.py`` is the command-line front of :func:`build`. Every step is seeded,
so the same plan on the same software gives the same weights. The draft doubles as the
captioner of the ``c`` drafter (prompted with ``tasks.CAPTION_QUESTION``): it is trained on
the caption family like every other family with at most two images.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import AutoProcessor, LlavaForConditionalGeneration

from mmspec_cli.demo import tasks
from mmspec_cli.demo.tasks import Sample
from mmspec_cli.demo.scenes import DISPLAY_SIZE
from mmspec_cli.demo.training.train import (Example, ModelSize, build_model, build_processor, encode, fact_token_ids,
                                            freeze_vision, language_model_parameters, pretrain_vision, save_half, train)


@dataclass(frozen=True)
class Stage:
    steps: int
    batch_size: int
    lr: float


@dataclass(frozen=True)
class BuildPlan:
    """Everything that decides the shipped weights. The defaults are what ships."""

    corpus_size: int = 16000  # training samples, all families mixed by ``family_weights``
    family_weights: tuple[tuple[str, float], ...] = (
        ("single", 45), ("pair", 15), ("story", 8), ("followup", 20), ("caption", 12))
    vocab_size: int = 1200
    image_size: int = 48  # the processor's input size
    patch_size: int = 16  # 3x3 patches: one per grid cell
    render_size: int = DISPLAY_SIZE  # training images are drawn at the size the suites and examples use
    target: ModelSize = ModelSize(hidden=144, layers=8, heads=4, vision_hidden=64, vision_layers=2)
    draft: ModelSize = ModelSize(hidden=64, layers=2, heads=2, vision_hidden=64, vision_layers=2)
    vision: Stage = Stage(steps=150, batch_size=32, lr=3e-3)
    target_stage: Stage = Stage(steps=5200, batch_size=16, lr=3e-3)
    draft_stage: Stage = Stage(steps=3000, batch_size=16, lr=3e-3)
    length_group: int | None = 50  # batch rows of similar length (train.length_grouped_batches); None: random
    draft_max_images: int = 2  # the draft sees only samples with at most this many images (TABED's drafts)
    draft_text_only_share: float = 0.5  # extra text-only copies of the draft's samples (its "text pretraining")
    draft_text_sees_all_families: bool = True  # text-only copies of stories too (no pixels, so no images)
    draft_multimodal_turns: str = "first"  # images on first turns only ("first"), or on "all" turns
    fact_weight: float = 6.0  # loss weight of fact words (colours, kinds, sizes, positions, counts); others 1
    seed: int = 0
    threads: int = 2  # torch intra-op threads (this machine has 2 cores); reproducible for a fixed value


@dataclass
class BuildReport:
    plan: dict
    seconds: dict[str, float] = field(default_factory=dict)
    final_loss: dict[str, float] = field(default_factory=dict)
    vision_patch_accuracy: float = 0.0
    language_model_parameters: dict[str, int] = field(default_factory=dict)
    torch_version: str = torch.__version__


def draft_corpus(plan: BuildPlan, processor, samples: Sequence[Sample], encoded: Sequence[list[Example]]) -> list[Example]:
    """What the draft learns from. With images: only samples with at most ``draft_max_images``
    images (never a five-frame story), on every turn (``draft_multimodal_turns="all"``) or on
    first turns only ("first": visual instruction tuning on single-turn data).

    As text (the ``t`` drafter's prompt format, no pixels): ``draft_text_only_share`` of all
    samples, every turn, stories included when ``draft_text_sees_all_families``. This is the
    draft's text pretraining: TABED's small drafts start from language models pretrained on
    general text, which is why text-only drafting still works where their multimodal drafting
    breaks down (five-image inputs, TABED Table 1).
    """
    small = [(s, per_sample) for s, per_sample in zip(samples, encoded) if len(s.images) <= plan.draft_max_images]
    turns = None if plan.draft_multimodal_turns == "all" else 1
    out = [e for _, per_sample in small for e in per_sample[:turns]]
    texts = samples if plan.draft_text_sees_all_families else [s for s, _ in small]
    k = round(plan.draft_text_only_share * len(texts))
    out += [e for s in texts[:k] for e in encode(processor, s, plan.render_size, text_only=True)]
    return out


def _mean_tail(losses: list[float], n: int = 50) -> float:
    tail = losses[-n:]
    return sum(tail) / max(1, len(tail))


def build(out_dir: str | Path, plan: BuildPlan = BuildPlan(), log: Callable[[str], None] = print,
          probe: Callable[[str, object, object], None] | None = None, probe_every: int = 400,
          target_from: str | Path | None = None) -> BuildReport:
    """Train the demo family and save ``out_dir/demo-target`` and ``out_dir/demo-draft`` (fp16 safetensors).

    ``probe(name, model, processor)``, if given, is called every ``probe_every`` steps and at the
    end of each stage to watch quality; it must not change the model (greedy decoding only).
    ``target_from``, a folder holding a ``demo-target`` this plan built, skips the tokenizer,
    the vision pretraining and the target's training and trains only the draft against it. The
    draft's vision tower is always the target's rounded through float16 (as it ships), so both
    ways give the same draft.
    """
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(plan.threads)
    torch.use_deterministic_algorithms(True)
    try:
        return _build(Path(out_dir), plan, log, probe, probe_every, target_from)
    finally:  # the caller's settings back (a test session, a notebook)
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


def _build(out: Path, plan: BuildPlan, log: Callable[[str], None],
           probe: Callable[[str, object, object], None] | None, probe_every: int,
           target_from: str | Path | None) -> BuildReport:
    report = BuildReport(plan=asdict(plan))
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        report.seconds[name] = round(now - clock, 1)
        clock = now
        log(f"{name}: {report.seconds[name]:.0f} s")

    samples = tasks.training_corpus(plan.corpus_size, seed=plan.seed, weights=dict(plan.family_weights))
    if target_from is None:
        processor = build_processor(samples, plan.vocab_size, plan.image_size, plan.patch_size)
    else:
        processor = AutoProcessor.from_pretrained(Path(target_from) / "demo-target")
        report.plan["target_from"] = str(target_from)
    vocab = len(processor.tokenizer)
    pad = processor.tokenizer.pad_token_id
    weights = torch.ones(vocab)
    weights[fact_token_ids(processor.tokenizer)] = plan.fact_weight
    lap("tokenizer")

    if target_from is None:
        target = build_model(plan.target, vocab, plan.image_size, plan.patch_size, seed=plan.seed)
        vision = plan.vision
        report.vision_patch_accuracy = pretrain_vision(
            target, processor.image_processor, vision.steps, vision.batch_size, vision.lr, plan.seed,
            plan.render_size)
    else:
        target = LlavaForConditionalGeneration.from_pretrained(Path(target_from) / "demo-target", dtype=torch.float32)
    freeze_vision(target)
    lap("vision")

    draft = build_model(plan.draft, vocab, plan.image_size, plan.patch_size, seed=plan.seed + 1)
    tower = {k: v.half().float() for k, v in target.model.vision_tower.state_dict().items()}
    draft.model.vision_tower.load_state_dict(tower)  # one pretrained tower, as LLaVA drafts share CLIP
    freeze_vision(draft)
    report.language_model_parameters = {"target": language_model_parameters(target),
                                         "draft": language_model_parameters(draft)}

    # Retraining only the draft, samples it never sees with pixels (stories) need no image encoding.
    with_pixels = [target_from is None or len(s.images) <= plan.draft_max_images for s in samples]
    encoded = [encode(processor, s, plan.render_size) if keep else [] for s, keep in zip(samples, with_pixels)]
    examples = [e for per_sample in encoded for e in per_sample]
    draft_examples = draft_corpus(plan, processor, samples, encoded)
    lap("encode")

    def progress(name: str, steps: int, model):
        def report_step(step: int, loss: float) -> None:
            if step % 100 == 0:
                log(f"{name} step {step}/{steps} loss {loss:.3f}")
            if probe is not None and step and step % probe_every == 0:
                model.eval()
                probe(f"{name} step {step}", model, processor)
                model.train()
        return report_step

    if target_from is None:
        stage = plan.target_stage
        losses = train(target, examples, stage.steps, stage.batch_size, stage.lr, plan.seed, pad,
                       progress("target", stage.steps, target), weights, plan.length_group)
        report.final_loss["target"] = round(_mean_tail(losses), 4)
        lap("target")
        if probe is not None:
            probe("target final", target, processor)
    stage = plan.draft_stage
    losses = train(draft, draft_examples, stage.steps, stage.batch_size, stage.lr, plan.seed, pad,
                   progress("draft", stage.steps, draft), weights, plan.length_group)
    report.final_loss["draft"] = round(_mean_tail(losses), 4)
    lap("draft")

    if target_from is None:
        save_half(target, processor, out / "demo-target")
    save_half(draft, processor, out / "demo-draft")
    lap("save")
    report.seconds["total"] = round(sum(report.seconds.values()), 1)
    written = asdict(report)
    if target_from is not None and (Path(target_from) / "training.json").is_file():  # keep the target's own record
        written["target_build"] = json.loads((Path(target_from) / "training.json").read_text(encoding="utf-8"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "training.json").write_text(json.dumps(written, indent=2) + "\n", encoding="utf-8")
    return report
