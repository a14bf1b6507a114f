"""The speculative decoding loop: turns of blocks (the block itself is :mod:`.step`).

Each turn renders the prompt, hands it to the drafter, then runs blocks until EOS or
``max_new_tokens``: γ from the draft-length schedule (:mod:`.schedules`: constant, heuristic or
FastVLM Eq. 5), cut to ``max_new_tokens - generated - 1`` so that ``max_new_tokens`` is exact;
one :class:`~.step.BlockStep` (propose, verify, observe); the output cut at EOS; the block
reported as a :class:`BlockVerified` event. The block rolls the target and the drafter back as its own
steps (:mod:`.step`), so the whole prefix is never re-run.
See docs/ARCHITECTURE.md, "The life of one block".
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from mmspec_cli.decoding.drafter import Drafter, TurnStart
from mmspec_cli.decoding.conversation import conversation
from mmspec_cli.decoding.events import BlockVerified, Event, Generation, TurnResult, collect
from mmspec_cli.decoding.kv import CachedModel
from mmspec_cli.decoding.kv_state import MAX_STEP
from mmspec_cli.decoding.sampling import SamplingParams, TokenPicker
from mmspec_cli.decoding.schedules import GammaSchedule, check_schedule
from mmspec_cli.decoding.step import BlockStep, TurnOutput
from mmspec_cli.decoding.timing import TurnClock
from mmspec_cli.decoding.tree import TreeSettings, check_tree_support
from mmspec_cli.errors import InputError
from mmspec_cli.models.families import family_of
from mmspec_cli.models.loading import LoadedModel
from mmspec_cli.models.prompts import process


def eos_ids(target: LoadedModel) -> set[int]:
    """End-of-sequence ids exactly as the target's own ``generate`` uses them."""
    value = getattr(target.model.generation_config, "eos_token_id", None)
    if value is None:
        value = target.tokenizer.eos_token_id
    if value is None:
        return set()
    return {int(v) for v in (value if isinstance(value, (list, tuple)) else [value])}


def generation_penalty(target: LoadedModel) -> float:
    """The repetition penalty the target's own ``generate`` applies (its ``generation_config``; 1.0: none)."""
    value = getattr(target.model.generation_config, "repetition_penalty", None)
    return 1.0 if value is None else float(value)


