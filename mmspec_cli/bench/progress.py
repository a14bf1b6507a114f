"""The progress bar of ``mmspec bench`` on stderr: turns done, ETA, running block efficiency per drafter.

Shown only when stderr is a terminal; otherwise every method does nothing. The running
block efficiency of a drafter is its new tokens / blocks over every finished turn so far,
resumed records included.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class BenchProgress:
    def __init__(self, total: int, drafters: Iterable[str], done: Iterable[Mapping[str, Any]] = (),
                 enabled: bool = True, console: Console | None = None):
        self.drafters = list(drafters)
        self.tokens: dict[str, int] = defaultdict(int)
        self.blocks: dict[str, int] = defaultdict(int)
        for record in done:
            self._count(record)
        self._progress: Progress | None = None
        if enabled:
            self._progress = Progress(
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                TextColumn("ETA"), TimeRemainingColumn(), TextColumn("{task.fields[tau]}"),
                console=console or Console(stderr=True), transient=False,
            )
            self._task = self._progress.add_task("turns", total=total, tau=self._tau())

    def _count(self, record: Mapping[str, Any]) -> None:
        if "error" not in record:
            self.tokens[record["drafter"]] += record["new_tokens"]
            self.blocks[record["drafter"]] += record["blocks"]

    def _tau(self) -> str:
        parts = [f"{d} {self.tokens[d] / self.blocks[d]:.2f}" for d in self.drafters if self.blocks[d]]
        return ("τ " + "  ".join(parts)) if parts else ""

    def sample(self, sample_id: str, drafter: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, description=f"{sample_id} · {drafter}")

    def turn_done(self, record: Mapping[str, Any]) -> None:
        self._count(record)
        if self._progress is not None:
            self._progress.update(self._task, advance=1, tau=self._tau())

    def skip(self, turns: int) -> None:
        """Turns that will not run (their sample failed)."""
        if self._progress is not None and turns:
            self._progress.update(self._task, advance=turns)

    def __enter__(self) -> "BenchProgress":
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc_info) -> None:
        if self._progress is not None:
            self._progress.stop()
