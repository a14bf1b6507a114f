"""What the engine's own time per block is made of: the torch calls a block makes outside model forwards.

Figure 1 of issue 31 (``bench_engine_block.py``) times the engine's work between forwards. On this CPU most of it is
not arithmetic but the cost of each small operation right after a forward, which leaves the caches cold: an op that
takes 1-2 µs warm takes 4-15 µs there (docs/BENCHMARKS.md). So the count of calls is what moves that figure. This
script counts them with a ``TorchFunctionMode`` that records every torch function and tensor method called while no
model forward runs (``bench_engine_block.ForwardClock``'s depth is 0) and nothing is being traced, per block, by
name, and with ``--where`` by the line of mmspec (or of the library) that made it; and how many times a block turns
``torch.inference_mode`` on (each entry costs about 1.6 µs warm here: ``mmspec_cli/decoding/inference.py``).

It times nothing: the mode itself costs far more than the calls it counts. Attribute reads (``__get__``: a
tensor's shape, dtype, device) are counted too, though they cost far less than an op that makes a tensor.

    python benchmarks/census_engine_ops.py --drafters ar,m,tabed,eagle --modes eager,compiled [--where]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bench_engine_block as engine_block

SAMPLES = (("demo-story", 2), ("demo-followup", 2))
MAX_NEW = 160


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafters", default="ar,m,tabed,eagle", help="drafters of the demo profile (no oracle)")
    parser.add_argument("--modes", default="eager,compiled")
    parser.add_argument("--where", action="store_true", help="also count by the line that made each call")
    parser.add_argument("--top", type=int, default=15, help="rows to print per table")
    args = parser.parse_args()

    clock = engine_block.ForwardClock()
    clock.install()  # before mmspec_cli is imported: its torch.compile calls are timed as forwards
    import torch
    from torch.overrides import TorchFunctionMode

    from mmspec_cli.api import ModelSet
    from mmspec_cli.inputs.sources import resolve
    from mmspec_cli.models.profiles import apply_overrides, load_profile

    torch.set_num_threads(1)
    names: collections.Counter = collections.Counter()
    sites: collections.Counter = collections.Counter()
    package = str(Path(__file__).resolve().parents[1] / "mmspec_cli")
    where = args.where

    class Census(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if clock.depth == 0 and not torch.compiler.is_compiling():
                name = getattr(func, "__name__", str(func))
                names[name] += 1
                if where:
                    frame = sys._getframe(1)
                    while frame is not None and "/torch/" in frame.f_code.co_filename:
                        frame = frame.f_back
                    if frame is not None:
                        path = frame.f_code.co_filename
                        shown = "mmspec_cli/" + path.split("mmspec_cli/")[-1] if path.startswith(package) else path
                        sites[f"{name} @ {shown}:{frame.f_lineno}"] += 1
            return func(*args, **(kwargs or {}))

    samples = [sample for suite, n in SAMPLES for sample in resolve(suite, n)]
    drafters = args.drafters.split(",")
    for mode in args.modes.split(","):
        compiled = mode == "compiled"
        profile = apply_overrides(load_profile("demo"), compile=compiled, max_new_tokens=MAX_NEW)
        models = ModelSet.load(profile, drafters, threads=1)
        for drafter in drafters:
            decoder = models.decoder(drafter)

            def run() -> int:
                blocks = 0
                for sample in samples:
                    for event in decoder.stream(list(sample.images), list(sample.turns),
                                                history=tuple(sample.history), max_new_tokens=MAX_NEW):
                        blocks += type(event).__name__ == "BlockVerified"
                return blocks

            run()  # warm-up: compiles every shape the counted pass meets
            names.clear()
            sites.clear()
            entries = [0]
            with Census(), counting_entries(torch.inference_mode, entries, lambda mode: mode.mode):
                blocks = run()
            total = sum(names.values())
            print(f"\n{drafter}, {mode}: {total / blocks:.1f} torch calls per block outside forwards "
                  f"({blocks} blocks; each turn's first, which feeds the prompt, included); "
                  f"{entries[0] / blocks:.1f} entries into torch.inference_mode per block")
            for name, count in names.most_common(args.top):
                print(f"  {count / blocks:7.2f}  {name}")
            if where:
                for site, count in sites.most_common(args.top):
                    print(f"  {count / blocks:7.2f}  {site}")


@contextlib.contextmanager
def counting_entries(manager: type, count: list[int], which: Callable[[Any], bool] = lambda _: True):
    """Count in ``count[0]`` every entry into a context manager of class ``manager`` for which ``which`` holds (for
    ``torch.inference_mode``: those that turn the mode on) while the block runs (its ``__enter__`` wrapped for that
    time, and put back)."""
    enter = manager.__enter__

    def counted(self):
        count[0] += which(self)
        return enter(self)

    manager.__enter__ = counted
    try:
        yield
    finally:
        manager.__enter__ = enter


if __name__ == "__main__":
    main()
