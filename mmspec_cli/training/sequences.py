"""The target's view of each answered turn: token ids, and its features read exactly as inference reads them.

A training sequence is the prompt the target answered followed by its answer. ONE frozen forward
of the target over it gives, through the same forward hook the head drafter reads at inference
(:func:`mmspec_cli.decoding.features.tap_for`), the input embeddings e_p (the projector outputs
at image slots) and the last hidden states f_p after the final norm. The target's logits at p
are ``lm_head(f_p)``, so they are not stored. Features are computed once per sequence and kept in
memory while they fit in ``budget_bytes`` (float32); past that they are computed again when used.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mmspec_cli.decoding.features import tap_for
from mmspec_cli.models.loading import LoadedModel
from mmspec_cli.models.prompts import process
from mmspec_cli.training.answers import Answer
from mmspec_cli.training.corpus import Conversation

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


@torch.no_grad()  # not inference_mode: the features enter the head's autograd graph
def read_sequence(target: LoadedModel, turn: Turn) -> TargetSequence:
    """Run the frozen target once over the turn's prompt and answer and read its features."""
    images = turn.conversation.load_images()
    prompt = process(target.processor, turn.answer.prompt, images)
    ids = prompt.ids + list(turn.answer.answer_ids)
    model = target.model
    tap = tap_for(model)
    vision = {k: (v.to(model.device, model.dtype) if v.is_floating_point() else v.to(model.device))
              for k, v in prompt.vision.items()}
    model(input_ids=torch.tensor([ids], device=model.device), use_cache=False, logits_to_keep=1, **vision)
    embeds, hidden = tap.take()
    return TargetSequence(ids, len(prompt.ids), embeds.float().clone(), hidden.float().clone())


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
