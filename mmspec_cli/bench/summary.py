"""The summary of a benchmark, computed from the records alone (pure functions, no models).

Per category x drafter (and an ``all`` row per drafter):

- **block efficiency**: mean ± std over samples. A sample's value is the total new tokens of
  its turns / their total blocks (a turn-weighted ratio: a long answer counts more than a
  short one, as it does in decoding time). std is the sample standard deviation (n - 1),
  0 for a single sample.
- **acceptance rate**: accepted / drafted draft tokens over all the group's turns (None for
  ``ar`` and ``hf-assisted``, which report no drafts).
- **tokens/s**: new tokens / wall seconds over all the group's turns.
- **speedup**: measured walltime speedup over ``ar`` = AR seconds per token / the drafter's
  seconds per token, both over the (sample, turn) pairs that both ran (None without ``ar``).
- **expected speedup**: TABED Eq. (1), τ / (γ·c + 1), with the mean block efficiency τ, the
  records' γ and the latency ratio c of the drafter when one is given (a cached measurement of
  the drafter's own draft step: ``latency_ratio`` in the row, and which step it was in
  :attr:`Summary.latency`).

A (sample, drafter) pair with an error record is left out of its drafter's numbers and
counted under ``failed``. At temperature 0, every drafter's token ids must equal ``ar``'s for
the same (sample, turn): :func:`token_check` counts the pairs that differ.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from mmspec_cli.decoding.metrics import expected_speedup

ALL = "all"
BASELINE = "ar"
Record = Mapping[str, Any]


@dataclass(frozen=True)
class Row:
    category: str
    drafter: str
    samples: int
    block_efficiency: float | None
    block_efficiency_std: float | None
    acceptance_rate: float | None
    tokens_per_s: float | None
    speedup: float | None
    expected_speedup: float | None
    failed: int = 0
    latency_ratio: float | None = None  # the c of Eq. (1) (None: no Eq. (1) for this drafter)


@dataclass(frozen=True)
class TokenCheck:
    ran: bool
    reason: str  # why it did not run ("" when it ran)
    compared: int = 0
    mismatches: list[tuple[str, int, str]] = field(default_factory=list)  # (id, turn, drafter)


@dataclass(frozen=True)
class Summary:
    rows: list[Row]
    check: TokenCheck
    failed: int
    errors: list[tuple[str, str, str]] = field(default_factory=list)  # (id, drafter, message)
    latency: dict[str, dict[str, Any]] = field(default_factory=dict)  # drafter -> {"c": ratio, "step": which step}

    @property
    def ok(self) -> bool:
        return self.failed == 0 and not self.check.mismatches

    def as_dict(self) -> dict:
        check = asdict(self.check)
        check["mismatches"] = [{"id": i, "turn": t, "drafter": d} for i, t, d in self.check.mismatches]
        return {"rows": [asdict(r) for r in self.rows], "token_check": check, "failed": self.failed,
                "errors": [{"id": i, "drafter": d, "error": e} for i, d, e in self.errors],
                "latency_ratios": self.latency}


# --------------------------------------------------------------------------- helpers


def ordered(values: Iterable[str]) -> list[str]:
    """Distinct values in order of first appearance."""
    return list(dict.fromkeys(values))


def sample_block_efficiency(turns: Sequence[Record]) -> float:
    """One sample's block efficiency: total new tokens / total blocks over its turns."""
    blocks = sum(r["blocks"] for r in turns)
    return sum(r["new_tokens"] for r in turns) / blocks if blocks else 0.0


