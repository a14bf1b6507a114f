"""The drafter interface: everything the engine needs from a drafting method.

A drafter is told the prompt of each turn (``begin_turn``), then asked once per block for
up to γ tokens that continue the tokens generated so far (``propose``). It returns a
:class:`Draft`: the tokens and, when sampling, the distribution each token was drawn
from; the verifier needs exactly that q. Rolling back after a rejection is implicit: the
next ``propose`` receives the verified tokens, and the drafter's cache keeps only what
matches them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mmspec_cli.decoding.sampling import TokenPicker, draw_without_replacement
from mmspec_cli.decoding.verify import Verdict


@dataclass(frozen=True)
class Draft:
    """γ proposed token ids; ``probs`` (γ, V) the distributions they were drawn from (None when greedy)."""

    tokens: list[int]
    probs: torch.Tensor | None = None
    weights: list[float] | None = None  # ensemble weights used for this block, if any
    branch: int = 0  # which branch of a TreeDraft this chain is

    def __len__(self) -> int:
        return len(self.tokens)


EMPTY_DRAFT = Draft(tokens=[])


@dataclass(frozen=True)
class TreeDraft:
    """d branches of γ tokens with distinct first tokens (verify.py's tree rules); ``probs`` (d, γ, V)
    the distributions each token was drawn from (None when greedy). Branch order is the draw order."""

    branches: list[list[int]]
    probs: torch.Tensor | None = None
    weights: list[float] | None = None

    def branch(self, j: int) -> Draft:
        """Branch ``j`` as a chain draft."""
        return Draft(tokens=list(self.branches[j]), probs=None if self.probs is None else self.probs[j],
                     weights=self.weights, branch=j)


def first_tokens(scores: torch.Tensor, width: int, picker: TokenPicker) -> list[int]:
    """The tree's first tokens from the root distribution: the ``width`` likeliest (greedy; ``scores``
    may be logits or probabilities), or ``width`` draws without replacement from ``scores`` (sampling;
    probabilities), fewer if the support is smaller."""
    if picker.greedy:
        return torch.topk(scores, min(width, scores.shape[-1])).indices.tolist()
    return draw_without_replacement(scores, width, picker.generator)


class Drafter(ABC):
    """A drafting method. ``name`` is the user-facing drafter name (``m``, ``t``, ...);
    ``members`` the order of the weights an ensemble reports (empty for single drafters)."""

    name: str
    members: tuple[str, ...] = ()

    @abstractmethod
    def begin_turn(self, prompt_text: str, images: Sequence[Any]) -> None:
        """Take the prompt of a new turn (the text rendered for the target, and the images)."""

    @abstractmethod
    def propose(self, generated: Sequence[int], gamma: int, picker: TokenPicker) -> Draft:
        """Draft ``gamma`` tokens after the prompt and the verified ``generated`` tokens."""

    @abstractmethod
    def propose_tree(self, generated: Sequence[int], gamma: int, width: int, picker: TokenPicker) -> TreeDraft:
        """Draft ``width`` branches of ``gamma`` tokens (token trees, TABED §6.1), all in each draft forward."""

    def keep_branch(self, branch: int, accepted: int) -> None:
        """After a tree block: the target followed ``branch`` and accepted its first ``accepted`` tokens."""

    def models(self) -> list[Any]:
        """The draft-side models this drafter runs forwards of (checked for token-tree support)."""
        return []

    def bind_target(self, runner: Any) -> None:
        """Receive the engine's target :class:`~mmspec_cli.decoding.kv.CachedModel`; ``ssd`` drafts over its cache."""

    def slow_start(self, images: Sequence[Any]) -> bool:
        """Whether ``begin_turn`` does heavy work of its own (captioning) worth overlapping with the target."""
        return False

    @property
    def caption_seconds(self) -> float:
        """Total time this drafter has spent captioning images."""
        return 0.0

    def observe(self, target_logits: torch.Tensor, draft: Draft, verdict: Verdict, picker: TokenPicker) -> None:
        """See the target's logits (γ+1, V) for the block just verified; adaptive drafters learn here."""


class NoDrafter(Drafter):
    """``ar``: no drafting; every block is one plain decoding step of the target."""

    name = "ar"

    def begin_turn(self, prompt_text: str, images: Sequence[Any]) -> None:
        pass

    def propose(self, generated: Sequence[int], gamma: int, picker: TokenPicker) -> Draft:
        return EMPTY_DRAFT

    def propose_tree(self, generated: Sequence[int], gamma: int, width: int, picker: TokenPicker) -> TreeDraft:
        return TreeDraft(branches=[])
