"""The target's view of each answered turn: token ids, and its features read exactly as inference reads them.

A training sequence is the prompt the target answered followed by its answer. The frozen target
runs over it as decoding fed it (:func:`run_turn`): the prompt with its images, then the answer
after the cached prompt, its tokens ordinary tokens. Through the same forward hook the head
drafter reads at inference (:func:`mmspec_cli.decoding.features.tap_for`) that gives the input
embeddings e_p (the projector outputs at image slots) and the last hidden states f_p after the
final norm. The target's logits at p are ``lm_head(f_p)``, so they are not stored. Features are
computed once per sequence and kept in memory while they fit in ``budget_bytes`` (float32); past
that they are computed again when used.

Any target can emit any token of its vocabulary, its own image placeholder id included. Fed in one
forward with the pixels, such an answer would ask for one image more than the prompt holds; fed
after the prompt, the placeholder is the ordinary token it was when the target produced it
(:func:`placeholder_answers` counts these answers for the report).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from mmspec_cli.decoding.features import tap_for
from mmspec_cli.decoding.kv import to_model
from mmspec_cli.models.loading import LoadedModel
from mmspec_cli.models.families import family_of
from mmspec_cli.models.prompts import ModelPrompt, process
from mmspec_cli.training.answers import Answer
from mmspec_cli.training.corpus import Conversation
from mmspec_cli.models.parts import with_cache

DEFAULT_BUDGET = 2 << 30  # bytes of features kept in memory


@dataclass(frozen=True)
class Turn:
    """One answered turn to train on: the conversation (for its images) and the record."""

    conversation: Conversation
    answer: Answer


@dataclass(frozen=True)
class TargetSequence:
    """``ids`` = prompt + answer (``prompt_len`` prompt ids); ``embeds`` and ``hidden`` (len(ids), H)."""

    ids: list[int]
    prompt_len: int
    embeds: torch.Tensor
    hidden: torch.Tensor

    @property
    def nbytes(self) -> int:
        return (self.embeds.numel() + self.hidden.numel()) * 4


def trainable(answers: Sequence[Answer]) -> list[Answer]:
    """Records with an answer (failed ones have none)."""
    return [a for a in answers if a.error is None and a.answer_ids]


def placeholder_answers(target: LoadedModel, answers: Sequence[Answer]) -> int:
    """How many ``answers`` hold the target's image placeholder id (read as ordinary tokens, see the module doc)."""
    image_id = target.image_token_id
    return 0 if image_id is None else sum(image_id in a.answer_ids for a in answers)


@torch.no_grad()  # not inference_mode: what the readers keep enters the head's autograd graph
def run_turn(target: LoadedModel, turn: Turn, on_forward: Callable[[Any, torch.Tensor], None],
             **kwargs: Any) -> ModelPrompt:
    """Run the frozen target over the turn's prompt, then its answer, as decoding fed them (module doc).

    The prompt goes with its images; the answer follows in a second forward over the cached prompt,
    with no pixels. Both get explicit positions from the target's family (the answer's follow the
    prompt's rope offset, never one the model object kept). ``on_forward(output, positions)`` is called after
    each forward, with the position ids it fed (the reader takes what it needs); ``kwargs`` go to both. Returns
    the prompt as the target's processor tokenized it.
    """
    images = turn.conversation.shown(turn.conversation.load_images(), turn.answer.turn)
    prompt = process(target.processor, turn.answer.prompt, images)
    model = target.model
    cache = DynamicCache(config=model.config)
    vision = {k: to_model(v, model) for k, v in prompt.vision.items()}
    answer = list(turn.answer.answer_ids)
    family = family_of(model)
    positions, offset = family.prompt_positions(model, prompt.ids, vision, model.device)
    after = family.positions(offset).chain(len(prompt.ids), len(answer), model.device)
    for ids, pixels, at in ((prompt.ids, vision, positions), (answer, {}, after)):
        if ids:
            on_forward(model(input_ids=torch.tensor([ids], device=model.device), position_ids=at,
                             **with_cache(cache), use_cache=True, logits_to_keep=1, **pixels, **kwargs), at)
    return prompt


def read_sequence(target: LoadedModel, turn: Turn) -> TargetSequence:
    """The turn's ids and the target's features at every position (:func:`run_turn`)."""
    tap = tap_for(target.model)
    parts: list[tuple[torch.Tensor, torch.Tensor]] = []
    prompt = run_turn(target, turn, lambda output, positions: parts.append(tap.take()))
    embeds = torch.cat([e for e, _ in parts]).float().clone()
    hidden = torch.cat([h for _, h in parts]).float().clone()
    return TargetSequence(prompt.ids + list(turn.answer.answer_ids), len(prompt.ids), embeds, hidden)


class SequenceStore:
    """The target's sequences by index, computed on first use (by ``reader``: a head's features, or an imitation
    network's layers, :func:`.imitation.layer_reader`) and kept while they fit the budget."""

    def __init__(self, target: LoadedModel, turns: Sequence[Turn], budget_bytes: int = DEFAULT_BUDGET,
                 reader: Callable[[LoadedModel, Turn], Any] = read_sequence):
        self.target = target
        self.reader = reader
        self.turns = list(turns)
        self.budget = budget_bytes
        self.used = 0
        self.kept: dict[int, TargetSequence] = {}

    def __len__(self) -> int:
        return len(self.turns)

    def __getitem__(self, index: int) -> TargetSequence:
        found = self.kept.get(index)
        if found is not None:
            return found
        sequence = self.reader(self.target, self.turns[index])
        size = sequence.nbytes
        if self.used + size <= self.budget:
            self.kept[index] = sequence
            self.used += size
        return sequence
