"""The speculative decoding loop.

One block (gpt-fast style, see DESIGN.md):
  1. the drafter proposes up to γ tokens after the verified ones (its cache rolls back by itself);
  2. the target scores [last verified token, d_1..d_γ] in ONE forward over its KV cache
     (the first block of a turn feeds the prompt in that same call);
  3. the verification rule (``verify.py``) accepts a prefix and adds the target's own token;
  4. the block is reported as a :class:`BlockVerified` event.
The target cache is rolled back with ``Cache.crop`` on the next call (``runner.py``), so the
whole prefix is never re-run. γ comes from the draft-length schedule (``schedules.py``:
constant, heuristic or FastVLM Eq. 5) and is cut to ``max_new_tokens - generated - 1`` so that
``max_new_tokens`` is exact; an EOS inside a block ends the turn at that token.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mmspec_cli.drafters.base import EMPTY_DRAFT, Draft, Drafter, NoDrafter, TreeDraft
from mmspec_cli.decoding.metrics import RunStats
from mmspec_cli.models.loading import LoadedModel
from mmspec_cli.models.prompts import (ModelPrompt, check_history, check_questions, check_raw_prompt, process,
                                       render_prompt)
from mmspec_cli.decoding.kv import CachedModel
from mmspec_cli.decoding.sampling import SamplingParams, TokenPicker
from mmspec_cli.decoding.schedules import GammaSchedule, check_schedule
from mmspec_cli.decoding.tree import check_tree_support, check_tree_width
from mmspec_cli.decoding.verify import Verdict, verify_greedy, verify_sampling, verify_tree_greedy, verify_tree_sampling


@dataclass(frozen=True)
class TurnStarted:
    turn: int
    question: str
    prompt: str


@dataclass(frozen=True)
class BlockVerified:
    """One draft + verify block. ``tokens`` are what the block added to the output:
    the accepted draft tokens, then ``emitted`` (the target's correction or bonus token),
    cut after EOS or at ``max_new_tokens``; ``emitted`` is None if the cut removed it."""

    turn: int
    index: int
    draft: list[int]
    accepted: int
    emitted: int | None
    tokens: list[int]
    draft_s: float
    verify_s: float
    update_s: float = 0.0  # the drafter's learning from the verified block (TABED evidence)
    weights: list[float] | None = None
    tree: list[list[int]] | None = None  # a token-tree block's branches; ``draft`` is the one followed


@dataclass(frozen=True)
class TurnResult:
    question: str
    text: str
    token_ids: list[int]
    stats: RunStats
    blocks: list[BlockVerified] = field(default_factory=list)
    caption_s: float = 0.0  # time spent captioning this turn's images (caption drafting); not in stats.wall_s


@dataclass(frozen=True)
class TurnFinished:
    turn: int
    result: TurnResult


Event = TurnStarted | BlockVerified | TurnFinished


@dataclass(frozen=True)
class Generation:
    drafter: str
    turns: list[TurnResult]
    members: tuple[str, ...] = ()  # the order of each block's ensemble weights

    @property
    def stats(self) -> RunStats:
        return RunStats.total(t.stats for t in self.turns)


def eos_ids(target: LoadedModel) -> set[int]:
    """End-of-sequence ids exactly as the target's own ``generate`` uses them."""
    value = getattr(target.model.generation_config, "eos_token_id", None)
    if value is None:
        value = target.tokenizer.eos_token_id
    if value is None:
        return set()
    return {int(v) for v in (value if isinstance(value, (list, tuple)) else [value])}


def max_sequence_length(config: Any, default: int = 4096) -> int:
    """The model's maximum sequence length (N of FastVLM Eq. 5), from its text config."""
    text = getattr(config, "text_config", None) or config
    value = getattr(text, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else default


def cut_after_eos(tokens: list[int], eos: set[int]) -> tuple[list[int], bool]:
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[: i + 1], True
    return tokens, False


class SpeculativeDecoder:
    """Speculative decoding of ``target`` with ``drafter``; reusable across calls and turns.

    >>> decoder = SpeculativeDecoder(target, drafter, gamma=5, max_new_tokens=128)
    >>> generation = decoder.generate(images, ["Describe the image."])
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
    ):
        self.target = target
        self.drafter = drafter
        self.gamma = gamma
        self.gamma_schedule = check_schedule(gamma_schedule)
        self.tree_width = check_tree_width(tree_width)
        if tree_width > 1 and not isinstance(drafter, NoDrafter):  # `ar` drafts nothing: its tree width is moot
            for model in (target.model, *drafter.models()):
                check_tree_support(model)
        self.max_new_tokens = max_new_tokens
        self.sampling = sampling
        self.seed = seed
        self.runner = CachedModel(target.model, role="target", image_token_id=target.image_token_id)
        drafter.bind_target(self.runner)
        self.max_length = max_sequence_length(target.model.config)  # N of FastVLM Eq. (5)
        self.eos = eos_ids(target)
        # On CUDA, a drafter's slow start (captioning) runs beside the target's prefill; see _begin_turn.
        self.overlap_prefill = target.model.device.type == "cuda" if overlap_prefill is None else overlap_prefill

    def generate(self, images: Sequence[Any], questions: Sequence[str], raw_prompt: str | None = None,
                 on_event: Callable[[Event], None] | None = None,
                 history: Sequence[tuple[str, str]] = ()) -> Generation:
        """Run every turn and return the results; ``on_event`` sees each event as it happens."""
        turns = []
        for event in self.stream(images, questions, raw_prompt, history):
            if on_event is not None:
                on_event(event)
            if isinstance(event, TurnFinished):
                turns.append(event.result)
        return Generation(drafter=self.drafter.name, turns=turns, members=self.drafter.members)

    def stream(self, images: Sequence[Any], questions: Sequence[str], raw_prompt: str | None = None,
               history: Sequence[tuple[str, str]] = ()) -> Iterator[Event]:
        """Yield events turn by turn. ``raw_prompt`` (one turn) replaces the chat template.

        ``history``: earlier (question, answer) turns of the conversation, given as they are and
        not generated; the images belong to its first turn. Turn numbers count generated turns.
        """
        questions = check_questions(questions, raw_prompt)
        history = check_history(history, raw_prompt)
        if raw_prompt is not None:
            check_raw_prompt(raw_prompt, self.target.processor, len(images))
        picker = TokenPicker(self.sampling, self.seed)
        answers: list[str] = []
        for turn, question in enumerate(questions):
            if raw_prompt is not None:
                text = raw_prompt
            else:
                text = render_prompt(self.target.processor, questions, answers, len(images), history)
            yield TurnStarted(turn=turn, question=question, prompt=text)
            result = yield from self._turn(turn, question, text, images, picker)
            answers.append(result.text)
            yield TurnFinished(turn=turn, result=result)

    def _turn(self, turn: int, question: str, text: str, images: Sequence[Any], picker: TokenPicker):
        start = time.perf_counter()
        prompt = process(self.target.processor, text, images)
        captioning_before = self.drafter.caption_seconds
        self._begin_turn(text, images, prompt)
        generated: list[int] = []
        blocks: list[BlockVerified] = []
        drafted = accepted_total = 0
        paused = 0.0
        finished = False
        schedule = GammaSchedule(self.gamma_schedule, self.gamma, self.max_length)
        while not finished and len(generated) < self.max_new_tokens:
            scheduled = schedule.length(len(prompt.ids) + len(generated))
            gamma = min(scheduled, self.max_new_tokens - len(generated) - 1)
            t0 = time.perf_counter()
            tree = None
            if gamma > 0 and self.tree_width > 1 and not isinstance(self.drafter, NoDrafter):
                tree = self.drafter.propose_tree(generated, gamma, self.tree_width, picker)
                t1 = time.perf_counter()
                verdict, target_logits, draft = self._verify_tree(prompt, generated, tree, picker)
            else:
                draft = self.drafter.propose(generated, gamma, picker) if gamma > 0 else EMPTY_DRAFT
                t1 = time.perf_counter()
                verdict, target_logits = self._verify(prompt, generated, draft, picker)
            t2 = time.perf_counter()
            if len(draft):
                self.drafter.observe(target_logits, draft, verdict, picker)
            schedule.update(len(draft), verdict.accepted)
            t3 = time.perf_counter()
            new_tokens, finished = cut_after_eos(draft.tokens[: verdict.accepted] + [verdict.next_token], self.eos)
            kept_drafts = min(verdict.accepted, len(new_tokens))
            generated.extend(new_tokens)
            drafted += len(draft)
            accepted_total += kept_drafts
            block = BlockVerified(
                turn=turn, index=len(blocks), draft=list(draft.tokens), accepted=kept_drafts,
                emitted=verdict.next_token if len(new_tokens) > kept_drafts else None,
                tokens=new_tokens, draft_s=t1 - t0, verify_s=t2 - t1, update_s=t3 - t2, weights=draft.weights,
                tree=None if tree is None else [list(b) for b in tree.branches],
            )
            blocks.append(block)
            handed_over = time.perf_counter()
            yield block
            paused += time.perf_counter() - handed_over  # the consumer's time (rendering) is not decoding
        caption_s = self.drafter.caption_seconds - captioning_before
        wall_s = time.perf_counter() - start - paused - caption_s
        stats = RunStats(new_tokens=len(generated), blocks=len(blocks), drafted=drafted,
                         accepted=accepted_total, wall_s=wall_s)
        text_out = self.target.tokenizer.decode(generated, skip_special_tokens=True).strip()
        return TurnResult(question=question, text=text_out, token_ids=generated, stats=stats, blocks=blocks,
                          caption_s=caption_s)

    def _begin_turn(self, text: str, images: Sequence[Any], prompt) -> None:
        """Hand the drafter the new prompt. When its start is slow (captioning) and ``overlap_prefill``
        is on, it runs in a thread while the target prefills all but the last prompt token, which
        the first block then feeds with the draft (so the tokens and blocks are unchanged)."""
        if not (self.overlap_prefill and self.drafter.slow_start(images) and len(prompt.ids) > 1):
            self.drafter.begin_turn(text, images)
            return
        with ThreadPoolExecutor(max_workers=1) as pool:
            started = pool.submit(self.drafter.begin_turn, text, images)
            self.runner.logits(prompt.ids[:-1], keep=1, vision=prompt.vision)
            started.result()  # re-raises the drafter's error, if any

    def _verify_tree(self, prompt: ModelPrompt, generated: list[int], tree: TreeDraft,
                     picker: TokenPicker) -> tuple[Verdict, torch.Tensor, Draft]:
        """ONE target forward over the whole tree, after the verified tokens; then the tree rule.

        The nodes are the last verified token (the root) and the branches' tokens, branch after
        branch; each sees the cached prefix and its own ancestors (``tree.py``). Only the followed
        branch's accepted entries stay in the target's cache (and in the draft's). Returns the
        verdict, the target's logits (γ+1, V) along the followed branch, and that branch as a chain.
        """
        verified = prompt.ids + generated
        context = len(verified) - 1
        self.runner.hold(verified[:context], vision=prompt.vision, prompt_len=min(len(prompt.ids), context))
        width, gamma = len(tree.branches), len(tree.branches[0])
        tokens = [verified[-1]] + [token for branch in tree.branches for token in branch]
        parents = [-1] + [0 if t == 0 else j * gamma + t for j in range(width) for t in range(gamma)]
        logits = self.runner.tree_logits(tokens, parents)  # (1 + d·γ, V)
        root, rest = logits[0], logits[1:].reshape(width, gamma, -1)  # (V,), (d, γ, V)
        branches = torch.tensor(tree.branches, dtype=torch.long)  # (d, γ)
        if picker.greedy:
            outcome = verify_tree_greedy(branches, root, rest)
        else:
            outcome = verify_tree_sampling(branches, tree.probs, picker.distribution(root), picker.distribution(rest),
                                           picker.generator)
        self.runner.keep_path([0] + [1 + outcome.branch * gamma + t for t in range(outcome.accepted)])
        self.drafter.keep_branch(outcome.branch, outcome.accepted)
        path = torch.cat([root[None], rest[outcome.branch]])  # (γ+1, V)
        return Verdict(outcome.accepted, outcome.next_token), path, tree.branch(outcome.branch)

    def _verify(self, prompt: ModelPrompt, generated: list[int], draft: Draft,
                picker: TokenPicker) -> tuple[Verdict, torch.Tensor]:
        """ONE target forward over the verified tokens plus the draft; then the verification rule."""
        logits = self.runner.logits(prompt.ids + generated + draft.tokens, keep=len(draft) + 1,
                                    vision=prompt.vision, prompt_len=len(prompt.ids))  # (γ+1, V)
        tokens = torch.tensor(draft.tokens, dtype=torch.long)
        if picker.greedy:
            return verify_greedy(tokens, logits), logits
        return verify_sampling(tokens, draft.probs, picker.distribution(logits), picker.generator), logits
