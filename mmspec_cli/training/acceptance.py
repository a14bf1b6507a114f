"""How well a trained drafter (a head, or ``ssd`` through an imitation network) drafts: its block efficiency τ on held-out conversations, decoded by the real engine.

τ = tokens emitted / target calls (mmspec's definition: the bonus token included, so τ ∈ [1, γ + 1]),
pooled over every turn. Greedy, a chain of γ = 5 by default, or any tree the engine supports.
The output is the target's own whatever the head drafts (the engine verifies every block).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mmspec_cli.decoding.engine import SpeculativeDecoder
from mmspec_cli.decoding.metrics import RunStats
from mmspec_cli.decoding.drafter import Drafter
from mmspec_cli.errors import MmspecError
from mmspec_cli.models.loading import LoadedModel
from mmspec_cli.training.corpus import Conversation


@dataclass(frozen=True)
class Acceptance:
    block_efficiency: float
    turns: int
    new_tokens: int
    blocks: int

    def as_dict(self) -> dict:
        return {"block_efficiency": round(self.block_efficiency, 4), "turns": self.turns,
                "new_tokens": self.new_tokens, "blocks": self.blocks}


def measure(target: LoadedModel, drafter: Drafter, conversations: Sequence[Conversation], max_new_tokens: int,
            gamma: int = 5, tree: str | None = None, tree_budget: int = 30, tree_depth: int = 3,
            tree_topk: int = 8) -> Acceptance | None:
    """Greedy decoding of every conversation with ``drafter`` (a head's, or ``ssd`` through an imitation network);
    conversations whose images fail are skipped, and None means every one failed (τ ≥ 1 is not defined on none)."""
    decoder = SpeculativeDecoder(target, drafter, gamma=gamma, max_new_tokens=max_new_tokens,
                                 tree=tree, tree_budget=tree_budget, tree_depth=tree_depth, tree_topk=tree_topk)
    parts: list[RunStats] = []
    for conversation in conversations:
        try:
            opening, brought = conversation.split_images(conversation.load_images())
        except MmspecError:
            continue
        generation = decoder.generate(opening, list(conversation.turns), history=conversation.history,
                                      turn_images=brought)
        parts.extend(turn.stats for turn in generation.turns)
    if not parts:
        return None
    total = RunStats.total(parts)
    return Acceptance(total.block_efficiency, len(parts), total.new_tokens, total.blocks)


def described(found: Acceptance | None, held: int, what: str) -> str:
    """``what``'s τ on ``held`` held-out conversations in words, or that none of them could be decoded."""
    if found is None:
        return f"{what}: none of the {held} held-out conversations could be decoded (their images failed to load)"
    return f"{what}: τ {found.block_efficiency:.3f} on {held} held-out conversations"
