"""The README's main job on a busy CPU: mmspec's thread choice against torch's default, side by side.

Runs ``mmspec generate examples/shapes.png -q "Describe the image in detail." --drafter tabed --json``
(the README's main job, the shipped demo family) in four conditions, interleaved repeat by repeat:

- ``before``: the checkout given with ``--before`` (an earlier mmspec, which left torch's default
  thread count), or, without it, this checkout with ``MMSPEC_THREADS`` set to torch's default;
- ``after``: this checkout, choosing its threads itself;

each on a quiet machine and beside ``--busy`` CPU-bound processes (``python -c "while True: pass"``).
It prints, per condition, the decoding time the command reports (``stats.wall_s``) and the whole
command's wall time: medians with [min, max], and the before/after ratios. Exits 0 whatever it measures.

    python benchmarks/bench_threads.py [--repeats 5] [--busy 2] [--before DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB = ["generate", "examples/shapes.png", "-q", "Describe the image in detail.", "--drafter", "tabed", "--json"]


def run_job(checkout: Path, env_extra: dict[str, str]) -> tuple[float, float, dict]:
    """(decoding seconds reported by the command, whole-command seconds, the JSON's threads entry)."""
    env = {k: v for k, v in os.environ.items() if k != "MMSPEC_THREADS"}
    env.update(PYTHONPATH=str(checkout), **env_extra)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", "from mmspec_cli.cli.app import main; main()", *JOB],
                          cwd=checkout, env=env, capture_output=True, text=True)  # -c puts the cwd first on sys.path
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"the job failed in {checkout}: {done.stderr.strip()[-500:]}")
    out = json.loads(done.stdout)
    return out["stats"]["wall_s"], elapsed, out.get("threads", {})


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}, {max(values):.2f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--busy", type=int, default=2, help="CPU-bound processes beside the job when busy")
    parser.add_argument("--before", type=Path, default=None, help="a checkout of the earlier mmspec")
    args = parser.parse_args()
    import torch

    default_threads = torch.get_num_threads()
    variants = {
        "before": (args.before, {}) if args.before else (ROOT, {"MMSPEC_THREADS": str(default_threads)}),
        "after": (ROOT, {}),
    }
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__} "
          f"(default {default_threads} threads), load average {os.getloadavg()[0]:.2f} at the start")
    print(f"before = {args.before or f'this checkout with MMSPEC_THREADS={default_threads}'}; after = this checkout")
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    threads_seen: dict[str, dict] = {}
    for load in ("quiet", "busy"):
        count = args.busy if load == "busy" else 0
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
        try:
            time.sleep(1.0 if hogs else 0.0)
            for _ in range(args.repeats):
                for name, (checkout, env) in variants.items():
                    decode_s, whole_s, threads = run_job(checkout, env)
                    results.setdefault((load, name), []).append((decode_s, whole_s))
                    threads_seen[f"{load}/{name}"] = threads
        finally:
            for hog in hogs:
                hog.kill()
                hog.wait()
    print(f"{'condition':<14} {'decoding s (stats.wall_s)':>28} {'whole command s':>24}  threads")
    for (load, name), rows in results.items():
        print(f"{load + '/' + name:<14} {spread([r[0] for r in rows]):>28} {spread([r[1] for r in rows]):>24}  "
              f"{threads_seen.get(f'{load}/{name}') or 'torch default'}")
    for load in ("quiet", "busy"):
        before = statistics.median(r[0] for r in results[(load, "before")])
        after = statistics.median(r[0] for r in results[(load, "after")])
        print(f"{load}: decoding time before / after = {before / after:.2f}x")


if __name__ == "__main__":
    main()
