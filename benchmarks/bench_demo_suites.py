"""The paper's Table 1 / Table 3 analogue on the shipped demo family, with issue 5's targets judged.

One run, on one machine, with the default (``demo``) profile:

1. ``mmspec profile-latency --batch 1,2,4 --seq 128,256 --gammas G`` caches the latency ratio
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
measures; read the verdicts. Beside each verdict it prints the paired bootstrap 95%
interval of the difference it rests on (resampling samples, 10,000 replicates, fixed seed),
and says when that interval holds 0.

    python benchmarks/bench_demo_suites.py [--out DIR] [--gamma G] [--samples N]
    python benchmarks/bench_demo_suites.py --out DIR --judge-only [--first N]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
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

    gpu = f"{torch.cuda.get_device_name(0)}, " if torch.cuda.is_available() else ""
    return (f"{gpu}{platform.processor() or platform.machine()}{cpu_model()}, {os.cpu_count()} CPUs, torch "
            f"{torch.__version__}, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}")


def cpu_model() -> str:
    """`` (MODEL, AVX-512)`` from /proc/cpuinfo where Linux has it (the model name, and whether the cores have
    AVX-512, which decides how fast small matrix products run), else empty."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    wide = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else ""
    return f" ({', '.join(part for part in (name, wide) if part)})" if name or wide else ""


def table(rows: list[dict], column: str) -> dict[str, dict[str, float | None]]:
    """suite -> drafter -> value of ``column``."""
    out: dict[str, dict[str, float | None]] = {}
    for r in rows:
        out.setdefault(r["category"], {})[r["drafter"]] = r[column]
    return out


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def suites_manifest(n: int, folder: Path) -> Path:
    """The first ``n`` samples of every demo suite as a ``bench`` manifest (PNG images, history)."""
    from mmspec_cli.inputs.sources import demo_suite

    (folder / "images").mkdir(parents=True, exist_ok=True)
    lines = []
    for suite in SUITES:
        for sample in demo_suite(suite, n):
            images = []
            for k, image in enumerate(sample.images):
                images.append(f"images/{sample.id}-{k}.png")
                image.save(folder / images[-1])
            lines.append(json.dumps({"id": sample.id, "category": suite, "images": images, "turns": list(sample.turns),
                                     "history": [list(turn) for turn in sample.history]}))
    path = folder / "manifest.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def first_samples(records: Path, n: int, dest: Path) -> Path:
    """Copy to ``dest`` the records of the first ``n`` samples of each suite (suites list their
    samples in seed order, and ids end in the seed)."""
    from mmspec_cli.bench.records import read_records

    rows = read_records([records])
    seeds: dict[str, set[int]] = {}
    for r in rows:
        seeds.setdefault(r["category"], set()).add(int(r["id"].rsplit("-", 1)[1]))
    kept = {c: set(sorted(v)[:n]) for c, v in seeds.items()}
    dest.write_text("".join(json.dumps(r) + "\n" for r in rows if int(r["id"].rsplit("-", 1)[1]) in kept[r["category"]]))
    return dest


def per_sample(records: Path) -> dict[tuple[str, str], dict[str, float]]:
    """(suite, drafter) -> sample id -> τ of that sample, as ``bench``'s summary computes it
    (failed (sample, drafter) pairs left out)."""
    from mmspec_cli.bench.records import read_records
    from mmspec_cli.bench.summary import sample_block_efficiency, split_records

    turns, _ = split_records(read_records([records]))
    grouped: dict[tuple[str, str], dict[str, list[dict]]] = {}
    for r in turns:
        grouped.setdefault((r["category"], r["drafter"]), {}).setdefault(r["id"], []).append(r)
    return {k: {i: sample_block_efficiency(rs) for i, rs in v.items()} for k, v in grouped.items()}


def paired_interval(pairs: list[tuple[dict[str, float], dict[str, float]]], scale: float = 1.0, reps: int = 10000,
                    seed: int = 0) -> tuple[float, float, float]:
    """Mean over suites of the per-sample difference a − scale·b, and its 95% paired bootstrap interval.

    ``pairs`` holds one (a, b) per suite, each a sample id -> τ map; every replicate resamples
    each suite's samples with replacement (the same draw for a and b: paired).
    """
    rng = random.Random(seed)
    diffs = [[a[i] - scale * b[i] for i in sorted(a) if i in b] for a, b in pairs]
    if not all(diffs):
        return float("nan"), float("nan"), float("nan")  # a suite without paired samples
    point = sum(sum(d) / len(d) for d in diffs) / len(diffs)
    means = sorted(sum(sum(rng.choices(d, k=len(d))) / len(d) for d in diffs) / len(diffs) for _ in range(reps))
    return point, means[int(0.025 * reps)], means[int(0.975 * reps) - 1]