def mean_std(values: Sequence[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def seconds_per_token(turns: Iterable[Record]) -> float | None:
    turns = list(turns)
    tokens = sum(r["new_tokens"] for r in turns)
    return sum(r["wall_s"] for r in turns) / tokens if tokens else None


def split_records(records: Iterable[Record]) -> tuple[list[Record], list[Record]]:
    """(turn records of pairs that did not fail, error records)."""
    records = list(records)
    errors = [r for r in records if "error" in r]
    failed = {(r["id"], r["drafter"]) for r in errors}
    return [r for r in records if "error" not in r and (r["id"], r["drafter"]) not in failed], errors


# --------------------------------------------------------------------------- the numbers


def group_row(category: str, drafter: str, turns: Sequence[Record], baseline: Sequence[Record],
              latency_ratio: float | None, failed: int = 0) -> Row:
    """The summary row of one drafter's turn records (``baseline``: ``ar``'s records of the same group)."""
    by_sample: dict[str, list[Record]] = defaultdict(list)
    for r in turns:
        by_sample[r["id"]].append(r)
    tau, tau_std = mean_std([sample_block_efficiency(t) for t in by_sample.values()])
    drafted = sum(r.get("drafted") or 0 for r in turns)
    accepted = sum(r.get("accepted") or 0 for r in turns)
    wall = sum(r["wall_s"] for r in turns)
    tokens_per_s = sum(r["new_tokens"] for r in turns) / wall if wall > 0 else None
    return Row(category=category, drafter=drafter, samples=len(by_sample), block_efficiency=tau,
               block_efficiency_std=tau_std, acceptance_rate=accepted / drafted if drafted else None,
               tokens_per_s=tokens_per_s, speedup=measured_speedup(baseline, turns),
               expected_speedup=eq1(tau, turns, latency_ratio), failed=failed,
               latency_ratio=latency_ratio if turns else None)


def measured_speedup(baseline: Sequence[Record], turns: Sequence[Record]) -> float | None:
    """AR seconds per token / drafter seconds per token over the (id, turn) pairs both have."""
    if not baseline:
        return None
    ar = {(r["id"], r["turn"]): r for r in baseline}
    common = [r for r in turns if (r["id"], r["turn"]) in ar]
    ar_spt = seconds_per_token(ar[(r["id"], r["turn"])] for r in common)
    spt = seconds_per_token(common)
    return ar_spt / spt if ar_spt and spt else None


def eq1(tau: float | None, turns: Sequence[Record], latency_ratio: float | None) -> float | None:
    if tau is None or latency_ratio is None or not turns or turns[0].get("gamma") is None:
        return None
    return expected_speedup(tau, int(turns[0]["gamma"]), latency_ratio)


def token_check(records: Iterable[Record], baseline: str = BASELINE) -> TokenCheck:
    """At temperature 0, each drafter's token ids against ``ar``'s for the same (sample, turn)."""
    records = [r for r in records if "error" not in r]
    if not any(r["drafter"] == baseline for r in records):
        return TokenCheck(False, f"{baseline} was not among the drafters")
    greedy = [r for r in records if r.get("temperature") == 0]
    reference = {(r["id"], r["turn"]): r["token_ids"] for r in greedy if r["drafter"] == baseline}
    pairs = [r for r in greedy if r["drafter"] != baseline and (r["id"], r["turn"]) in reference]
    if not pairs:
        reason = "temperature > 0: sampled outputs differ by design" if not greedy else "no other drafter shares a turn with ar"
        return TokenCheck(False, reason)
    mismatches = [(r["id"], r["turn"], r["drafter"]) for r in pairs if r["token_ids"] != reference[(r["id"], r["turn"])]]
    return TokenCheck(True, "", compared=len(pairs), mismatches=mismatches)


def summarize(records: Iterable[Record], latency_ratios: Mapping[str, float] | None = None,
              latency_steps: Mapping[str, str] | None = None) -> Summary:
    """The whole summary: rows per category x drafter plus ``all`` rows, the token check, failures.

    ``latency_ratios``: c of Eq. (1) per drafter; ``latency_steps``: which draft step each c measured (words)."""
    records = list(records)
    turns, errors = split_records(records)
    ratios = latency_ratios or {}
    drafters = ordered(r["drafter"] for r in records)
    categories = ordered(r["category"] for r in records)
    failed_pairs = {(r["category"], r["drafter"], r["id"]) for r in errors}
    rows = []
    for category in [*categories, ALL]:
        group = [r for r in turns if category == ALL or r["category"] == category]
        baseline = [r for r in group if r["drafter"] == BASELINE]
        for drafter in drafters:
            mine = [r for r in group if r["drafter"] == drafter]
            failed = sum(1 for c, d, _ in failed_pairs if d == drafter and (category == ALL or c == category))
            if mine or failed:
                rows.append(group_row(category, drafter, mine, baseline, ratios.get(drafter), failed))
    steps = latency_steps or {}
    latency = {d: {"c": ratios[d], "step": steps.get(d)} for d in drafters if d in ratios}
    return Summary(rows=rows, check=token_check(records), failed=len({(i, d) for _, d, i in failed_pairs}),
                   errors=[(r["id"], r["drafter"], r["error"]) for r in errors], latency=latency)


# --------------------------------------------------------------------------- ranking (best bold, second underlined)

RANKED = ("block_efficiency", "acceptance_rate", "tokens_per_s", "speedup", "expected_speedup")


def ranks(rows: Sequence[Row], column: str) -> list[int | None]:
    """Per row: 1 for the best value of ``column`` among ``rows``, 2 for the second best, else None.
    Higher is better for every ranked column; equal values share a rank; missing values get none."""
    values = sorted({getattr(r, column) for r in rows if getattr(r, column) is not None}, reverse=True)
    top = {v: i + 1 for i, v in enumerate(values[:2])}
    return [top.get(getattr(r, column)) for r in rows]


def mean_prompt_tokens(records: Iterable[Record]) -> int | None:
    """The mean prompt length over the turn records that know it (for the latency ratio's S)."""
    lengths = [r["prompt_tokens"] for r in records if "error" not in r and r.get("prompt_tokens")]
    return round(statistics.fmean(lengths)) if lengths else None
