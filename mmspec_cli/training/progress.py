"""Progress of ``train-head`` on stderr: a rich bar with ETA on a terminal, a few plain lines elsewhere.

One bar per phase (answering the prompts, training). The training bar shows the loss and the
top-1 agreement with the target of the first and last pass, averaged over the last steps. Off a
terminal (a log file, a CI job) a line is printed every tenth of the phase instead, at most one per
:data:`QUIET_S` seconds (a short phase prints none).
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable

from rich.console import Console
from rich.progress import Progress

from mmspec_cli.bench.progress import bar_columns

QUIET_S = 30.0


class Phase:
    """A counted phase: ``advance(n)``; ``note(text)`` sets the text after the bar."""

    def __init__(self, name: str, total: int, done: int = 0, enabled: bool | None = None,
                 log: Callable[[str], None] | None = None):
        self.name, self.total, self.done = name, total, done
        self.text = ""
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.start = self.last_line = time.perf_counter()
        self.start_done = done
        self.next_line = done + max(1, total // 10)
        enabled = sys.stderr.isatty() if enabled is None else enabled
        self._progress: Progress | None = None
        if enabled:
            self._progress = Progress(*bar_columns("{task.fields[text]}"), console=Console(stderr=True))
            self._task = self._progress.add_task(name, total=total, completed=done, text="")

    def advance(self, n: int = 1) -> None:
        self.done += n
        if self._progress is not None:
            self._progress.update(self._task, advance=n, text=self.text)
        elif (self.done >= self.next_line or self.done == self.total) and time.perf_counter() - self.last_line >= QUIET_S:
            self.next_line = self.done + max(1, self.total // 10)
            self.last_line = time.perf_counter()
            elapsed = self.last_line - self.start
            rate = (self.done - self.start_done) / elapsed if elapsed > 0 else 0.0
            eta = (self.total - self.done) / rate if rate > 0 else 0.0
            self.log(f"{self.name}: {self.done}/{self.total}, {elapsed:.0f} s, ETA {eta:.0f} s  {self.text}".rstrip())

    def note(self, text: str) -> None:
        self.text = text

    def __enter__(self) -> "Phase":
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc_info) -> None:
        if self._progress is not None:
            self._progress.stop()


class TrainingNotes:
    """The running loss and top-1 agreement (first and last pass) over the last ``window`` steps."""

    def __init__(self, window: int = 20):
        self.rows: deque = deque(maxlen=window)

    def add(self, stats: list[dict]) -> str:
        if stats:
            self.rows.append((stats[0]["loss"], stats[0]["top1"], stats[-1]["loss"], stats[-1]["top1"], len(stats)))
        if not self.rows:
            return ""
        n = len(self.rows)
        first_loss, first_top1, last_loss, last_top1 = (sum(r[i] for r in self.rows) / n for i in range(4))
        passes = self.rows[-1][4]
        text = f"loss {first_loss:.3f} top-1 {first_top1:.3f}"
        if passes > 1:
            text += f" | pass {passes}: loss {last_loss:.3f} top-1 {last_top1:.3f}"
        return text
