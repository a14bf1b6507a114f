"""Clocks of the decoding loop: the stages of a block, and a turn's decoding time.

A turn's decoding time leaves out what is not decoding: the consumer's time between events
(rendering, writing records), captioning, which caption drafting reports apart, and compiling
(``--compile``: the first use of each step shape), which ``compiled.LOG`` reports apart.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from mmspec_cli.decoding.compiled import LOG as COMPILE_LOG


class Laps:
    """Seconds between successive calls of :meth:`lap`, starting now, less the time ``--compile`` spent
    compiling a step shape in between (a turn's clock leaves it out too)."""

    def __init__(self) -> None:
        self.last = time.perf_counter()
        self.compiled = COMPILE_LOG.total_s

    def lap(self) -> float:
        now, compiled = time.perf_counter(), COMPILE_LOG.total_s
        elapsed = now - self.last - (compiled - self.compiled)
        self.last, self.compiled = now, compiled
        return elapsed


class TurnClock:
    """A turn's wall time, less the pauses taken with :meth:`paused`, the drafter's captioning, and the time
    ``--compile`` spent compiling a step shape seen for the first time (reported on its own line)."""

    def __init__(self, drafter: Any):
        self.drafter = drafter
        self.start = time.perf_counter()
        self.paused_s = 0.0
        self.captioned_before = drafter.traits.caption_seconds
        self.compiled_before = COMPILE_LOG.total_s

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent inside (the consumer's, while an event is handed over) is not decoding."""
        begin = time.perf_counter()
        try:
            yield
        finally:
            self.paused_s += time.perf_counter() - begin

    @property
    def caption_s(self) -> float:
        return self.drafter.traits.caption_seconds - self.captioned_before

    @property
    def decoding_s(self) -> float:
        compiling = COMPILE_LOG.total_s - self.compiled_before
        return time.perf_counter() - self.start - self.paused_s - self.caption_s - compiling
