"""Quantized demo models on the CPU: peak memory and ms/token at float32, 8 and 4 bits (bitsandbytes), side by side.

The shipped demo family (profile ``demo``: ``mmspec:demo-target`` and ``mmspec:demo-draft``), greedy, on
``examples/shapes.png`` with "Describe the image in detail.", for each drafter of ``--drafters`` (``ar``, ``m``,
``tabed``), at three precisions: ``float32`` (the models as shipped), ``8bit`` and ``4bit`` (the profile's
``quantization`` set on the target and the draft). Each precision runs in a subprocess of its own, so peaks do
not mix, and the rounds are interleaved (round 1: 16, 8bit, 4bit; round 2: ...), so each precision sees the same
load. Every subprocess runs with ``--threads`` torch threads.

Each subprocess reports: the two models' weights in memory (``get_memory_footprint``), its resident memory after importing torch, transformers and bitsandbytes (imported in
every precision, so the baseline is the same), its peak resident memory (``ru_maxrss``) after loading and decoding,
and per drafter the decoding wall time per generated token (``stats.wall_s / new_tokens``, a warm-up turn first)
and whether its tokens are ``ar``'s at that precision. It prints medians with [min, max] over the rounds and the
ratios to the float32 run.

**4 bits and the demo widths.** On a CPU with AVX512-BF16, bitsandbytes 0.50 runs every 4-bit layer in its own
kernel, which needs each layer's output size to be a multiple of 32 and its input size one of 64 (its block).
The demo target's language model is 144 wide (MLP 396; key/value projections 72) and the draft's MLP 176: its
first 4-bit forward would fail in it (``AssertionError: N must be divisible by block_n``). mmspec's loader switches
those layers to bitsandbytes' other CPU path (``support_avx512bf16_for_cpu = False``: each weight dequantized for a
float matmul) with one warning line; the run counts them. On a CPU without AVX512-BF16 that is bitsandbytes' own
path for every layer.

    python benchmarks/bench_quantization.py [--rounds 3] [--max-new 64] [--threads 1] [--drafters ar,m,tabed] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMAGE = ROOT / "examples" / "shapes.png"
QUESTION = "Describe the image in detail."
PRECISIONS = {"float32": None, "8bit": "8bit", "4bit": "4bit"}


def rss_mb() -> float:
    """This process' resident memory now (Linux: /proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def worker(precision: str, drafters: list[str], max_new: int, threads: int) -> None:
    """One precision in this process: load, warm up, decode once per drafter; one JSON line on stdout."""
    import torch

    torch.set_num_threads(threads)
    import bitsandbytes  # noqa: F401  (in every precision: the same baseline)
    import transformers  # noqa: F401
    from dataclasses import replace

    from PIL import Image

    from mmspec_cli.api import ModelSet
    from mmspec_cli.models.profiles import apply_overrides, load_profile

    baseline = rss_mb()
    quant = PRECISIONS[precision]
    profile = apply_overrides(load_profile("demo"), max_new_tokens=max_new)
    profile = replace(profile, target=replace(profile.target, quantization=quant, device="cpu"),
                      draft=replace(profile.draft, quantization=quant, device="cpu"))
    models = ModelSet.load(profile, drafters, threads=threads)
    kernel_off = sum(type(module).__name__ == "Linear4bit" and not module.support_avx512bf16_for_cpu
                     for loaded in (models.target, models.draft) for module in loaded.model.modules())
    loaded_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    images = [Image.open(IMAGE).convert("RGB")]
    weights = sum(loaded.model.get_memory_footprint() for loaded in (models.target, models.draft)) / 2**20
    out: dict = {"precision": precision, "baseline_mb": baseline, "loaded_peak_mb": loaded_peak, "weights_mb": weights,
                 "kernel_off": kernel_off, "threads": torch.get_num_threads(), "drafters": {}}
    tokens = {}
    for drafter in drafters:
        decoder = models.decoder(drafter)
        decoder.generate(images, [QUESTION], max_new_tokens=8)  # warm-up
        turn = decoder.generate(images, [QUESTION]).turns[0]
        stats = turn.stats
        tokens[drafter] = turn.token_ids
        out["drafters"][drafter] = {"ms_per_token": 1000 * stats.wall_s / max(stats.new_tokens, 1),
                                    "new_tokens": stats.new_tokens, "tau": stats.block_efficiency}
    for drafter in drafters:
        out["drafters"][drafter]["same_as_ar"] = tokens[drafter] == tokens.get("ar", tokens[drafter])
    out["peak_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(out))


def spread(values: list[float], fmt: str = ".1f") -> str:
    return f"{statistics.median(values):{fmt}} [{min(values):{fmt}}, {max(values):{fmt}}]"


def run_worker(precision: str, args: argparse.Namespace) -> dict:
    command = [sys.executable, __file__, "--worker", precision, "--drafters", args.drafters, "--max-new",
               str(args.max_new), "--threads", str(args.threads)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        return {"precision": precision, "error": done.stderr.strip().splitlines()[-1][:300]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--drafters", default="ar,m,tabed")
    parser.add_argument("--precisions", default="float32,8bit,4bit")
    parser.add_argument("--quick", action="store_true", help="2 rounds of 32 new tokens")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    drafters = args.drafters.split(",")
    if args.worker:
        worker(args.worker, drafters, args.max_new, args.threads)
        return
    if args.quick:
        args.rounds, args.max_new = 2, 32
    import bitsandbytes
    import torch

    precisions = args.precisions.split(",")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"bitsandbytes {bitsandbytes.__version__}, {args.threads} thread(s) per run, load average "
          f"{os.getloadavg()[0]:.2f} at the start")
    print(f"demo profile, greedy, {IMAGE.name} \"{QUESTION}\", {args.max_new} new tokens, {args.rounds} interleaved "
          f"rounds, each precision in its own process", flush=True)
    results: dict[str, list[dict]] = {p: [] for p in precisions}
    start = time.perf_counter()
    for r in range(args.rounds):
        for p in precisions:
            results[p].append(run_worker(p, args))
            if "error" in results[p][-1]:
                print(f"  round {r + 1} {p}: failed: {results[p][-1]['error']}", flush=True)
    print(f"({time.perf_counter() - start:.0f} s)\n")
    ok = {p: [x for x in rs if "error" not in x] for p, rs in results.items()}
    base = ok.get("float32") or []
    print("memory (MB): the two models' weights (transformers' get_memory_footprint); resident after imports; peak "
          "after loading; peak after decoding; peak above the resident baseline")
    for p in precisions:
        rs = ok[p]
        if not rs:
            print(f"  {p:7} failed in every round")
            continue
        above = [x["peak_mb"] - x["baseline_mb"] for x in rs]
        ratio = ""
        if base and p != "float32":
            ratio = f"   ×{statistics.median(above) / statistics.median([x['peak_mb'] - x['baseline_mb'] for x in base]):.2f} of float32's"
        note = f"   (mmspec switched {rs[0]['kernel_off']} layers off the 4-bit kernel)" if rs[0]["kernel_off"] else ""
        print(f"  {p:7} {rs[0]['weights_mb']:.2f}; {spread([x['baseline_mb'] for x in rs])}; "
              f"{spread([x['loaded_peak_mb'] for x in rs])}; "
              f"{spread([x['peak_mb'] for x in rs])}; {spread(above)}{ratio}{note}")
    print("\nms/token (decoding wall time per generated token), τ, tokens equal to ar's at the same precision; "
          "ratio to float32 (per round, side by side)")
    for d in drafters:
        for p in precisions:
            rs = ok[p]
            if not rs:
                continue
            ms = [x["drafters"][d]["ms_per_token"] for x in rs]
            line = (f"  {d:6} {p:7} {spread(ms, '.2f')} ms/token   τ {rs[0]['drafters'][d]['tau']:.2f}   "
                    f"same as ar: {all(x['drafters'][d]['same_as_ar'] for x in rs)}")
            if base and p != "float32":
                pairs = [q["drafters"][d]["ms_per_token"] / b["drafters"][d]["ms_per_token"]
                         for q, b in zip(results[p], results["float32"]) if "error" not in q and "error" not in b]
                line += f"   ×{spread(pairs, '.2f')} of float32's"
            print(line)


if __name__ == "__main__":
    main()
