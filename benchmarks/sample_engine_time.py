"""Where a block's wall time goes, by sampling: py-spy's stacks of the demo profile decoding the demo suites.

Figure 1 of issue 31 (``bench_engine_block.py``) times the engine's own work as a block's wall time minus the time
inside model forwards, and ``census_engine_ops.py`` counts the torch calls that work makes. This script says where
that time sits, line by line, without instrumenting anything: it runs the decoding under ``py-spy record`` (a
sampling profiler in its own process; ``pip install py-spy``) and sorts every sample taken during the timed passes
into

- **graph**: inside a compiled graph's generated code (inductor's kernels, the code that calls them);
- **compiled-call wrapper**: dynamo's and AOTAutograd's Python around each compiled graph (figure 1 counts it as
  forward time: it runs inside the function ``torch.compile`` returned);
- **eager modules**: eager model forwards (the prompt's prefill with its images, eager steps);
- **processor**: the chat template, the tokenizer and the image processor at a turn's start;
- **engine**: everything else inside a turn: mmspec's own Python and the torch calls it makes between forwards,
  each sample charged to the deepest mmspec line on its stack.

    pip install py-spy
    python benchmarks/sample_engine_time.py --drafters ar,m,tabed,eagle --modes compiled,eager

One thread; a warm-up pass (which compiles every shape) is not sampled. Sampling at 250 Hz keeps up on a
2-core machine (at 2,000 Hz py-spy fell minutes behind); the shares carry the sampling's own error, about
1/sqrt(samples) of each row.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SAMPLES = (("demo-story", 2), ("demo-followup", 2))
MAX_NEW = 160
#: The worker's function whose samples are kept (the timed passes, not loading or the warm-up).
TIMED = "timed_passes"
#: A frame of a module inductor generated (its files are named by a hash: ``c<hash>.py``).
GENERATED = re.compile(r"\(c[a-z0-9]{30,}\.py:\d+\)")
CATEGORIES = ("graph", "compiled-call wrapper", "eager modules", "processor", "engine")


def category(frames: list[str]) -> str:
    """Which of :data:`CATEGORIES` a sample inside a turn belongs to (``frames``: outermost first)."""
    if any(GENERATED.search(frame) for frame in frames):
        return "graph"
    if any("torch/_dynamo/" in frame or "torch/_functorch/" in frame or "torch/_inductor/" in frame
           for frame in frames):
        return "compiled-call wrapper"
    if any("torch/nn/modules/module.py" in frame for frame in frames):
        return "eager modules"
    if any("mmspec_cli/models/prompts.py" in frame for frame in frames):
        return "processor"
    return "engine"


def mmspec_line(frames: list[str]) -> str:
    """The deepest mmspec frame of a sample inside a turn, and what it was calling when that was not mmspec's own."""
    deepest = max(i for i, frame in enumerate(frames) if "mmspec_cli/" in frame)
    callee = frames[deepest + 1] if deepest + 1 < len(frames) else ""
    return frames[deepest] + (f"  > {callee}" if callee else "")


def read_samples(raw: Path) -> tuple[collections.Counter, collections.Counter]:
    """(samples per category, samples per (category, deepest mmspec line)) of the timed passes, from py-spy's raw
    output (one stack a line, frames joined by ``;``, then the count)."""
    categories: collections.Counter = collections.Counter()
    lines: collections.Counter = collections.Counter()
    for row in raw.read_text().splitlines():
        stack, _, count = row.rpartition(" ")
        frames = stack.split(";")
        if not any(f"{TIMED} (" in frame for frame in frames):
            continue
        if not any("mmspec_cli/decoding/engine.py" in frame and "_turn" in frame for frame in frames):
            categories["outside a turn"] += int(count)
            continue
        kind = category(frames)
        categories[kind] += int(count)
        lines[kind, mmspec_line(frames)] += int(count)
    return categories, lines


