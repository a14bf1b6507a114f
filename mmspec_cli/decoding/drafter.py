"""What the engine needs from a drafting method: the :class:`Drafter` interface and the drafts it hands over.

A drafter is told the prompt of each turn (``begin_turn``), then asked once per block for
up to γ tokens that continue the tokens generated so far (``propose``), or for a token tree
(``propose_tree``). It returns a :class:`Draft` (or :class:`TreeDraft`): the tokens and, when
sampling, the distribution each token was drawn from; the verifier needs exactly that q
(vLLM's proposer/rejection-sampler split: a dataclass hands drafts to the verifier). Rolling
back after a rejection is implicit: the next ``propose`` receives the verified tokens, and
the drafter's cache keeps only what matches them. After a tree block the drafter is told
the accepted nodes (``keep_path``).

The drafting methods themselves live in :mod:`mmspec_cli.drafters`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mmspec_cli.decoding.sampling import TokenPicker
from mmspec_cli.decoding.tree import TreeTopology
from mmspec_cli.decoding.verify import Verdict


@dataclass(frozen=True)
class Draft:
    """γ proposed token ids; ``probs`` (γ, V) the distributions they were drawn from (None when greedy).

    ``nodes``: when this chain is a branch of a :class:`TreeDraft`, its node numbers in the tree.
    """

    tokens: list[int]
    probs: torch.Tensor | None = None
    weights: list[float] | None = None  # ensemble weights used for this block, if any
    nodes: tuple[int, ...] | None = None

    def __len__(self) -> int:
        return len(self.tokens)


EMPTY_DRAFT = Draft(tokens=[])


@dataclass(frozen=True)
class TreeDraft:
    """A token tree: ``tokens[i]`` is node i of ``topology``; ``probs`` (n, V) the distribution each
    node's token was drawn from (None when greedy, and for dynamic trees, whose tokens are chosen
    deterministically). Branches are the topology's root-to-leaf paths."""

    topology: TreeTopology
    tokens: list[int]
    probs: torch.Tensor | None = None
    weights: list[float] | None = None
    scores: list[float] | None = None  # a dynamic tree's draft scores (EAGLE-2), which order siblings for sampling

    @property
    def branches(self) -> list[list[int]]:
        """Each branch's tokens, in branch order."""
        return [[self.tokens[node] for node in path] for path in self.topology.branches()]

    def branch_probs(self) -> torch.Tensor | None:
        """(d, γ, V): the distribution each branch token was drawn from (None when greedy)."""
        if self.probs is None:
            return None
        return torch.stack([self.probs[path] for path in self.topology.branches()])

    def branch(self, j: int) -> Draft:
        """Branch ``j`` as a chain draft."""
        return self.chain(self.topology.branches()[j])

    def chain(self, path: list[int]) -> Draft:
        """The nodes of ``path`` (from depth 0 down) as a chain draft."""
        return Draft(tokens=[self.tokens[node] for node in path],
                     probs=None if self.probs is None else self.probs[path], weights=self.weights, nodes=tuple(path))


class Drafter(ABC):
    """A drafting method. ``name`` is the user-facing drafter name (``m``, ``t``, ...);
    ``members`` the order of the weights an ensemble reports (empty for single drafters);
    ``drafts`` is False for ``ar``, whose blocks are plain decoding steps of the target."""

    name: str
    members: tuple[str, ...] = ()
    drafts: bool = True

    @abstractmethod
    def begin_turn(self, prompt_text: str, images: Sequence[Any]) -> None:
        """Take the prompt of a new turn (the text rendered for the target, and the images)."""

    @abstractmethod
    def propose(self, generated: Sequence[int], gamma: int, picker: TokenPicker) -> Draft:
        """Draft ``gamma`` tokens after the prompt and the verified ``generated`` tokens."""

    @abstractmethod
    def propose_tree(self, generated: Sequence[int], gamma: int, width: int, picker: TokenPicker) -> TreeDraft:
        """Draft ``width`` branches of ``gamma`` tokens (token trees, TABED §6.1), all in each draft forward."""

    def propose_dynamic_tree(self, generated: Sequence[int], levels: int, budget: int, topk: int,
                             picker: TokenPicker) -> TreeDraft:
        """Draft an EAGLE-2 dynamic tree of at most ``levels`` levels and ``budget`` − 1 nodes."""
        raise NotImplementedError(f"drafter {self.name} drafts no dynamic tree")

    def keep_path(self, nodes: Sequence[int]) -> None:
        """After a tree block: the target accepted these nodes of the tree (a path from its top)."""

    def models(self) -> list[Any]:
        """The draft-side models this drafter runs forwards of (checked for token-tree support)."""
        return []

    def prompt_lengths(self) -> list[tuple[Any, int]]:
        """After ``begin_turn``: (draft model, tokens) of its own view of the prompt, for the engine's context check.

        Empty when the drafter reads no prompt of its own (``ar``; ``ssd`` reads the target's).
        """
        return []

    def bind_target(self, runner: Any) -> None:
        """Receive the engine's target :class:`~mmspec_cli.decoding.kv.CachedModel`; ``ssd`` drafts over its cache."""

    def reserve(self, after_prompt: int) -> None:
        """Room for ``after_prompt`` positions after this turn's prompt in the drafter's own static KV states
        (allocated at the start of a turn, not in its middle); nothing for a drafter without one."""

    def slow_start(self, images: Sequence[Any]) -> bool:
        """Whether ``begin_turn`` does heavy work of its own (captioning) worth overlapping with the target."""
        return False

    @property
    def caption_seconds(self) -> float:
        """Total time this drafter has spent captioning images."""
        return 0.0

    def observe(self, target_logits: torch.Tensor, draft: Draft, verdict: Verdict, picker: TokenPicker) -> None:
        """See the target's logits (γ+1, V) for the block just verified; adaptive drafters learn here."""
