"""What the engine needs from a drafting method: the :class:`Drafter` contract and the drafts it hands over.

A drafter has four verbs, one per moment of a block (docs/ARCHITECTURE.md, "The life of one block"):

1. ``begin_turn(turn)``: take a turn's prompt (:class:`TurnStart`: its text and images, the target's
   cached model, the room its states need after the prompt);
2. ``propose(verified, shape, picker)``: a chain of γ tokens, a width tree or a dynamic tree
   (:class:`DraftShape`), after the prompt and the ``verified`` tokens generated so far. It returns a
   :class:`Draft` (or :class:`TreeDraft`): the tokens and, when sampling, the distribution each token was
   drawn from; the verifier needs exactly that q (vLLM's proposer/rejection-sampler split);
3. ``roll_back(kept)``: what the target kept of that draft (:class:`Kept`): a count of drafted tokens, or a
   tree's path. This is where the drafter rolls its own states back, as a visible step of the block;
4. ``observe(target_logits, draft, verdict, picker)``: the target's logits along the followed chain
   (adaptive drafters learn here).

What the engine must know of a drafter's resources is data it declares once, :class:`DrafterTraits`
(``traits``): its draft-side models, its view of the prompt's length, whether it drafts at all, whether
its turn start is slow (captioning). With ``name`` that makes six members.

The drafting methods themselves live in :mod:`mmspec_cli.drafters`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
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


@dataclass(frozen=True)
class DraftShape:
    """What one block asks a drafter for: a ``chain`` of ``length`` tokens; a ``width`` tree of ``width`` branches
    of ``length`` tokens (TABED §6.1); or an EAGLE-2 ``dynamic`` tree of ``length`` levels, ``topk`` children per
    expanded node and at most ``budget`` − 1 nodes."""

    length: int
    kind: str = "chain"
    width: int = 1
    budget: int = 0
    topk: int = 0

    @property
    def tree(self) -> bool:
        return self.kind != "chain"


@dataclass(frozen=True)
class Kept:
    """What the target kept of a block's draft: its first ``count`` tokens; for a tree, ``nodes`` is the accepted
    path (node numbers from the tree's top), of length ``count``."""

    count: int
    nodes: tuple[int, ...] | None = None


@dataclass
class TurnStart:
    """What a drafter is given at the start of a turn: the prompt rendered for the target, its images, the target's
    cached model, ``cached_target`` (a drafter may read it: ``ssd`` drafts in its cache, a head reads its features; its kind says
    whether the drafter's own states are dynamic, static or compiled), ``room``: positions after the prompt
    that the drafter's static states must hold (allocated now, not in the middle of the turn), and ``prompt``: the
    prompt as the target's processor made it (its ids and image tensors), for a drafter that reads the target's view
    (``ssd``, a head, ``pld``) instead of processing the images again."""

    text: str
    images: Sequence[Any]
    cached_target: Any  # decoding.kv.CachedModel
    room: int
    prompt: Any  # models.prompts.ModelPrompt


@dataclass
class DrafterTraits:
    """What a drafter declares once about its resources, read by the engine instead of asked in turn.

    - ``models``: the draft-side models it runs forwards of (their support for token trees is checked);
    - ``members``: the order of the weights an ensemble reports (empty for single drafters);
    - ``drafts``: False for ``ar``, whose blocks are plain decoding steps of the target;
    - ``slow_start``: its turn start does heavy work of its own when the turn has images (captioning), worth
      overlapping with the target's prefill;
    - ``captioner``: what it captions with (its ``seconds`` are time spent captioning), or None;
    - ``prompt_views``: after ``begin_turn``, (draft model, tokens) of each of its own views of the prompt, for
      the engine's context check (empty when it reads no prompt of its own: ``ar``; ``ssd`` reads the target's).
    """

    models: tuple[Any, ...] = ()
    members: tuple[str, ...] = ()
    drafts: bool = True
    slow_start: bool = False
    captioner: Any = None
    prompt_views: list[tuple[Any, int]] = field(default_factory=list)

    @property
    def caption_seconds(self) -> float:
        return self.captioner.seconds if self.captioner is not None else 0.0


def as_asked(shape: DraftShape, proposed: "Draft | TreeDraft", drafter: str) -> "Draft | TreeDraft":
    """``proposed``, once it is checked to be of the shape the block asked for: a tree for a tree, a chain for a chain,
    or nothing (``EMPTY_DRAFT``, whatever the shape). A drafter that drafts chains only must be refused trees before
    loading (``registry.CHAIN_ONLY``), not give a chain where a tree was asked (the block would verify it as a chain,
    and the user's tree settings would do nothing)."""
    if proposed.tokens and shape.tree != isinstance(proposed, TreeDraft):
        if shape.tree:
            raise TypeError(f"drafter '{drafter}' was asked for a tree and proposed a chain; a drafter that drafts "
                            f"chains only is refused trees in registry.CHAIN_ONLY (docs/ARCHITECTURE.md, How to add "
                            f"a drafter)")
        raise TypeError(f"drafter '{drafter}' was asked for a chain and proposed a tree; propose a tree only when "
                        f"shape.tree")
    return proposed


class Drafter(ABC):
    """A drafting method (module doc): ``name`` (``m``, ``t``, ``tabed``, ...), ``traits``, and four verbs."""

    name: str
    traits: DrafterTraits

    @abstractmethod
    def begin_turn(self, turn: TurnStart) -> None:
        """Take the prompt of a new turn; make room in the drafter's own static states."""

    @abstractmethod
    def propose(self, verified: Sequence[int], shape: DraftShape, picker: TokenPicker) -> "Draft | TreeDraft":
        """Draft after the prompt and the ``verified`` tokens generated in this turn, in ``shape``."""

    def roll_back(self, kept: Kept) -> None:
        """The target kept ``kept`` of the last draft: roll the drafter's states back to it."""

    def observe(self, target_logits: torch.Tensor, draft: Draft, verdict: Verdict, picker: TokenPicker) -> None:
        """See the target's logits (γ+1, V) for the block just verified; adaptive drafters learn here."""
