"""The paper's Table 1 / Table 3 analogue on the shipped demo family, with issue 5's targets judged.

One run, on one machine, with the default (``demo``) profile:

1. ``mmspec profile-latency --batch 1,2,4 --seq 128,256 --gamma G`` caches the latency ratio
   c of this machine (one draft step with B rows / one target verification), so that the
   summary can give Eq. (1) beside the measured speedup.
2. ``mmspec bench demo-all --drafters ar,m,t,c,p,mt,tabed,tabed:mtcp --out DIR/demo-all.jsonl``
   (the command of issue 5), then ``mmspec bench --summarize ... --format json``.
3. The verdicts, from the summary alone:
   - ``m`` beats ``t`` in block efficiency τ on ``demo-single``;
   - ``t`` beats ``m`` on ``demo-story`` and on ``demo-followup``;
   - ``tabed`` is within 2% of the best single drafter (m, t, c, p) on every suite, and the
     best of all drafters on the average of the four suites' τ;
   - zero mismatches against ``ar`` at temperature 0;
   - the measured walltime speedup of ``tabed`` over ``ar`` on ``demo-single`` is above 1.0
     (reported beside c and Eq. (1)).

``demo-followup`` measures the follow-up turns: each conversation's first turn is given with
its reference answer (``Sample.history``), as TABED Table 1 reports second turns apart from
first turns. The ``all`` row of ``bench``'s own summary pools every turn; the average here is the plain
mean over the four suites, as the paper's "Avg." column is. The script exits 0 whatever it
measures; read the verdicts.

    python benchmarks/bench_demo_suites.py [--out DIR] [--gamma G]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

SUITES = ("demo-single", "demo-pair", "demo-story", "demo-followup")
DRAFTERS = ("ar", "m", "t", "c", "p", "mt", "tabed", "tabed:mtcp")
SINGLE = ("m", "t", "c", "p")


def mmspec(*args: str) -> str:
    """Run the installed ``mmspec`` console script (the user's entry point); its stdout."""
    script = Path(sys.executable).parent / "mmspec"
    done = subprocess.run([str(script), *args], capture_output=True, text=True)
    if done.returncode not in (0, 1):  # 1: bench found a mismatch or a failed sample; judged below
        raise SystemExit(f"mmspec {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()[-800:]}")
    return done.stdout


def machine() -> str:
    import torch

    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}")


def table(rows: list[dict], column: str) -> dict[str, dict[str, float | None]]:
    """suite -> drafter -> value of ``column``."""
    out: dict[str, dict[str, float | None]] = {}
    for r in rows:
        out.setdefault(r["category"], {})[r["drafter"]] = r[column]
    return out


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for the JSONL records (default: a temp dir)")
    parser.add_argument("--gamma", type=int, default=None, help="γ to profile (default: the demo profile's)")
    parser.add_argument("--judge-only", action="store_true",
                        help="skip the runs; summarize and judge the records already in --out")
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="mmspec-demo-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    records = out / "demo-all.jsonl"
    print(f"machine: {machine()}")

    from mmspec_cli.profiles import load_profile

    gamma = args.gamma or load_profile(None).decoding.gamma
    if not args.judge_only:
        mmspec("profile-latency", "--batch", "1,2,4", "--seq", "128,256", "--gamma", str(gamma), "--repeat", "30")
        if records.exists():
            records.unlink()
        gamma_flag = [] if args.gamma is None else ["--gamma", str(args.gamma)]
        mmspec("bench", "demo-all", "--drafters", ",".join(DRAFTERS), "--out", str(records), *gamma_flag)
    # --profile demo: the summary takes c from the latency cache of this device and the demo pair
    summary = json.loads(mmspec("bench", "--summarize", str(records), "--profile", "demo", "--format", "json"))
    rows = summary["rows"]
    tau, speedup, eq1 = table(rows, "block_efficiency"), table(rows, "speedup"), table(rows, "expected_speedup")

    print(f"\nblock efficiency τ (γ = {gamma}); Avg. = mean over the four suites")
    print(f"{'drafter':<12}" + "".join(f"{s:>15}" for s in SUITES) + f"{'Avg.':>10}")
    average = {}
    for d in DRAFTERS:
        values = [tau.get(s, {}).get(d) for s in SUITES]
        average[d] = sum(values) / len(values) if None not in values else None
        print(f"{d:<12}" + "".join(f"{fmt(v):>15}" for v in values) + f"{fmt(average[d]):>10}")
    print("\nmeasured walltime speedup over ar (Eq. (1) expected)")
    for d in DRAFTERS[1:]:
        print(f"{d:<12}" + "".join(f"{fmt(speedup.get(s, {}).get(d)) + ' (' + fmt(eq1.get(s, {}).get(d)) + ')':>15}"
                                   for s in SUITES))

    verdicts = []

    def judge(name: str, ok: bool, detail: str) -> None:
        verdicts.append(ok)
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}")

    print()
    s = tau["demo-single"]
    judge("m > t on demo-single", s["m"] > s["t"], f"m {s['m']:.3f}, t {s['t']:.3f}")
    for suite in ("demo-story", "demo-followup"):
        v = tau[suite]
        judge(f"t > m on {suite}", v["t"] > v["m"], f"t {v['t']:.3f}, m {v['m']:.3f}")
    for suite in SUITES:
        v = tau[suite]
        best = max(SINGLE, key=lambda d: v[d])
        judge(f"tabed within 2% of the best single drafter on {suite}", v["tabed"] >= 0.98 * v[best],
              f"tabed {v['tabed']:.3f}, best {best} {v[best]:.3f} ({v['tabed'] / v[best] - 1:+.1%})")
    best_avg = max((d for d in DRAFTERS if d != "ar"), key=lambda d: average[d])
    judge("tabed best on the average over suites", best_avg == "tabed" or average["tabed"] >= average[best_avg],
          ", ".join(f"{d} {average[d]:.3f}" for d in DRAFTERS[1:]))
    check = summary["token_check"]
    judge("zero mismatches against ar", check["ran"] and not check["mismatches"] and summary["failed"] == 0,
          f"{check['compared']} (sample, turn, drafter) outputs compared, {len(check['mismatches'])} differ, "
          f"{summary['failed']} failed")
    sp, e = speedup["demo-single"]["tabed"], eq1["demo-single"]["tabed"]
    judge("tabed walltime speedup over ar on demo-single > 1.0", sp is not None and sp > 1.0,
          f"measured {fmt(sp, 3)}, Eq. (1) expected {fmt(e, 3)}")
    print(f"\n{sum(verdicts)}/{len(verdicts)} targets met; records in {records}; machine: {machine()}")


if __name__ == "__main__":
    main()
