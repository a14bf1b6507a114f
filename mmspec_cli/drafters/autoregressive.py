"""``ar``: no drafting; every block is one plain decoding step of the target (the baseline)."""

from __future__ import annotations

from collections.abc import Sequence

from mmspec_cli.decoding.drafter import EMPTY_DRAFT, Draft, Drafter, DrafterTraits, DraftShape, TurnStart
from mmspec_cli.decoding.sampling import TokenPicker


class NoDrafter(Drafter):
    """Drafts nothing (``traits.drafts`` is False): the engine verifies empty blocks, i.e. decodes one token each."""

    name = "ar"

    def __init__(self) -> None:
        self.traits = DrafterTraits(drafts=False)

    def begin_turn(self, turn: TurnStart) -> None:
        pass

    def propose(self, verified: Sequence[int], shape: DraftShape, picker: TokenPicker) -> Draft:
        return EMPTY_DRAFT
