"""Trained draft heads (``eagle``, ``vispec``) against the demo family's drafters, chains and dynamic trees.

One run, on one machine, with the default (``demo``) profile, on the first ``--limit`` samples of
each demo suite, greedy:

- ``mmspec bench demo-all --drafters ar,m,t,tabed,eagle,vispec`` as chains (γ = 5), with dynamic
  trees at ViSpec's settings (budget 30, depth 3, top-k 8) and at EAGLE-2's (60, 5, 10). In each
  run ``bench`` interleaves the drafters sample by sample, so ``ar`` and every drafter see the
  same load; the measured speedup is ``bench``'s (``ar``'s wall time per token over the drafter's).
- ``mmspec profile-latency --json`` for the draft step of each drafter (T_q of the draft model,
  T_h of each head) and the target's verification T_p(1, S, n) of n = 6, 30, 60 nodes, giving
  Eq. (1), τ / (k·c + 1), with k the draft forwards per block (γ for a chain, depth + 1 for a
  dynamic tree) and c = T_draft(S) / T_p(1, S, nodes verified). The tree's draft levels feed
  top-k nodes in one forward; timing them as one-token steps makes Eq. (1) an upper bound there.

It prints τ per suite and on average, the measured speedup over ``ar``, Eq. (1), the token check
(every output compared with ``ar``'s), and each target of the issue as met or missed, by how much.
The script exits 0 whatever it measures.

    python benchmarks/bench_heads.py [--limit 10] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from bench_demo_suites import SUITES, fmt, machine, mmspec

DRAFTERS = ("m", "t", "tabed", "eagle", "vispec")
HEADS = ("eagle", "vispec")
SETTINGS = {
    "chain": [],
    "dynamic 30/3/8": ["--tree", "dynamic", "--tree-budget", "30", "--tree-depth", "3", "--tree-topk", "8"],
    "dynamic 60/5/10": ["--tree", "dynamic", "--tree-budget", "60", "--tree-depth", "5", "--tree-topk", "10"],
}
GAMMA = 5
SEQ = 256  # a demo prompt with one image is about 100 tokens, and answers add up to 160


def draft_forwards(setting: str) -> int:
    """Draft forwards per block: γ for a chain, depth + 1 for a dynamic tree (the root, then each level)."""
    return GAMMA if setting == "chain" else int(setting.split("/")[1]) + 1


def verified_nodes(setting: str) -> int:
    """Tokens the target verifies per block: γ + 1 for a chain, the tree's budget (root included)."""
    return GAMMA + 1 if setting == "chain" else int(setting.split()[1].split("/")[0])


def latencies() -> dict:
    gammas = sorted({verified_nodes(s) for s in SETTINGS})
    return json.loads(mmspec("profile-latency", "--seq", str(SEQ), "--batch", "1,2", "--gammas",
                             ",".join(map(str, gammas)), "--repeat", "20", "--json"))


def eq1(tau: float, drafter: str, setting: str, timings: dict) -> float:
    rows = 2 if drafter == "tabed" else 1  # tabed drafts its two members as two rows of one forward
    step = timings["head_ms"][drafter][str(SEQ)] if drafter in HEADS else timings["draft_ms"][f"{rows},{SEQ}"]
    c = step / timings["target_ms"][f"{SEQ},{verified_nodes(setting)}"]
    return tau / (draft_forwards(setting) * c + 1)


def run(setting: str, limit: int, out: Path) -> dict:
    path = out / f"heads-{setting.replace(' ', '-').replace('/', '-')}.jsonl"
    if path.exists():
        path.unlink()
    mmspec("bench", "demo-all", "--drafters", "ar," + ",".join(DRAFTERS), "--limit", str(limit),
           "--gamma", str(GAMMA), "--out", str(path), *SETTINGS[setting])
    summary = json.loads(mmspec("bench", "--summarize", str(path), "--format", "json"))
    check = summary["token_check"]
    print(f"  {setting}: {check['compared']} turns compared with ar, {check['mismatches']} mismatches, "
          f"{summary['failed']} failed")
    return {(r["category"], r["drafter"]): r for r in summary["rows"]}