def worker(drafter: str, mode: str, passes: int, out: Path) -> None:
    import time

    import torch

    import bench_engine_block as engine_block

    torch.set_num_threads(1)
    compiled = mode == "compiled"
    models = engine_block.load_models([drafter], compiled=compiled)
    decoder = engine_block.decoder_for(models, drafter, compile=compiled, max_new_tokens=MAX_NEW)
    samples = engine_block.samples_of(SAMPLES)

    def one_pass() -> int:
        blocks = 0
        for sample in samples:
            for _ in decoder.stream(list(sample.images), list(sample.turns), history=tuple(sample.history),
                                    max_new_tokens=MAX_NEW):
                blocks += 1
        return blocks

    def timed_passes() -> tuple[float, int]:
        start, blocks = time.perf_counter(), 0
        for _ in range(passes):
            blocks += one_pass()
        return time.perf_counter() - start, blocks

    one_pass()  # warm-up: compiles every shape the timed passes meet
    seconds, events = timed_passes()
    out.write_text(json.dumps({"seconds": seconds, "events": events}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafters", default="ar,m,tabed,eagle", help="drafters of the demo profile (no oracle)")
    parser.add_argument("--modes", default="compiled,eager", help="compiled, eager or both, comma-separated")
    parser.add_argument("--passes", type=int, default=20, help="timed passes over the samples")
    parser.add_argument("--rate", type=int, default=250, help="samples per second")
    parser.add_argument("--top", type=int, default=12, help="engine lines to print per run")
    parser.add_argument("--eager-top", type=int, default=4, help="mmspec lines to print that made eager module calls")
    parser.add_argument("--worker", nargs=4, metavar=("DRAFTER", "MODE", "PASSES", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], args.worker[1], int(args.worker[2]), Path(args.worker[3]))
        return
    modes = args.modes.split(",")
    if not set(modes) <= {"compiled", "eager"}:
        print(f"error: --modes takes compiled and eager, not {args.modes!r}", file=sys.stderr)
        sys.exit(2)
    beside = Path(sys.executable).parent / "py-spy"  # a virtual environment's, when its bin is not on PATH
    spy = shutil.which("py-spy") or (str(beside) if beside.exists() else None)
    if spy is None:
        print("error: py-spy is not installed; run: pip install py-spy", file=sys.stderr)
        sys.exit(2)
    import torch
    from bench_demo_suites import machine

    torch.set_num_threads(1)  # as the sampled worker runs
    print(f"machine: {machine()}")
    failed = 0
    for mode in modes:
        for drafter in args.drafters.split(","):
            with tempfile.TemporaryDirectory() as scratch:
                raw, timed = Path(scratch) / "stacks.txt", Path(scratch) / "timing.json"
                worker_command = [sys.executable, __file__, "--worker", drafter, mode, str(args.passes), str(timed)]
                run = subprocess.run([spy, "record", "-r", str(args.rate), "-f", "raw", "-o", str(raw), "--",
                                      *worker_command], capture_output=True, text=True, cwd=Path(__file__).parent,
                                     env={**os.environ, "MMSPEC_THREADS": "1"})
                if run.returncode != 0 or not raw.exists() or not timed.exists():
                    tail = (run.stderr.strip().splitlines() or ["(no output)"])[-1]
                    print(f"{drafter}, {mode}: the run failed: {tail}")
                    failed += 1
                    continue
                timing = json.loads(timed.read_text())
                categories, lines = read_samples(raw)
            report(drafter, mode, timing, categories, lines, args.top, args.eager_top)
    if failed:
        sys.exit(1)


def report(drafter: str, mode: str, timing: dict, categories: collections.Counter, lines: collections.Counter,
           top: int, eager_top: int) -> None:
    in_turns = sum(categories[kind] for kind in CATEGORIES)
    print(f"\n{drafter}, {mode}: {timing['seconds']:.1f} s for {timing['events']} events; "
          f"{in_turns} samples inside turns ({categories['outside a turn']} outside)")
    for kind in CATEGORIES:
        print(f"  {kind:<22} {categories[kind]:>6}  {100 * categories[kind] / max(in_turns, 1):5.1f}%")
    for kind, shown in (("engine", top), ("eager modules", eager_top)):
        total = categories[kind]
        print(f"  {kind}: samples by the deepest mmspec line (share of the {total}):")
        mine = collections.Counter({line: count for (of, line), count in lines.items() if of == kind})
        for line, count in mine.most_common(shown):
            print(f"    {100 * count / max(total, 1):5.1f}%  {line}")


if __name__ == "__main__":
    main()
