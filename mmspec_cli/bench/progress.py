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
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, ProgressColumn, Task, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)
from rich.table import Column
from rich.text import Text


class ShrinkingText(TextColumn):
    """Text that gives way on a narrow terminal: cut with "…" rather than pushing the numbers out of the line.

    Its table column may shrink (rich's tables shrink only such columns before cutting every column alike),
    and the text stays on one line. Not markup: a sample id such as ``q[3]`` is shown as it is.
    """

    def __init__(self, text_format: str):
        super().__init__(text_format, markup=False, table_column=Column(no_wrap=False, overflow="ellipsis"))

    def render(self, task: Task) -> Text:
        return Text(self.text_format.format(task=task), no_wrap=True, overflow="ellipsis")


def bar_columns(note: str) -> list[ProgressColumn]:
    """The columns of mmspec's progress bars (``bench``, ``train-head``): what is running, the bar, the count,
    the elapsed time, the ETA, then ``note`` (a format of the task's fields, e.g. ``{task.fields[tau]}``).

    On a narrow terminal the description, the bar and the note shrink, the widest first; the count, the elapsed
    time and the ETA keep their width (readable at 60 columns and more).
    """
    def fixed() -> Column:  # rich's own columns would shrink with the rest (their default column may wrap)
        return Column(no_wrap=True)

    return [ShrinkingText("{task.description}"), BarColumn(table_column=Column(no_wrap=False)),
            MofNCompleteColumn(table_column=fixed()), TimeElapsedColumn(table_column=fixed()), TextColumn("ETA"),
            TimeRemainingColumn(table_column=fixed()), ShrinkingText(note)]


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
            self._progress = Progress(*bar_columns("{task.fields[tau]}"), console=console or Console(stderr=True),
                                      transient=False)
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
            self._progress.update(self._task, description=f"{drafter} · {sample_id}")  # the drafter first: long ids are cut

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
