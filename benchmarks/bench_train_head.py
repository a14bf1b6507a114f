"""Training cost of ``mmspec train-head eagle3`` against ``train-head eagle`` (and ``vispec``) on the demo target.

Each head kind trains ``--steps`` optimizer steps in a fresh child process (one torch thread), on the same answers
(the demo training corpus answered greedily once, into ``--work``, before any timing), with the shipped demo heads'
settings (batch 8, lr 3e-3; ``--mtp`` 3 for eagle and vispec, EAGLE-3's training-time test of 7 steps for eagle3).
Kinds alternate round by round; each child reports its training seconds (``train_head``'s own clock: the loop
only, after the target's sequences are read once) and its peak RSS (``resource.getrusage``). Printed: steps/s and
peak memory per kind (median over rounds, with the range), and eagle3's ratio to eagle measured side by side.

    python benchmarks/bench_train_head.py                      # 2 rounds of 40 steps per kind, a few minutes
    python benchmarks/bench_train_head.py --steps 100 --rounds 3 --kinds eagle,vispec,eagle3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONVERSATIONS = 400  # of demo-train: the sequences a run reads (and keeps in memory) before its first step


def child(kind: str, steps: int, work: Path) -> dict:
    import resource

    import torch

    torch.set_num_threads(1)
    from mmspec_cli.models.profiles import load_profile
    from mmspec_cli.training.answers import AnswerSettings
    from mmspec_cli.training.corpus import DEMO_TRAIN
    from mmspec_cli.training.run import TrainHeadSettings, train_head

    with tempfile.TemporaryDirectory() as scratch:
        settings = TrainHeadSettings(
            kind=kind, source=DEMO_TRAIN, out=Path(scratch) / kind, steps=steps, lr=3e-3,
            mtp=7 if kind == "eagle3" else 3, limit=CONVERSATIONS, batch_size=8, loss="ce", held_out=0,
            checkpoint_every=10 ** 6, measure_before=False,
            answers=AnswerSettings(temperature=0.0, max_new_tokens=160, suffix="", seed=0, batch_size=64),
            answers_file=work / "demo-train.answers.jsonl")
        report = train_head(load_profile("demo"), settings, log=lambda line: None, progress=False)
    return {"kind": kind, "steps": steps, "training_s": report["seconds"]["training"],
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def run_child(kind: str, steps: int, work: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MMSPEC_THREADS": "1"}
    out = subprocess.run([sys.executable, __file__, "--child", kind, "--steps", str(steps), "--work", str(work)],
                         capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--kinds", default="eagle,eagle3")
    parser.add_argument("--work", default=str(ROOT / "build" / "demo-heads"), help="folder of the shared answers file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.child:
        print(json.dumps(child(args.child, args.steps, work)))
        return
    kinds = args.kinds.split(",")
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPU cores, one torch thread per run; "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    run_child(kinds[0], 1, work)  # answers the corpus once (greedy), untimed
    found: dict[str, list[dict]] = {k: [] for k in kinds}
    for r in range(args.rounds):
        for kind in kinds[r % len(kinds):] + kinds[:r % len(kinds)]:
            result = run_child(kind, args.steps, work)
            found[kind].append(result)
            print(f"round {r + 1} {kind}: {result['steps'] / result['training_s']:.3f} steps/s, "
                  f"peak RSS {result['peak_rss_mb']:.0f} MB", flush=True)
    rates = {k: [x["steps"] / x["training_s"] for x in v] for k, v in found.items()}
    for kind in kinds:
        rss = [x["peak_rss_mb"] for x in found[kind]]
        print(f"{kind:7} {statistics.median(rates[kind]):.3f} steps/s ({min(rates[kind]):.3f}-{max(rates[kind]):.3f}), "
              f"peak RSS {statistics.median(rss):.0f} MB ({min(rss):.0f}-{max(rss):.0f})")
    if "eagle" in rates and "eagle3" in rates:
        ratio = [b / a for a, b in zip(rates["eagle"], rates["eagle3"])]  # per round: the two ran side by side
        print(f"eagle3 / eagle steps/s: {statistics.median(ratio):.3f} ({min(ratio):.3f}-{max(ratio):.3f}); "
              f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
