"""``oracle``: a benchmarking drafter that proposes the target's own greedy continuation.

It replays, turn by turn, the tokens a first ``ar`` run of the same input produced, so every drafted
token is accepted and drafting costs nothing (no model runs). Each block then emits γ + 1 tokens for
one target forward over γ + 1 tokens, so its speedup over ``ar`` can reach at most

    (γ + 1) · T_p(1, S, 1) / T_p(1, S, γ + 1)

(``profile-latency``'s verification times). The measured speedup over that bound is the share of
the ideal the engine itself delivers: its own overhead, isolated at any model size, random weights
included. Greedy only: a sampled output is not a fixed sequence to replay. It drafts chains; a tree
would only add nodes the replay never needs.

If the verified tokens ever leave the recording (they can't when decoding is deterministic: the
engine's greedy output is ``ar``'s), the oracle proposes nothing more for that turn, and each block
is then one plain target step, as with ``ar``.
"""

from __future__ import annotations

from collections.abc import Sequence

from mmspec_cli.choices import ORACLE
from mmspec_cli.decoding.drafter import Draft, Drafter, DrafterTraits, DraftShape, TurnStart
from mmspec_cli.decoding.sampling import TokenPicker
from mmspec_cli.errors import InputError


class OracleDrafter(Drafter):
    """Replays ``recorded[k]``, the target's greedy tokens of turn k from a first ``ar`` run (module doc)."""

    name = ORACLE

    def __init__(self, recorded: Sequence[Sequence[int]]):
        self.recorded = [list(tokens) for tokens in recorded]
        self.turn = -1
        self.current: list[int] = []
        self.traits = DrafterTraits()

    def begin_turn(self, turn: TurnStart) -> None:
        self.turn += 1
        self.current = self.recorded[self.turn] if self.turn < len(self.recorded) else []

    def propose(self, verified: Sequence[int], shape: DraftShape, picker: TokenPicker) -> Draft:
        if not picker.greedy:
            raise InputError(NO_SAMPLING)
        if shape.tree:
            raise InputError(NO_TREES)
        n = len(verified)
        if self.current[n - 1:n] != list(verified[n - 1:n]) or len(self.current) < n:
            self.current = []  # left the recording: nothing more to replay this turn
        return Draft(tokens=self.current[n:n + shape.length])


NO_TREES = "the oracle drafter drafts chains (the recording is one path); drop --tree and --tree-width"
NO_SAMPLING = "the oracle drafter replays the target's greedy output; run it with --temperature 0"