def context_length(config: Any) -> int | None:
    """The model's context (``max_position_embeddings`` of its text config); None when it declares none."""
    text = config.get_text_config()
    value = getattr(text, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def max_sequence_length(config: Any, default: int = 4096) -> int:
    """The model's maximum sequence length (N of FastVLM Eq. 5), from its text config."""
    return context_length(config) or default


def check_context(config: Any, prompt_tokens: int, max_new_tokens: int, role: str = "target",
                  what: str = "the prompt", limit_flag: str = "--max-new-tokens", image_tokens: int = 0,
                  images: int = 0) -> None:
    """Refuse a turn that can't fit the ``role`` model's context: one line with the numbers and what to lower
    (``limit_flag``: the flag that sets ``max_new_tokens`` in the command at hand).

    The model reads the prompt and every generated token but the last (which is emitted, never
    fed), so ``prompt_tokens + max_new_tokens - 1`` positions must fit; a model that declares no
    context is not checked. ``image_tokens`` of the prompt are the vision tokens of its ``images`` images: the
    line says how many; when they are most of the prompt and the text alone would fit, the images made it too
    long and the fix is theirs (``fewer_image_tokens`` of the model's family: Qwen-VL's ``max_pixels``).
    """
    context = context_length(config)
    needed = prompt_tokens + max_new_tokens - 1
    if context is None or needed <= context:
        return
    room = context + 1 - prompt_tokens
    text_tokens = prompt_tokens - image_tokens
    image_room = context + 1 - max_new_tokens - text_tokens  # what the images may take with the text as it is
    fix = f"lower {limit_flag} to {room} or shorten the question" if room >= 1 else "shorten the question"
    split = ""
    if image_tokens:
        split = f" ({image_tokens} for its {_images(images)}, {text_tokens} for the text)"
        if image_tokens >= text_tokens and image_room >= max(images, 1):  # the images made it long
            fix = family_of(config).fewer_image_tokens(images, image_room, role)
            fix = f"{fix}, or lower {limit_flag} to {room}" if room >= 1 else fix
    limit = "max_new_tokens" if limit_flag == "--max-new-tokens" else limit_flag  # the profile key, or the flag
    raise InputError(f"{what} is {prompt_tokens} tokens{split} and {limit} is {max_new_tokens}: {needed} tokens, "
                     f"more than the {role}'s context of {context}; {fix}")


def _images(count: int) -> str:
    return "image" if count == 1 else f"{count} images"


#: Room a static KV state keeps beyond the prompt and ``max_new_tokens``: a compiled step's padding, a tree's
#: nodes. A step that needs more grows the state (reallocated, so compiled again; ssd's view grows its owner's).
STATIC_SLACK = 2 * MAX_STEP


class SpeculativeDecoder:
    """Speculative decoding of ``target`` with ``drafter``; reusable across calls and turns.

    >>> decoder = SpeculativeDecoder(target, drafter, gamma=5, max_new_tokens=128)
    >>> generation = decoder.generate(images, ["Describe the image."])

    ``max_new_tokens`` and ``seed`` are defaults; ``generate``/``stream`` take them per call.
    ``repetition_penalty``: applied to the target's logits as its own ``generate`` applies it (None: the value in its
    ``generation_config.json``, such as Qwen2.5-VL's 1.05; 1.0: none).
    """

    def __init__(
        self,
        target: LoadedModel,
        drafter: Drafter,
        gamma: int = 5,
        max_new_tokens: int = 128,
        sampling: SamplingParams = SamplingParams(),
        seed: int | None = None,
        overlap_prefill: bool | None = None,
        gamma_schedule: str = "constant",
        tree_width: int = 1,
        tree: str | None = None,
        tree_budget: int = 30,
        tree_depth: int = 3,
        tree_topk: int = 8,
        kv: str = "dynamic",
        step_costs: Any = None,
        repetition_penalty: float | None = None,
    ):
        self.target = target
        self.drafter = drafter
        self.gamma = gamma
        self.gamma_schedule = check_schedule(gamma_schedule)
        self.step_costs = step_costs  # what ``--gamma-schedule cost`` chooses γ from (schedules.StepCosts), or None
        self.tree = TreeSettings.resolve(tree, tree_width, tree_budget, tree_depth, tree_topk)
        self.tree_width = self.tree.width
        if self.tree.drafts_tree and drafter.traits.drafts:  # `ar` drafts nothing: its tree is moot
            for model in (target.model, *drafter.traits.models):
                check_tree_support(model)
        self.max_new_tokens = max_new_tokens
        self.sampling = sampling
        self.seed = seed
        self.cached_target = CachedModel(target.model, role="target", image_token_id=target.image_token_id, kv=kv)
        self.repetition_penalty = generation_penalty(target) if repetition_penalty is None else repetition_penalty
        self.step = BlockStep(self.cached_target, drafter, self.tree, self.repetition_penalty)
        self.max_length = max_sequence_length(target.model.config)  # N of FastVLM Eq. (5)
        self.eos = eos_ids(target)
        # On CUDA, a drafter's slow start (captioning) runs beside the target's prefill; see _begin_turn.
        self.overlap_prefill = target.model.device.type == "cuda" if overlap_prefill is None else overlap_prefill

    def generate(self, images: Sequence[Any], questions: Sequence[str], raw_prompt: str | None = None,
                 on_event: Callable[[Event], None] | None = None, history: Sequence[tuple[str, str]] = (),
                 max_new_tokens: int | None = None, seed: int | None = None,
                 turn_images: Mapping[int, Sequence[Any]] | None = None) -> Generation:
        """Run every turn and return the results; ``on_event`` sees each event as it happens."""
        return collect(self.stream(images, questions, raw_prompt, history, max_new_tokens, seed, turn_images),
                       self.drafter.name, self.members, on_event)

    @property
    def members(self) -> tuple[str, ...]:
        """The order of each block's ensemble weights (empty for single drafters)."""
        return self.drafter.traits.members

    def stream(self, images: Sequence[Any], questions: Sequence[str], raw_prompt: str | None = None,
               history: Sequence[tuple[str, str]] = (), max_new_tokens: int | None = None,
               seed: int | None = None, turn_images: Mapping[int, Sequence[Any]] | None = None) -> Iterator[Event]:
        """Yield events turn by turn. ``raw_prompt`` (one turn) replaces the chat template.

        ``history``: earlier (question, answer) turns of the conversation, given as they are and
        not generated; ``images`` open the conversation (its first turn). ``turn_images``: the images
        a later question brings ({index in ``questions``: images}); the cache of the turns before is
        kept, and only the new part of the prompt is fed. Turn numbers count generated turns.
        ``max_new_tokens`` and ``seed`` default to the decoder's.
        """
        picker = TokenPicker(self.sampling, self.seed if seed is None else seed)
        limit = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        return conversation(self.target.processor, images, questions, raw_prompt, history,
                            lambda turn, question, text, shown: self._turn(turn, question, text, shown, picker, limit),
                            turn_images)

    def _turn(self, turn: int, question: str, text: str, images: Sequence[Any], picker: TokenPicker,
              max_new_tokens: int) -> Generator[BlockVerified, None, TurnResult]:
        clock = TurnClock(self.drafter)
        prompt = process(self.target.processor, text, images)
        check_context(self.target.model.config, len(prompt.ids), max_new_tokens,  # before any forward
                      image_tokens=prompt.ids.count(self.target.image_token_id), images=len(images))
        self.cached_target.reserve(len(prompt.ids) + max_new_tokens + STATIC_SLACK)  # a static state: allocated now
        self.step.begin_turn()
        self._begin_turn(TurnStart(text, images, self.cached_target, max_new_tokens + STATIC_SLACK, prompt), prompt)
        for model, tokens in self.drafter.traits.prompt_views:  # each draft's own view of the prompt (text-only, ...)
            check_context(model.config, tokens, max_new_tokens, "draft", f"the prompt as drafter {self.drafter.name} "
                          f"shows it to the draft")
        output = TurnOutput(turn, self.eos)
        costs = None if self.tree.drafts_tree else self.step_costs  # the cost schedule prices chains
        schedule = GammaSchedule(self.gamma_schedule, self.gamma, self.max_length, costs=costs)
        while not output.finished and len(output.tokens) < max_new_tokens:
            room = max_new_tokens - len(output.tokens) - 1  # the target adds one token after the drafts
            context = len(prompt.ids) + len(output.tokens)
            gamma = self.step.length(schedule.length(context), room)
            outcome = self.step.run(prompt, output.tokens, gamma, picker)
            schedule.update(len(outcome.draft), outcome.verdict.accepted,
                            1000 * (outcome.draft_s + outcome.verify_s + outcome.update_s), context)
            block = output.add(outcome)
            with clock.paused():  # the consumer's time (rendering) is not decoding
                yield block
        answer = self.target.tokenizer.decode(output.tokens, skip_special_tokens=True).strip()
        return output.result(question, answer, wall_s=clock.decoding_s, caption_s=clock.caption_s)

    def _begin_turn(self, turn: TurnStart, prompt) -> None:
        """Hand the drafter the new prompt. When its start is slow (captioning) and ``overlap_prefill``
        is on, it runs in a thread while the target prefills all but the last prompt token, which
        the first block then feeds with the draft (so the tokens and blocks are unchanged)."""
        if not (self.overlap_prefill and self.drafter.traits.slow_start and turn.images and len(prompt.ids) > 1):
            self.drafter.begin_turn(turn)
            return
        started = overlap_worker().submit(self.drafter.begin_turn, turn)
        self.cached_target.logits(prompt.ids[:-1], keep=1, vision=prompt.vision)
        started.result()  # re-raises the drafter's error, if any


_WORKER: ThreadPoolExecutor | None = None


def overlap_worker() -> ThreadPoolExecutor:
    """The one thread, kept for the whole process, that runs a drafter's slow start beside the prefill.

    A new thread per turn made the overlap slower than none on an H100 (CUDA libraries set up
    per-thread state on a thread's first kernels; docs/BENCHMARKS.md, "CUDA paths").
    """
    global _WORKER
    if _WORKER is None:
        _WORKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mmspec-overlap")
    return _WORKER
