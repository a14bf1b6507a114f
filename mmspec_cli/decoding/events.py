"""What decoding reports: one event per turn start, per verified block and per turn end, and the results.

``SpeculativeDecoder.stream`` yields these as they happen (``generate`` collects them); the CLI
renders them live and ``bench`` turns :class:`TurnResult` into records.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from mmspec_cli.decoding.metrics import RunStats


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


def collect(events: Iterable[Event], drafter: str, members: Sequence[str] = (),
            on_event: Callable[[Event], None] | None = None) -> Generation:
    """Run a stream of events to its end (``on_event`` sees each) and gather the finished turns."""
    turns = []
    for event in events:
        if on_event is not None:
            on_event(event)
        if isinstance(event, TurnFinished):
            turns.append(event.result)
    return Generation(drafter=drafter, turns=turns, members=tuple(members))
