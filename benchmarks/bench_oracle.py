"""How much of the ideal speedup the engine delivers: the ``oracle`` drafter against its bound (issue 20).

``oracle`` replays ``ar``'s own output, so every draft is accepted and drafting costs nothing. A block
then emits γ + 1 tokens for ONE target forward over γ + 1 tokens, and the speedup over ``ar`` can be
at most

    bound(γ) = (γ + 1) · T_p(1, S, 1) / T_p(1, S, γ + 1)

with T_p from ``mmspec profile-latency`` (the target's forward of n tokens after S cached ones). The
measured speedup over the bound is the share of the ideal the engine delivers: what is missing is the
engine's own per-block work (Python, cache rollback, verification, bookkeeping), at this model size.

One run, the default (demo) profile, greedy, the first ``--limit`` samples of each demo suite:
``mmspec bench demo-all --drafters ar,oracle --gamma G`` for each γ (bench interleaves ``ar`` and
``oracle`` sample by sample, so both see the same load, and checks every output against ``ar``'s),
then the target's forward of 1 and γ + 1 tokens at S = 256 (a demo prompt with one image is about 100
tokens; answers add up to 160), timed with ``profile-latency``'s own code, the sizes interleaved over 7
rounds (one ``profile-latency`` run times each size once, and this machine is noisy). Prints the machine, ms per token, the measured speedup, the bound and their ratio.
The script exits 0 whatever it measures.

    python benchmarks/bench_oracle.py [--limit 5] [--gammas 1,3,5,7] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from bench_demo_suites import machine, mmspec

SEQ = 256


def run(gamma: int, limit: int, out: Path) -> dict:
    path = out / f"oracle-g{gamma}.jsonl"
    if path.exists():
        path.unlink()
    mmspec("bench", "demo-all", "--drafters", "ar,oracle", "--limit", str(limit), "--gamma", str(gamma),
           "--out", str(path))
    summary = json.loads(mmspec("bench", "--summarize", str(path), "--format", "json"))
    threads = {json.loads(line).get("threads") for line in path.read_text().splitlines()}
    check = summary["token_check"]
    rows = {r["drafter"]: r for r in summary["rows"] if r["category"] == "all"}
    return {"compared": check["compared"], "mismatches": len(check["mismatches"]), "failed": summary["failed"],
            "ar": rows["ar"], "oracle": rows["oracle"], "threads": sorted(threads, key=str)}


def forward_times(counts: list[int], threads: int, rounds: int = 7) -> dict[int, tuple[float, float, float]]:
    """T_p(1, SEQ, n) of the demo target for each n in ``counts``, in ms: the median of ``rounds`` medians
    (mmspec's own ``latency.step_latency_ms``, 20 repeats each), the sizes interleaved round by round so that every
    n sees the same load; with the smallest and largest round."""
    import torch

    from mmspec_cli.bench.latency import Timer, step_latency_ms
    from mmspec_cli.models.loading import load_model
    from mmspec_cli.models.profiles import load_profile

    torch.set_num_threads(threads)  # the count bench chose, so the bound and the runs match
    target = load_model(load_profile(None).target, "target").model
    timer = Timer(target.device, warmup=5, repeat=20)
    found: dict[int, list[float]] = {n: [] for n in counts}
    for _ in range(rounds):
        for n in counts:
            found[n].append(step_latency_ms(target, 1, SEQ, n, timer))
    return {n: (statistics.median(v), min(v), max(v)) for n, v in found.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=5, help="samples per demo suite")
    parser.add_argument("--gammas", default="1,3,5,7")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    gammas = [int(g) for g in args.gammas.split(",")]
    out = Path(args.out or tempfile.mkdtemp(prefix="mmspec-oracle-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"machine: {machine()}; first {args.limit} samples of each demo suite, greedy")
    results = {g: run(g, args.limit, out) for g in gammas}
    [threads] = results[gammas[0]]["threads"] or [1]
    times = forward_times(sorted({1, *(g + 1 for g in gammas)}), threads or 1)
    step = times[1][0]
    print(f"bench ran with {threads} thread(s); the target's forward at S={SEQ} with as many (median of 7 interleaved "
          f"rounds [min, max]): " + ", ".join(f"{n} token{'s' if n > 1 else ''} {m:.2f} [{lo:.2f}, {hi:.2f}] ms"
                                              for n, (m, lo, hi) in times.items()))
    print("\n γ | ar ms/token | oracle ms/token | τ | measured speedup | bound | measured / bound | turns checked")
    for g, r in results.items():
        ar, oracle = r["ar"], r["oracle"]
        bound = (g + 1) * step / times[g + 1][0]
        speedup = oracle["speedup"]
        print(f" {g} | {1000 / ar['tokens_per_s']:.2f} | {1000 / oracle['tokens_per_s']:.2f} | "
              f"{oracle['block_efficiency']:.2f} | {speedup:.2f}x | {bound:.2f}x | {speedup / bound:.2f} | "
              f"{r['compared']} ({r['mismatches']} mismatches, {r['failed']} failed)")
    print(f"\nrecords in {out}; machine: {machine()}")


if __name__ == "__main__":
    main()
