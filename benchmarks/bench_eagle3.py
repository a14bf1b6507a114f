"""EAGLE-3's head against EAGLE-2's and ViSpec's on the demo family: τ and speed, chains and dynamic trees, eager and
compiled, the three heads trained on the same answers with the same steps (``scripts/train_demo_heads.py``).

One run, on one machine, with the ``demo`` profile (its heads ``mmspec:demo-eagle``, ``mmspec:demo-vispec`` and
``mmspec:demo-eagle3``), greedy, on the first ``--limit`` samples of each demo suite:
``mmspec bench demo-all --drafters ar,eagle,vispec,eagle3`` as chains (γ = 5) and as dynamic trees at EAGLE-2's
settings (budget 60, depth 5, top-k 10), eager and with ``--compile``. ``bench`` interleaves the drafters sample by
sample, so ``ar`` and each head see the same load; the speedup is ``bench``'s (``ar``'s wall time per token over the
drafter's, measured side by side), and ms/token is the drafter's wall time per generated token. Every output is
compared with ``ar``'s (the token check).

    python benchmarks/bench_eagle3.py [--limit 5] [--modes eager,compiled] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from bench_demo_suites import SUITES, machine, mmspec

HEADS = ("eagle", "vispec", "eagle3")
SETTINGS = {
    "chain": [],
    "dynamic 60/5/10": ["--tree", "dynamic", "--tree-budget", "60", "--tree-depth", "5", "--tree-topk", "10"],
}
GAMMA = 5


def run(setting: str, mode: str, limit: int, out: Path) -> dict:
    path = out / f"eagle3-{mode}-{setting.split()[0]}.jsonl"
    if path.exists():
        path.unlink()
    mmspec("bench", "demo-all", "--drafters", "ar," + ",".join(HEADS), "--limit", str(limit), "--gamma", str(GAMMA),
           "--out", str(path), *SETTINGS[setting], *(["--compile"] if mode == "compiled" else []))
    summary = json.loads(mmspec("bench", "--summarize", str(path), "--format", "json"))
    check = summary["token_check"]
    print(f"  {mode} {setting}: {check['compared']} turns compared with ar, {check['mismatches']} mismatches, "
          f"{summary['failed']} failed", flush=True)
    return {(r["category"], r["drafter"]): r for r in summary["rows"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=5, help="samples per suite")
    parser.add_argument("--modes", default="eager,compiled")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="mmspec-eagle3-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"machine: {machine()}; first {args.limit} samples of each suite, greedy", flush=True)
    modes = args.modes.split(",")
    rows = {(mode, s): run(s, mode, args.limit, out) for mode in modes for s in SETTINGS}
    print("\nτ per suite (" + " / ".join(s.replace("demo-", "") for s in SUITES) + "), mean; ms/token (mean over "
          "suites); speedup over ar (mean)")
    for mode in modes:
        for s in SETTINGS:
            found = rows[(mode, s)]
            for d in ("ar",) + HEADS:
                tau = [found[(suite, d)]["block_efficiency"] for suite in SUITES]
                ms = [1000.0 / found[(suite, d)]["tokens_per_s"] for suite in SUITES]
                speed = [found[(suite, d)]["speedup"] or 1.0 for suite in SUITES]
                print(f"  {mode:8} {s:16} {d:7} " + " ".join(f"{v:6.3f}" for v in tau)
                      + f"   τ {statistics.fmean(tau):.3f}   {statistics.fmean(ms):6.2f} ms/token"
                      + f"   {statistics.fmean(speed):.2f}x")


if __name__ == "__main__":
    main()
