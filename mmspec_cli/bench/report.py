"""The summary for people (a rich table per category, as in the paper's tables) and for scripts (JSON, CSV)."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence

from rich.table import Table
from rich.text import Text

from mmspec_cli.bench.summary import RANKED, Row, Summary, ranks

FORMATS = ("table", "json", "csv")
BEST, SECOND = "bold", "underline"
CSV_COLUMNS = ("category", "drafter", "samples", "block_efficiency", "block_efficiency_std", "acceptance_rate",
               "tokens_per_s", "speedup", "expected_speedup", "failed", "latency_ratio")


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``1 record``, ``2 records``: a count with its noun in the right number (``plural`` if not noun + s)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def _num(value: float | None, digits: int = 2, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


def _cells(row: Row) -> dict[str, str]:
    tau = "-" if row.block_efficiency is None else f"{row.block_efficiency:.2f} ± {row.block_efficiency_std:.2f}"
    return {"block_efficiency": tau, "acceptance_rate": _num(row.acceptance_rate),
            "tokens_per_s": _num(row.tokens_per_s, 1), "speedup": _num(row.speedup, 2, "x"),
            "expected_speedup": _num(row.expected_speedup, 2, "x")}


def table(summary: Summary) -> Table:
    """One section per category (then ``all``); per column the best value bold, the second underlined."""
    t = Table(title="mmspec bench", title_justify="left", header_style="bold")
    for name, justify in (("category", "left"), ("drafter", "left"), ("samples", "right"), ("block eff. τ", "right"),
                          ("accept", "right"), ("tokens/s", "right"), ("speedup vs ar", "right"),
                          ("Eq. 1 speedup", "right"), ("failed", "right")):
        t.add_column(name, justify=justify, no_wrap=True)
    categories = list(dict.fromkeys(r.category for r in summary.rows))
    for n, category in enumerate(categories):
        rows = [r for r in summary.rows if r.category == category]
        marks = {column: ranks(rows, column) for column in RANKED}
        for i, row in enumerate(rows):
            cells = _cells(row)
            styled = [Text(cells[c], style={1: BEST, 2: SECOND}.get(marks[c][i]) or "") for c in RANKED]
            t.add_row(category if i == 0 else "", row.drafter, str(row.samples), *styled,
                      str(row.failed) if row.failed else "", end_section=i == len(rows) - 1 and n < len(categories) - 1)
    return t


def check_line(summary: Summary) -> str:
    check = summary.check
    if not check.ran:
        return f"token check against ar: not run ({check.reason})"
    shown = ", ".join(f"{i} turn {t} {d}" for i, t, d in check.mismatches[:5])
    more = f" (first: {shown})" if check.mismatches else ""
    return (f"token check against ar at temperature 0: {counted(check.compared, 'turn')} compared, "
            f"{counted(len(check.mismatches), 'mismatch', 'mismatches')}{more}")


def failure_line(summary: Summary) -> str | None:
    if not summary.failed:
        return None
    first_id, drafter, message = summary.errors[0]
    return f"{counted(summary.failed, '(sample, drafter) pair')} failed; first: {first_id} {drafter}: {message}"


def ratio_line(summary: Summary) -> str | None:
    """Which latency ratio c each drafter's Eq. (1) used: its own draft step over one verification."""
    if not summary.latency:
        return None
    parts = [f"{d} {v['c']:.3f} ({v['step']})" if v.get("step") else f"{d} {v['c']:.3f}"
             for d, v in summary.latency.items()]
    return "Eq. (1) latency ratio c = draft step / verification, per drafter: " + "; ".join(parts)


def as_json(summary: Summary) -> str:
    return json.dumps(summary.as_dict())


def as_csv(rows: Sequence[Row]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for row in rows:
        writer.writerow(["" if getattr(row, c) is None else getattr(row, c) for c in CSV_COLUMNS])
    return out.getvalue()
