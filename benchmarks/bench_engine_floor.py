"""How far the engine's own time per block sits above the least any loop around the same forwards spends.

Figure 1 of issue 31 (``bench_engine_block.py``) asks the engine's own time per block (a block's wall time minus the
time inside model forwards) to be at most half the old commit's. This script measures, on the demo target, what
that time could at best fall to: `ar` (one target forward a block, no draft) decoded four ways in one process,
round by round, with ``bench_engine_block``'s clock (eager module calls and compiled graphs are forward time):

- ``engine``: ``SpeculativeDecoder.stream`` with ``--drafter ar``, what figure 1 times (each turn's first block left
  out);
- ``cached model``: the target's cached model alone (``CachedModel.extend`` of one token, then the argmax of its
  logits): the engine without the block (no schedule, verification rule, rollback, events);
- ``bare step``: the same compiled step's graphs called directly (``CompiledGraphs``: the graph picked by its trace
  key) with two fresh input tensors and the argmax: no cached model, no KV bookkeeping but the write pointer;
- ``graph alone``: the one graph function itself, its key looked up once: the two input tensors, the call and the
  argmax.

Eager (``--mode eager``), the last two are replaced by ``bare forward``: the model's own ``forward`` over a
``DynamicCache``, and the argmax. A prompt of 150 ids, 160 tokens a pass, 3 rounds, one thread. Medians (IQR) of
µs per token outside the forwards, and each row over the last one.

    python benchmarks/bench_engine_floor.py [--mode compiled|eager] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import bench_engine_block as engine_block

SAMPLES = (("demo-story", 2), ("demo-followup", 2))
TOKENS = 160
PROMPT = list(range(5, 155))  # 150 text ids of the demo vocabulary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("compiled", "eager"), default="compiled")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    clock = engine_block.ForwardClock()
    clock.install()  # before mmspec_cli is imported: its torch.compile calls are timed as forwards
    import torch

    torch.set_num_threads(1)
    from transformers import DynamicCache

    from bench_demo_suites import machine
    from mmspec_cli.api import ModelSet
    from mmspec_cli.inputs.sources import resolve
    from mmspec_cli.decoding.compiled import trace_key
    from mmspec_cli.decoding.kv import CachedModel
    from mmspec_cli.models.parts import with_cache
    from mmspec_cli.models.profiles import apply_overrides, load_profile

    compiled = args.mode == "compiled"
    profile = apply_overrides(load_profile("demo"), compile=compiled, max_new_tokens=TOKENS)
    models = ModelSet.load(profile, ["ar"], threads=1)
    decoder = models.decoder("ar")
    samples = [s for suite, n in SAMPLES for s in resolve(suite, n)]
    target = models.target.model
    cached = CachedModel(target, role="target", image_token_id=models.target.image_token_id,
                         kv="compiled" if compiled else "dynamic")

    def outside(step) -> list[float]:
        """µs outside the forwards of each of TOKENS calls of ``step(token) -> next token``."""
        spent, token = [], 7
        for _ in range(TOKENS):
            began, forward = time.perf_counter(), clock.seconds
            token = step(token)
            spent.append(1e6 * ((time.perf_counter() - began) - (clock.seconds - forward)))
        return spent[2:]

    def engine() -> list[float]:
        spent = []
        for sample in samples:
            blocks, _, _ = engine_block.stream_blocks(decoder, sample, clock, TOKENS)
            spent += [1e6 * (b["wall"] - b["forward"]) for b in blocks if not b["first"]]
        return spent

    def cached_model() -> list[float]:
        cached.logits(PROMPT, keep=1)
        return outside(lambda token: int(cached.extend([token], 1)[-1].argmax()))

    def over_the_state(call) -> list[float]:
        """``call(ids, positions, cache)`` for each token after the prompt, over the cached model's static state;
        the state is put back to the prompt after (the cached model's token list is not kept here)."""
        cached.logits(PROMPT, keep=1)
        state = cached.state

        @torch.inference_mode()  # as the cached model calls its graphs: the state's tensors are inference tensors
        def step(token: int) -> int:
            out = call(torch.tensor([[token]]), torch.tensor([[state.length]]), state.cache)
            state.wrote(1)
            return int(out[0][0, -1].argmax())

        try:
            return outside(step)
        finally:
            state.rollback(len(PROMPT))

    def bare_step() -> list[float]:
        graphs = cached.compiled.graphs
        return over_the_state(lambda ids, positions, cache: graphs(ids, positions, None, cache))

    def graph_alone() -> list[float]:
        graphs = cached.compiled.graphs
        probe = (torch.tensor([[7]]), torch.tensor([[len(PROMPT)]]), None, cached.state.cache)
        graph = graphs._graph(trace_key(probe, (graphs.grouped_query,)))  # the graph bare_step's calls use
        return over_the_state(lambda ids, positions, cache: graph(ids, positions, None, cache))

    def bare_forward() -> list[float]:
        cache = DynamicCache(config=target.config)
        with torch.inference_mode():
            target(input_ids=torch.tensor([PROMPT]), **with_cache(cache), use_cache=True, logits_to_keep=1)

        @torch.inference_mode()
        def step(token: int) -> int:
            out = target(input_ids=torch.tensor([[token]]), **with_cache(cache), use_cache=True, logits_to_keep=1)
            return int(out.logits[0, -1].argmax())

        return outside(step)

    ways = {"engine": engine, "cached model": cached_model}
    ways.update({"bare step": bare_step, "graph alone": graph_alone} if compiled else {"bare forward": bare_forward})
    print(f"machine: {machine()}; {args.mode}, {args.rounds} rounds")
    for way in ways.values():  # warm-up: compiles every shape the rounds meet
        way()
    spent: dict[str, list[float]] = {name: [] for name in ways}
    for r in range(args.rounds):
        order = list(ways) if r % 2 == 0 else list(ways)[::-1]
        for name in order:
            spent[name] += ways[name]()
    print("\n| way | µs a token outside the forwards, median (IQR) | over the next row |")
    print("|---|---|---|")
    names = list(ways)
    for i, name in enumerate(names):
        q1, median, q3 = statistics.quantiles(spent[name], n=4)
        ratio = ""
        if i + 1 < len(names):
            ratio = f"{median / statistics.median(spent[names[i + 1]]):.2f}"
        print(f"| {name} | {median:.1f} ({q1:.1f}-{q3:.1f}) | {ratio} |")
    print(f"\nmachine at the end: {machine()}")


if __name__ == "__main__":
    main()
