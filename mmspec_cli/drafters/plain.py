"""``ar``: no drafting; every block is one plain decoding step of the target (the baseline)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mmspec_cli.decoding.drafter import EMPTY_DRAFT, Draft, Drafter, TreeDraft
from mmspec_cli.decoding.sampling import TokenPicker


class NoDrafter(Drafter):
    """Drafts nothing (``drafts`` is False): the engine verifies empty blocks, i.e. decodes one token each."""

    name = "ar"
    drafts = False

    def begin_turn(self, prompt_text: str, images: Sequence[Any]) -> None:
        pass

    def propose(self, generated: Sequence[int], gamma: int, picker: TokenPicker) -> Draft:
        return EMPTY_DRAFT

    def propose_tree(self, generated: Sequence[int], gamma: int, width: int, picker: TokenPicker) -> TreeDraft:
        raise TypeError("ar drafts no tree; the engine never asks it for one")
