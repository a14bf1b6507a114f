"""Compiled steps traced with grouped-query attention against the same steps with the key/value heads repeated.

transformers' SDPA attention copies each layer's keys and values once per query head (``repeat_kv``) whenever a
mask is given, and a step over a static KV state always has one. ``--compile`` traces its CPU graphs with
``enable_gqa`` instead (:func:`mmspec_cli.decoding.compiled.grouped_query_attention`). This script measures what
that is worth on the demo target, side by side in one process: the target and a copy of it, one compiled each way,
timed interleaved.

1. The target's compiled step of 1 and γ + 1 tokens after ``--seq`` cached tokens: median over ``--rounds``
   interleaved rounds of the median of 20 calls, with the lower and upper quartile over rounds.
2. Whole ``ar`` turns, compiled, on the first turn of ``--limit`` demo-single and demo-story samples, in an
   order that alternates from sample to sample: median ms per token over samples, and the median of the
   per-sample ratios. Every turn's tokens are checked against the other copy's.

    python benchmarks/bench_gqa.py [--limit 10] [--rounds 15]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import time

import torch

from bench_compiled import pictures, quartiles
from bench_demo_suites import machine

GAMMA = 5


def spread(values: list[float]) -> str:
    median, q1, q3 = quartiles(values)
    return f"{median:.3f} [{q1:.3f}, {q3:.3f}]"


def copies(target):
    """name ("grouped", "repeated") -> the target, and a LoadedModel over a copy of its weights (a model's compiled
    steps are one per model object, so the copy gets graphs of its own)."""
    return {"grouped": target, "repeated": dataclasses.replace(target, model=copy.deepcopy(target.model))}


def runners(targets: dict) -> dict:
    from mmspec_cli.decoding.kv import CachedModel

    built = {}
    for name, target in targets.items():
        runner = CachedModel(target.model, "target", target.image_token_id, kv="compiled")
        grouped = name == "grouped"
        runner.compiled.graphs.grouped_query = grouped  # before any graph is traced
        runner.chain.grouped_query = grouped
        built[name] = runner
    return built


def step_times(runners: dict, seq: int, rounds: int) -> dict[tuple[str, int], list[float]]:
    vocab = next(iter(runners.values())).model.get_output_embeddings().weight.shape[0]
    prefix = torch.randint(5, vocab, (seq + GAMMA + 1,), generator=torch.Generator().manual_seed(0)).tolist()
    found: dict[tuple[str, int], list[float]] = {}
    with torch.inference_mode():
        for runner in runners.values():
            runner.reserve(seq + 128)
            runner.logits(prefix[:seq])

        def step(runner, n):
            state = runner.state
            out = runner.compiled(state, torch.tensor([prefix[seq:seq + n]]),
                                  runner.positions.chain(state.length, n, runner.device), None)
            state.rollback(seq)
            return out[0]

        sizes = (1, GAMMA + 1)
        outputs = {name: step(r, GAMMA + 1) for name, r in runners.items()}  # traces each size's graph
        for r in runners.values():
            step(r, 1)
        a, b = outputs.values()
        print(f"logits of the {GAMMA + 1}-token step, largest difference between the two: "
              f"{(a - b).abs().max().item():.3g}")
        for index in range(rounds):
            order = list(runners.items())
            for name, runner in order[index % 2:] + order[:index % 2]:
                for n in sizes:
                    times = []
                    for _ in range(25):
                        start = time.perf_counter()
                        step(runner, n)
                        times.append(time.perf_counter() - start)
                    found.setdefault((name, n), []).append(statistics.median(times[5:]) * 1000)
    return found


def turns(targets: dict, drafter, samples) -> dict[str, list[float]]:
    from mmspec_cli.decoding.engine import SpeculativeDecoder

    decoders = {}
    for name, target in targets.items():
        # a model's compiled step is one per process (compiled.shared_step): this decoder's runner uses the graphs
        # whose attention runners() set
        decoders[name] = SpeculativeDecoder(target, drafter(target), gamma=GAMMA, max_new_tokens=160, kv="compiled")
    per_token: dict[str, list[float]] = {}
    mismatches = 0
    for index, sample in enumerate([samples[0]] + samples):  # the first pass compiles, untimed
        images = pictures(sample)
        order = list(decoders.items())
        tokens = {}
        for name, decoder in order[index % 2:] + order[:index % 2]:
            with torch.inference_mode():
                turn = decoder.generate(images, [sample.turns[0]]).turns[0]
            tokens[name] = turn.token_ids
            if index:
                per_token.setdefault(name, []).append(1000 * turn.stats.wall_s / len(turn.token_ids))
        mismatches += len({tuple(t) for t in tokens.values()}) != 1
    print(f"turns whose tokens differ between the two: {mismatches} of {len(samples) + 1}")
    return per_token


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=10, help="samples per suite (demo-single, demo-story)")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds of the step timings")
    parser.add_argument("--seq", type=int, default=128, help="cached tokens before the timed step")
    args = parser.parse_args()
    from mmspec_cli.api import ModelSet
    from mmspec_cli.inputs.sources import resolve
    from mmspec_cli.drafters.registry import build_drafter
    from mmspec_cli.models.profiles import load_profile

    torch.set_num_threads(1)
    print(f"machine: {machine()}")
    models = ModelSet.load(load_profile(None), ["ar"], threads=1)
    targets = copies(models.target)
    built = runners(targets)
    steps = step_times(built, args.seq, args.rounds)
    for n in (1, GAMMA + 1):
        grouped, repeated = steps[("grouped", n)], steps[("repeated", n)]
        ratio = statistics.median(g / r for g, r in zip(grouped, repeated))
        print(f"compiled step of {n} token{'s' * (n > 1)} after {args.seq}: grouped {spread(grouped)} ms, "
              f"repeated {spread(repeated)} ms; grouped / repeated {ratio:.2f}")
    samples = resolve("demo-single", args.limit) + resolve("demo-story", args.limit)
    per_token = turns(targets, lambda target: build_drafter("ar", target, None), samples)
    grouped, repeated = per_token["grouped"], per_token["repeated"]
    ratio = statistics.median(g / r for g, r in zip(grouped, repeated))
    print(f"ar compiled, ms per token over {len(samples)} samples: grouped {spread(grouped)}, "
          f"repeated {spread(repeated)}; grouped / repeated {ratio:.2f} (median of per-sample ratios)")


if __name__ == "__main__":
    main()
