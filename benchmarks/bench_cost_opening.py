"""``--gamma-schedule cost``: how many blocks at the start of a turn draft the profile's γ before the schedule chooses.

The schedule chooses γ from the acceptance of the turn's blocks so far (``decoding/schedules.py``). On the demo
family a turn has 10-20 blocks, so the first choices rest on one or two blocks. This script measures the schedule
with ``--opening`` values of ``schedules.OPENING_BLOCKS`` (default 1 and 3) beside constant γ = 4, 5 and 7, in ONE
process over the same compiled models, interleaved sample by sample and pass by pass (the order rotates), on
demo-story and demo-followup, for ``m`` and ``eagle``. tokens/s = new tokens / the turns' decoding seconds
(``stats.wall_s``: compile time left out). It prints, per drafter and suite, each configuration's rate, every
opening against the first one (total and per pass), and the machine.

The step costs come from ``mmspec profile-latency --compile`` run first into a temporary ``MMSPEC_CACHE`` (the grid of
``bench_engine_block.py``'s figure 6), unless ``--cache DIR`` names one that holds them already.

    python benchmarks/bench_cost_opening.py                       # about 6 minutes on 2 CPU cores
    python benchmarks/bench_cost_opening.py --opening 1,3,5 --reps 6
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_demo_suites import machine  # noqa: E402
from bench_engine_block import LATENCY_ARGS, decoder_for, interleaved, load_models, samples_of  # noqa: E402

CONSTANTS = (4, 5, 7)
SUITES = ("demo-story", "demo-followup")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opening", default="1,3", help="values of OPENING_BLOCKS to compare (default 1,3)")
    parser.add_argument("--drafters", default="m,eagle")
    parser.add_argument("--reps", type=int, default=4, help="interleaved passes over the samples (default 4)")
    parser.add_argument("--samples", type=int, default=3, help="samples of each suite (default 3)")
    parser.add_argument("--cache", type=Path, default=None, help="an MMSPEC_CACHE holding the step costs already")
    args = parser.parse_args()
    openings = [int(x) for x in args.opening.split(",")]
    cache = args.cache or Path(tempfile.mkdtemp(prefix="mmspec-cost-opening-"))
    os.environ["MMSPEC_CACHE"] = str(cache)
    os.environ["MMSPEC_THREADS"] = "1"
    if args.cache is None:
        subprocess.run([sys.executable, "-m", "mmspec_cli", "profile-latency", "--profile", "demo", "--compile",
                        "--threads", "1", *LATENCY_ARGS.split()], check=True, stdout=subprocess.DEVNULL)
    import torch

    torch.set_num_threads(1)
    import mmspec_cli.decoding.schedules as schedules
    from mmspec_cli.bench.latency import run_step_costs
    from mmspec_cli.models.profiles import apply_overrides

    print(f"machine: {machine()}")
    print(f"openings {openings} against constant γ {CONSTANTS}; {args.samples} samples per suite × {args.reps} "
          f"passes; a turn's opening blocks draft γ = 5 under cost")
    for drafter in args.drafters.split(","):
        models = load_models([drafter], compiled=True)
        profile = apply_overrides(models.profile, compile=True, gamma_schedule="cost", gamma=5)
        found, note = run_step_costs(profile, [drafter], models.target.model.device, 1)
        if drafter not in found:
            print(f"{drafter}: no step costs ({note})")
            continue
        opening_of = {f"open{n}": n for n in openings}
        decoders = {name: decoder_for(models, drafter, compile=True, max_new_tokens=160, gamma_schedule="cost",
                                      gamma=5, step_costs=found[drafter]) for name in opening_of}
        decoders.update({str(g): decoder_for(models, drafter, compile=True, max_new_tokens=160, gamma=g)
                         for g in CONSTANTS})
        names = list(decoders)

        def turn(name, sample):
            if name in opening_of:  # read by GammaSchedule.length at each block of this call
                schedules.OPENING_BLOCKS = opening_of[name]
            return decoders[name].generate(list(sample.images), list(sample.turns), history=tuple(sample.history),
                                           max_new_tokens=160).turns[-1]

        for suite in SUITES:
            samples = samples_of([[suite, args.samples]])
            for name in names:  # warm-up: every chain length and verification size the runs use is compiled
                for sample in samples:
                    turn(name, sample)
            passes = [{name: [0, 0.0] for name in names} for _ in range(args.reps)]
            for rep, sample, name in interleaved(names, samples, args.reps):
                result = turn(name, sample)
                passes[rep][name][0] += result.stats.new_tokens
                passes[rep][name][1] += result.stats.wall_s
            rate = {name: sum(p[name][0] for p in passes) / sum(p[name][1] for p in passes) for name in names}
            base = names[0]
            line = " ".join(f"{name}:{value:.0f}" for name, value in rate.items())
            best = max(rate[str(g)] for g in CONSTANTS)
            for name in list(opening_of)[1:]:
                per_pass = [(p[name][0] / p[name][1]) / (p[base][0] / p[base][1]) for p in passes]
                line += (f" | {name}/{base} {rate[name] / rate[base]:.3f} (per pass "
                         f"{', '.join(f'{x:.3f}' for x in per_pass)})")
            line += " | " + ", ".join(f"{name}/best constant {rate[name] / best:.3f}" for name in opening_of)
            print(f"{drafter} {suite}: {line} (tokens/s)", flush=True)
    print(f"machine at the end: {machine()}")


if __name__ == "__main__":
    main()