def interval(pairs: list[tuple[dict[str, float], dict[str, float]]], label: str, scale: float = 1.0) -> str:
    point, lo, hi = paired_interval(pairs, scale)
    noise = "" if lo > 0 or hi < 0 else ", the interval holds 0: within noise"
    return f"{label} {point:+.3f}, 95% CI [{lo:+.3f}, {hi:+.3f}]{noise}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for the JSONL records (default: a temp dir)")
    parser.add_argument("--gamma", type=int, default=None, help="γ to profile (default: the demo profile's)")
    parser.add_argument("--judge-only", action="store_true",
                        help="skip the runs; summarize and judge the records already in --out")
    parser.add_argument("--samples", type=int, default=None, metavar="N",
                        help="N samples per suite instead of the built-in suites' default: the first N of each "
                             "suite, written as a manifest under --out (the same samples, ids and history)")
    parser.add_argument("--first", type=int, default=None, metavar="N",
                        help="with --judge-only: judge only the first N samples of each suite, as a run with "
                             "N samples per suite would (τ is deterministic; timings are this run's)")
    args = parser.parse_args()
    if args.first is not None and not args.judge_only:
        parser.error("--first N re-judges records; pass it with --judge-only")
    if args.samples is not None and args.judge_only:
        parser.error("--samples N sets the size of a new run; to re-judge fewer samples use --first N")
    out = Path(args.out or tempfile.mkdtemp(prefix="mmspec-demo-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    records = out / "demo-all.jsonl"
    print(f"machine: {machine()}")

    from mmspec_cli.models.profiles import load_profile

    gamma = args.gamma or load_profile(None).decoding.gamma
    if not args.judge_only:
        mmspec("profile-latency", "--batch", "1,2,4", "--seq", "128,256", "--gammas", str(gamma), "--repeat", "30")
        if records.exists():
            records.unlink()
        gamma_flag = [] if args.gamma is None else ["--gamma", str(args.gamma)]
        source = "demo-all" if args.samples is None else str(suites_manifest(args.samples, out / "suites"))
        mmspec("bench", source, "--drafters", ",".join(DRAFTERS), "--out", str(records), *gamma_flag)
    if args.first is not None:
        records = first_samples(records, args.first, out / f"demo-all.first{args.first}.jsonl")
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

    samples = per_sample(records)

    def versus(a: str, b: str, suites=SUITES, scale: float = 1.0) -> str:
        label = f"{a} − {b}" if scale == 1.0 else f"{a} − {scale:g}·{b}"
        return interval([(samples[(x, a)], samples[(x, b)]) for x in suites], label, scale)

    print("\n(each verdict is on the point estimates, as the issue states them; beside it the paired "
          "bootstrap 95% interval of the difference over samples)")
    s = tau["demo-single"]
    judge("m > t on demo-single", s["m"] > s["t"],
          f"m {s['m']:.3f}, t {s['t']:.3f} ({versus('m', 't', ['demo-single'])})")
    for suite in ("demo-story", "demo-followup"):
        v = tau[suite]
        judge(f"t > m on {suite}", v["t"] > v["m"], f"t {v['t']:.3f}, m {v['m']:.3f} ({versus('t', 'm', [suite])})")
    for suite in SUITES:
        v = tau[suite]
        best = max(SINGLE, key=lambda d: v[d])
        judge(f"tabed within 2% of the best single drafter on {suite}", v["tabed"] >= 0.98 * v[best],
              f"tabed {v['tabed']:.3f}, best {best} {v[best]:.3f} ({v['tabed'] / v[best] - 1:+.1%}; "
              f"{versus('tabed', best, [suite], 0.98)})")
    others = [d for d in DRAFTERS if d not in ("ar", "tabed")]
    runner_up = max(others, key=lambda d: average[d])
    judge("tabed best on the average over suites", average["tabed"] >= average[runner_up],
          ", ".join(f"{d} {average[d]:.3f}" for d in DRAFTERS[1:]) + f" ({versus('tabed', runner_up)})")
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
