"""What holds the compiled decoding step back from the memory-bandwidth floor, and where a turn's prefill goes, on
one CUDA GPU at LLaVA-1.5-7B's shape (random float16 weights; the model of ``bench_cuda_7b.py``).

``bench_cuda_7b.py`` measured compiled ``ar`` at 0.51 of the floor on an H100 (8.84 ms per token against 4.52 ms),
and the prefill as a large share of a compiled turn. This script takes both apart, in one process:

1. **The floor**: the bytes of the language model's weights over the device-to-device copy bandwidth measured here
   (as ``bench_cuda_7b.py``), and the floor of the linear layers alone (the embedding table is not read whole by a
   step: one row per token).
2. **The matmuls alone**: every linear layer of the language model and the LM head applied to one token with the
   model's own weights (``F.linear``), captured in one CUDA graph and replayed: what the matmul kernels reach with no
   other kernel and no launch gap between them. Its ratio to the linear floor is the most any step built of these
   kernels can reach.
3. **The engine's compiled step** of one token (``compiled_forward``: CUDA graphs) after ``--seq`` cached tokens,
   for each static capacity of ``--capacities`` (a turn's state is allocated at the next power of two of what it
   needs, at least 512; attention over a static cache reads every slot of it): wall time per step (host clock,
   the GPU waited for), and the kernels' own time per step from ``torch.profiler``, grouped into matmul, attention,
   inductor's fused kernels (norms, rotary embeddings, the cache's writes), copies and others, with the top kernels
   by time. Wall time minus kernel time is the time the
   GPU sat idle inside a step (launches, the host).
4. **The prefill** (``--prefill``): the processor on one demo-single sample's image and prompt (host), the model's
   eager forward over it with the image (what a turn's first verification runs), the same forward with text tokens
   in the image's slots (no vision tower), and that text forward compiled at its one fixed shape (inductor, no CUDA
   graphs): whether compiling the prefill is worth it, and how much of it the vision tower is. The compiled
   prefill's logits are compared with the eager one's (largest difference, same argmax at every position).
5. **The step with tuned kernels** (``--autotune``): the same forward compiled with inductor's own matmul templates
   tuned per shape and coordinate-descent tuning (:data:`AUTOTUNE`, added to the engine's options), at the first
   capacity, timed and profiled as in part 3, its logits compared with the engine step's: whether other kernels
   than cuBLAS's one-row ones, and fewer of them, close the gap to the floor.

Every result is appended to ``--out``/results.jsonl as it is measured.

    python benchmarks/profile_cuda_step.py [--seq 640] [--capacities 1024,4096] [--prefill] [--autotune] [--out DIR]
    python benchmarks/profile_cuda_step.py --small --capacities 1024   # the script checked on a CPU, not a measurement

It needs a CUDA device with about 20 GB free; it exits 0 whatever it measures.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

from bench_compiled import pictures, synchronize
from bench_cuda_7b import (FULL, SMALL, SMALL_HELP, build, chosen_device, copy_bandwidth, language_model_bytes,
                           results_log, spread)
from bench_demo_suites import machine

#: Kernel kinds, by the first pattern a kernel's name matches. Inductor's generated kernels (``triton_*``) are one
#: kind whatever they fuse (a norm with its casts is named ``..._to_copy_..._rsqrt``, a rotary embedding feeding
#: attention ``..._scaled_dot_product_...``), but for its matmuls: a template (``triton_tem_*``, max-autotune's) or
#: a kernel whose fused ops include one (``..._mm_...``, a one-row matmul decomposed into a reduction). cuBLAS's
#: Hopper kernels are named ``nvjet_*``.
KINDS = (
    ("matmul", re.compile(r"^triton_tem_|^triton_\w*?_(mm|addmm|bmm|mv)(_|$)")),
    ("fused by inductor", re.compile(r"^triton_")),
    ("attention", re.compile(r"flash|fmha|attention|attn|sdpa|cudnn", re.I)),
    ("matmul", re.compile(r"gemm|gemv|nvjet|cutlass|xmma|splitk|cublas|wgmma", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy|index_put|scatter", re.I)),
)


def kind_of(kernel: str) -> str:
    return next((kind for kind, pattern in KINDS if pattern.search(kernel)), "other")


def linear_weights(model) -> list[torch.Tensor]:
    """The weights of every linear layer one decoding step multiplies by: the language model's and the LM head."""
    parts = [model.model.language_model, model.get_output_embeddings()]
    return [m.weight for part in parts for m in part.modules() if isinstance(m, torch.nn.Linear)]


