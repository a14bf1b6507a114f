"""Token-tree widths (TABED Table 2 analogue) and draft-length schedules on the shipped demo family.

One run, on one machine, with the default (``demo``) profile, on the first ``--limit`` samples
of each demo suite:

1. **tree widths**: ``mmspec bench SUITE --drafters ar,m,t,tabed --tree-width d`` for d = 1, 2, 3.
   Reports block efficiency τ per suite and drafter, the mean over suites, and the measured
   walltime speedup over ``ar`` of the same run.
2. **schedules**: ``mmspec bench SUITE --drafters ar,m,tabed --gamma-schedule s`` for s =
   constant, heuristic, fastvlm. Reports τ, ms per token and the speedup over ``ar``.

Every run's outputs are checked against ``ar`` by ``bench`` itself (temperature 0); a
mismatch is printed. A schedule or width that loses everywhere stays in the table, marked so.
The script exits 0 whatever it measures.

    python benchmarks/bench_trees_schedules.py [--limit 10] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from bench_demo_suites import SUITES, fmt, machine, mmspec

WIDTHS = (1, 2, 3)
SCHEDULES = ("constant", "heuristic", "fastvlm")


def run(suite: str, drafters: str, flags: list[str], limit: int, out: Path) -> list[dict]:
    """One bench run; the summary rows of ``suite``, after checking the token check."""
    path = out / f"{suite}-{'-'.join(f.strip('-') for f in flags)}.jsonl"
    if path.exists():
        path.unlink()
    mmspec("bench", suite, "--drafters", drafters, "--limit", str(limit), "--out", str(path), *flags)
    summary = json.loads(mmspec("bench", "--summarize", str(path), "--format", "json"))
    check = summary["token_check"]
    if check["mismatches"] or summary["failed"]:
        print(f"  MISMATCH or failure in {path}: {check['mismatches']} {summary['errors']}")
    return [r for r in summary["rows"] if r["category"] == suite]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=10, help="samples per suite")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="mmspec-trees-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"machine: {machine()}; first {args.limit} samples of each suite")

    print("\ntoken trees: block efficiency τ per suite (speedup over ar)")
    drafters = ("m", "t", "tabed")
    tau: dict[tuple[int, str], list[float]] = {}
    for width in WIDTHS:
        for suite in SUITES:
            rows = {r["drafter"]: r for r in run(suite, "ar," + ",".join(drafters), ["--tree-width", str(width)],
                                                 args.limit, out)}
            print(f"d={width} {suite:<14}" + "".join(
                f"  {d} {fmt(rows[d]['block_efficiency'])} ({fmt(rows[d]['speedup'])}x)" for d in drafters))
            for d in drafters:
                tau.setdefault((width, d), []).append(rows[d]["block_efficiency"])
    print("mean τ over suites:")
    for d in drafters:
        print(f"  {d:<6}" + "".join(f"  d={w}: {statistics.fmean(tau[(w, d)]):.3f}" for w in WIDTHS))

    print("\ndraft-length schedules: τ, ms/token, speedup over ar (mean over suites)")
    drafters = ("m", "tabed")
    results: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    for schedule in SCHEDULES:
        for suite in SUITES:
            rows = {r["drafter"]: r for r in run(suite, "ar," + ",".join(drafters), ["--gamma-schedule", schedule],
                                                 args.limit, out)}
            for d in drafters:
                r = rows[d]
                results.setdefault((schedule, d), []).append(
                    (r["block_efficiency"], 1000 / r["tokens_per_s"], r["speedup"]))
    for d in drafters:
        for schedule in SCHEDULES:
            values = results[(schedule, d)]
            mean = [statistics.fmean(v[i] for v in values) for i in range(3)]
            print(f"  {d:<6} {schedule:<10} τ {mean[0]:.3f}  {mean[1]:.2f} ms/token  speedup {mean[2]:.3f}x  "
                  f"(per suite: {', '.join(f'{v[2]:.2f}x' for v in values)})")
    print(f"\nrecords in {out}; machine: {machine()}")


if __name__ == "__main__":
    main()