def mean(values) -> float:
    return statistics.fmean(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=10, help="samples per suite")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="mmspec-heads-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"machine: {machine()}; first {args.limit} samples of each suite, greedy")
    timings = latencies()
    print(f"draft step at S={SEQ}: draft model {timings['draft_ms'][f'1,{SEQ}']:.2f} ms, "
          + ", ".join(f"{k} head {timings['head_ms'][k][str(SEQ)]:.2f} ms" for k in HEADS)
          + "; target verification " + ", ".join(f"{n} nodes {timings['target_ms'][f'{SEQ},{n}']:.2f} ms"
                                                for n in sorted({verified_nodes(s) for s in SETTINGS})))
    rows = {setting: run(setting, args.limit, out) for setting in SETTINGS}

    tau = {(s, d): [rows[s][(suite, d)]["block_efficiency"] for suite in SUITES] for s in SETTINGS for d in DRAFTERS}
    speed = {(s, d): [rows[s][(suite, d)]["speedup"] for suite in SUITES] for s in SETTINGS for d in DRAFTERS}
    print("\nτ (block efficiency, bonus token included) per suite and mean: "
          + " / ".join(s.replace("demo-", "") for s in SUITES))
    for s in SETTINGS:
        for d in DRAFTERS:
            print(f"  {s:<16} {d:<7} " + " ".join(f"{v:6.3f}" for v in tau[(s, d)]) + f"   mean {mean(tau[(s, d)]):.3f}")
    print("\nmeasured walltime speedup over ar (same run) per suite and mean; Eq. (1) on the mean τ")
    for s in SETTINGS:
        for d in DRAFTERS:
            print(f"  {s:<16} {d:<7} " + " ".join(f"{v:5.2f}x" for v in speed[(s, d)])
                  + f"   mean {mean(speed[(s, d)]):.2f}x   Eq.(1) {eq1(mean(tau[(s, d)]), d, s, timings):.2f}x")

    print("\ntargets:")
    trees = [s for s in SETTINGS if s != "chain"]
    for s in trees:
        for i, suite in enumerate(SUITES):
            best = max((d for d in DRAFTERS if d != "vispec"), key=lambda d: tau[(s, d)][i])
            gap = tau[(s, "vispec")][i] - tau[(s, best)][i]
            print(f"  vispec highest τ, {s}, {suite}: {'met' if gap > 0 else 'MISSED'} "
                  f"(vispec {tau[(s, 'vispec')][i]:.3f}, best other {best} {tau[(s, best)][i]:.3f})")
    better = max(trees, key=lambda s: mean(tau[(s, "vispec")]))
    ratio = mean(tau[(better, "vispec")]) / mean(tau[("chain", "tabed")])
    print(f"  vispec ({better}) τ over tabed's chain τ: {ratio:.3f}x, target 1.25x: {'met' if ratio >= 1.25 else 'MISSED'}")
    for s in SETTINGS:  # every demo suite has images (1, 2, 5 and 1 per sample)
        wins = [tau[(s, "vispec")][i] > tau[(s, "eagle")][i] for i in range(len(SUITES))]
        print(f"  vispec beats eagle, {s}: {sum(wins)}/{len(wins)} suites ("
              + ", ".join(f"{tau[(s, 'vispec')][i]:.3f} vs {tau[(s, 'eagle')][i]:.3f}" for i in range(len(SUITES)))
              + ")")
    fastest = max(SETTINGS, key=lambda s: mean(speed[(s, "vispec")]))
    single = {d: max(speed[(s, d)][0] for s in SETTINGS) for d in DRAFTERS}
    average = {d: max(mean(speed[(s, d)]) for s in SETTINGS) for d in DRAFTERS}
    print(f"  vispec fastest setting: {fastest}; best speedup per drafter on demo-single: "
          + ", ".join(f"{d} {v:.2f}x" for d, v in single.items()))
    print(f"  vispec best on demo-single: {'met' if max(single, key=single.get) == 'vispec' else 'MISSED'}; "
          f"on the mean: {'met' if max(average, key=average.get) == 'vispec' else 'MISSED'} "
          f"({', '.join(f'{d} {v:.2f}x' for d, v in average.items())}); "
          f"≥ 1.5x on demo-single: {'met' if single['vispec'] >= 1.5 else 'MISSED'} ({single['vispec']:.2f}x)")
    print(f"\nrecords in {out}; machine: {machine()}")


if __name__ == "__main__":
    main()