def event_ms(fn, repeats: int) -> list[float]:
    """``fn``'s GPU time per call (ms), CUDA events around each of ``repeats`` calls after two untimed ones."""
    times = []
    for i in range(repeats + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end))
    return times


def matmuls_alone(model, repeats: int) -> list[float]:
    """ms per replay of one CUDA graph holding every linear layer of a step applied to one token."""
    weights = linear_weights(model)
    inputs = {w.shape[1]: torch.randn(1, w.shape[1], dtype=w.dtype, device=w.device) for w in weights}
    with torch.inference_mode():
        for w in weights:  # warm cuBLAS up outside the capture (it picks its kernels at a first call)
            F.linear(inputs[w.shape[1]], w)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for w in weights:
                F.linear(inputs[w.shape[1]], w)
        return event_ms(graph.replay, repeats)


def kernel_profile(step, steps: int) -> tuple[dict[str, float], list[tuple[str, float, int]], int]:
    """The kernels ``steps`` calls of ``step`` ran: ms per step by kind, the top kernels (name, ms per step, calls
    per step), and how many kernel events the profiler saw (0: it saw none inside the CUDA graph)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    by_name: dict[str, list[float]] = defaultdict(list)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time > 0:
            by_name[event.name].append(event.device_time / 1000)  # µs -> ms
    by_kind: dict[str, float] = defaultdict(float)
    for name, times in by_name.items():
        by_kind[kind_of(name)] += sum(times) / steps
    top = sorted(((name, sum(t) / steps, len(t) // steps) for name, t in by_name.items()), key=lambda x: -x[1])
    return dict(by_kind), top[:12], sum(len(t) for t in by_name.values())


#: Inductor's own matmul templates, tuned per shape (``mode="max-autotune"``'s options), with coordinate-descent
#: tuning of the other kernels: what ``--autotune`` adds to the engine's options (CUDA graphs, no guards).
AUTOTUNE = {"max_autotune": True, "coordinate_descent_tuning": True}


def text_forward(model):
    """The forward of the engine's compiled step on text tokens (``compiled.compiled_forward``'s, its logits only):
    ``(input_ids, position_ids, cache) -> logits``, embedding, the language decoder and the LM head."""
    from mmspec_cli.models.parts import text_decoder, with_cache

    decoder, embed, lm_head = text_decoder(model), model.get_input_embeddings(), model.get_output_embeddings()

    def forward(input_ids, position_ids, cache):
        out = decoder(inputs_embeds=embed(input_ids), position_ids=position_ids, **with_cache(cache), use_cache=True)
        return lm_head(out.last_hidden_state)

    return forward


def compiled_step(models, seq: int, capacity: int, rounds: int, profile_steps: int, record,
                  autotune: bool = False) -> torch.Tensor:
    """Part 3: the engine's compiled one-token step after ``seq`` cached tokens in a state of ``capacity`` slots
    (``autotune``: the same forward compiled here with :data:`AUTOTUNE` added to the engine's options). Returns the
    step's logits (1, V)."""
    from mmspec_cli.decoding.compiled import compile_options, compiled_forward
    from mmspec_cli.decoding.kv_state import StaticKV
    from mmspec_cli.models.parts import with_cache
    from mmspec_cli.models.positions import TEXT_POSITIONS

    model = models.target.model
    device = model.device
    vocab = model.get_output_embeddings().weight.shape[0]
    prefix = torch.randint(5, vocab, (1, seq), generator=torch.Generator().manual_seed(0)).to(device)
    state = StaticKV(model.config, capacity)
    ids, positions = torch.full((1, 1), 7, device=device), TEXT_POSITIONS.chain(seq, 1).to(device)
    if autotune:  # the engine's step forward, compiled with other options
        graph = torch.compile(text_forward(model), dynamic=False, options={**compile_options(device), **AUTOTUNE})

        def step():
            state.rollback(seq)
            logits = graph(ids, positions, state.cache)
            state.wrote(1)
            return logits[0]
    else:
        compiled = compiled_forward(model, "target")

        def step():
            state.rollback(seq)
            out = compiled(state, ids, positions, None)
            assert out is not None, f"the step ran eager: {compiled.failed}"
            return out[0][0]

    began = time.perf_counter()
    with torch.inference_mode():
        model(input_ids=prefix, **with_cache(state.cache), use_cache=True,
              position_ids=TEXT_POSITIONS.chain(0, seq).to(device))
        state.wrote(seq)
        logits = step().float().clone()  # compiles
        synchronize(device)
        compile_s = time.perf_counter() - began
        medians = []
        for _ in range(rounds):
            times = []
            for _ in range(20):
                synchronize(device)
                start = time.perf_counter()
                step()
                synchronize(device)
                times.append((time.perf_counter() - start) * 1000)
            medians.append(statistics.median(times[3:]))
        kinds, top, seen = {}, [], 0
        if device.type == "cuda":
            try:
                kinds, top, seen = kernel_profile(step, profile_steps)
            except Exception as error:  # a profiler that fails here must not lose the timings above
                print(f"  the profiler failed: {type(error).__name__}: {error}")
    wall = statistics.median(medians)
    kernels = sum(kinds.values())
    label = "compiled step with --autotune's options" if autotune else "compiled step"
    print(f"\n{label}, 1 token after {seq} cached, capacity {capacity}: compiled in {compile_s:.1f} s; wall "
          f"{spread(medians)} ms per step (median of {rounds} medians of 17)", flush=True)
    if seen:
        print(f"  kernels {kernels:.3f} ms per step ({seen // profile_steps} kernel launches per step), idle "
              f"{wall - kernels:.3f} ms: " + ", ".join(f"{k} {v:.3f}" for k, v in sorted(kinds.items(), key=lambda x: -x[1])))
        for name, ms, calls in top:
            print(f"    {ms:7.3f} ms  x{calls:<4d} {kind_of(name):17s} {name[:100]}")
    elif device.type == "cuda":
        print("  the profiler saw no kernel inside the CUDA graph's replay (its CUPTI does not trace graph nodes)")
    record(kind="compiled_step", autotune=autotune, seq=seq, capacity=capacity, compile_s=compile_s,
           wall_ms=medians, kernel_ms=kinds, kernel_launches=seen / max(profile_steps, 1), top=top)
    return logits


def prefill_parts(models, rounds: int, record) -> None:
    """Part 4: the processor, the forward with the image, the same with text in the image's slots, eager and
    compiled (one fixed shape, no CUDA graphs)."""
    from mmspec_cli.inputs.sources import resolve
    from mmspec_cli.decoding.kv_state import StaticKV, static_capacity
    from mmspec_cli.models.parts import with_cache
    from mmspec_cli.models.positions import TEXT_POSITIONS
    from mmspec_cli.models.prompts import render_prompt

    target = models.target
    model, device = target.model, target.model.device
    sample = resolve("demo-single", 1)[0]
    images = pictures(sample)
    text = render_prompt(target.processor, [sample.turns[0]], [], len(images))

    def processor():
        return target.processor(images=images or None, text=text, return_tensors="pt")

    processor_ms = []
    for _ in range(rounds):
        start = time.perf_counter()
        inputs = processor()
        processor_ms.append((time.perf_counter() - start) * 1000)
    inputs = inputs.to(device)
    pixels = inputs["pixel_values"].to(model.dtype)
    ids = inputs["input_ids"]
    length = ids.shape[1]
    text_ids = ids.masked_fill(ids == model.config.image_token_index, 7)
    positions = TEXT_POSITIONS.chain(0, length).to(device)
    state = StaticKV(model.config, static_capacity(length + 64))
    forward = text_forward(model)
    compiled_text = torch.compile(forward, dynamic=False)

    def timed(fn) -> list[float]:
        times = []
        for i in range(rounds + 1):
            state.rollback(0)
            synchronize(device)
            start = time.perf_counter()
            fn()
            synchronize(device)
            if i:
                times.append((time.perf_counter() - start) * 1000)
        return times

    with torch.inference_mode():
        state.rollback(0)
        eager_logits = forward(text_ids, positions, state.cache)[0].float()
        state.wrote(length)
        began = time.perf_counter()
        state.rollback(0)
        compiled_logits = compiled_text(text_ids, positions, state.cache)[0].float()
        synchronize(device)
        compile_s = time.perf_counter() - began
        largest = (compiled_logits - eager_logits).abs().max().item()
        same = bool((compiled_logits.argmax(-1) == eager_logits.argmax(-1)).all())
        found = {"with image": [], "text only": [], "text only, compiled": []}
        for _ in range(3):  # interleaved
            found["with image"] += timed(lambda: model(input_ids=ids, pixel_values=pixels, **with_cache(state.cache),
                                                       use_cache=True, position_ids=positions, logits_to_keep=1))
            found["text only"] += timed(lambda: forward(text_ids, positions, state.cache))
            found["text only, compiled"] += timed(lambda: compiled_text(text_ids, positions, state.cache))
    print(f"\nprefill of {length} tokens (one image), ms: processor (host) {spread(processor_ms)}", flush=True)
    for name, times in found.items():
        print(f"  forward, {name}: {spread(times)}")
    print(f"  compiling the text forward took {compile_s:.1f} s; its logits against eager: largest difference "
          f"{largest:.3g}, same argmax at every position: {same}")
    record(kind="prefill", length=length, processor_ms=processor_ms, forward_ms=found, compile_s=compile_s,
           largest_difference=largest, same_argmax=same)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=640, help="cached tokens before the timed step")
    parser.add_argument("--capacities", default="1024,4096", help="static state capacities, comma-separated")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--prefill", action="store_true", help="also take the prefill apart (part 4)")
    parser.add_argument("--autotune", action="store_true",
                        help="also the step compiled with inductor's tuned matmul templates, at the first capacity")
    parser.add_argument("--out", type=Path, default=Path("results/cuda-step"))
    parser.add_argument("--small", action="store_true", help=SMALL_HELP)
    args = parser.parse_args()
    device = chosen_device(args.small)
    record = results_log(args.out)
    print(f"machine: {machine()}", flush=True)
    models = build(0, 128, device, SMALL if args.small else FULL, torch.float32 if args.small else torch.float16)
    model = models.target.model
    weights = language_model_bytes(model)
    linear = sum(w.numel() * w.element_size() for w in linear_weights(model))
    if device == "cuda":
        bandwidth = copy_bandwidth()
        floor, linear_floor = 1000 * weights / bandwidth, 1000 * linear / bandwidth
        alone = matmuls_alone(model, 50)
        print(f"weights read per step: {weights / 1e9:.2f} GB (linear layers {linear / 1e9:.2f} GB); copy bandwidth "
              f"{bandwidth / 1e12:.2f} TB/s: floor {floor:.2f} ms, linear layers' floor {linear_floor:.2f} ms", flush=True)
        print(f"the matmuls alone (one CUDA graph, {len(linear_weights(model))} linear layers, one token): "
              f"{spread(alone)} ms: {linear_floor / statistics.median(alone):.2f} of the linear floor", flush=True)
        record(kind="floor", machine=machine(), bandwidth=bandwidth, weights=weights, linear_weights=linear,
               floor_ms=floor, linear_floor_ms=linear_floor, matmuls_alone_ms=alone)
    capacities = [int(c) for c in args.capacities.split(",")]
    engine = [compiled_step(models, args.seq, capacity, args.rounds, 20, record) for capacity in capacities]
    if args.autotune:
        tuned = compiled_step(models, args.seq, capacities[0], args.rounds, 20, record, autotune=True)
        largest = (tuned - engine[0]).abs().max().item()
        same = bool(tuned.argmax(-1) == engine[0].argmax(-1))
        print(f"  its logits against the engine step's: largest difference {largest:.3g}, same argmax: {same}")
        record(kind="autotune_logits", largest_difference=largest, same_argmax=same)
    if args.prefill:
        prefill_parts(models, args.rounds, record)


if __name__ == "__main__":
    main()
