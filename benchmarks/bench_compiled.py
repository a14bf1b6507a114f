"""Eager against compiled (``--compile``), and both against HF ``generate``, on the demo family (issue 20).

One process, greedy, the first turn of the first ``--limit`` samples of demo-single and demo-story.
For each sample, in an order that rotates from sample to sample (so every configuration sees the same
load): HF ``generate`` of the target, then mmspec eager (``kv="dynamic"``) and compiled for ``ar, m, tabed,
eagle, vispec, oracle`` as chains, and ``eagle``/``vispec`` with the dynamic tree (EAGLE-2, budget 30).
Every output is checked against HF's, token for token. Compilation happens before the timed samples
(a warm-up pass over the first sample), and ``TurnClock`` leaves any later compile out of a turn's time.

Printed, per configuration: ms per token (median over samples of each sample's time / tokens, with the
lower and upper quartile), block efficiency τ, the speedup over HF ``generate`` and over ``ar`` of the
same mode, and Eq. (1) (TABED: τ / (γ·c + 1)) with c measured in the same run: the drafter's draft time
per drafted token over ``ar``'s time per token of the same mode. Then the same after the prefill: every
block but each turn's first (whose verification also reads the prompt, eager, with its image), summed
over the samples: what the loop itself costs per token, which Eq. (1) and the oracle's bound describe. ``oracle`` is set against its bound
(γ + 1) · T(1) / T(γ + 1), with T(n) the target's step of n tokens after 128 cached ones, timed here
eager (the dynamic cache) and compiled (the static state), interleaved.

HF ``generate`` is timed twice: the call alone (its processor outside the clock, as earlier runs reported it),
and with its processor call (tokenizing, preparing the pixels) inside, as mmspec's turns are timed (a turn's
time includes its own processor call): from the prompt's text and images to the tokens, for both. Both
ratios are printed.

``--cold`` also measures compile time in two fresh processes sharing an empty inductor cache: the first
compiles from nothing, the second finds the first's code on disk.

    python benchmarks/bench_compiled.py [--limit 10] [--cold] [--configs ar,m,eagle,eagle+tree] [--gamma 5]

``--configs`` runs fewer drafters (``ar`` always runs: every ratio is over it); on a GPU, compiling every
drafter's steps for CUDA graphs takes minutes, so a short lease runs a few.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from bench_demo_suites import machine

GAMMA = 5
SEQ = 128
CHAINS = ["ar", "m", "tabed", "eagle", "vispec", "oracle"]
TREES = ["eagle", "vispec"]


def quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q = statistics.quantiles(values, n=4)
    return statistics.median(values), q[0], q[2]


def load():
    from mmspec_cli.api import ModelSet
    from mmspec_cli.models.profiles import load_profile

    profile = load_profile(None)
    models = ModelSet.load(profile, CHAINS, threads=1)
    return profile, models


ALL_CONFIGS = CHAINS + [f"{t}+tree" for t in TREES]


def decoders(models, recorded, configs: list[str] = ALL_CONFIGS) -> dict[str, object]:
    """name -> decoder, for every mode and each of ``configs`` (a drafter, or ``drafter+tree`` for its dynamic
    tree; oracle replays ``recorded``, HF's output)."""
    from mmspec_cli.decoding.engine import SpeculativeDecoder

    built = {}
    for mode, kv in (("eager", "dynamic"), ("compiled", "compiled")):
        for name in configs:
            drafter = name.split("+")[0]
            base = models.decoder(drafter, recorded=recorded if drafter == "oracle" else None)
            tree = {"tree": "dynamic"} if name.endswith("+tree") else {}
            built[f"{name} {mode}"] = SpeculativeDecoder(base.target, base.drafter, gamma=GAMMA, max_new_tokens=160,
                                                         kv=kv, **tree)
    return built


def pictures(sample) -> list:
    """A sample's images as PIL images (the demo suites hold them already; a manifest names files)."""
    from mmspec_cli.images import load_image

    return [p if hasattr(p, "convert") else load_image(p) for p in sample.images]


def hf_generate(target, sample, max_new_tokens: int = 160, processor_s: list | None = None) -> tuple[list[int], float]:
    """HF ``generate``'s greedy tokens and its seconds. Its processor (tokenizing, preparing the pixels) runs before
    the clock starts; when ``processor_s`` is given, the processor's seconds are appended to it, so a caller can
    also time HF from the prompt's text and images, as mmspec's turns are timed (their processor call included)."""
    from mmspec_cli.models.prompts import render_prompt

    images = pictures(sample)
    text = render_prompt(target.processor, [sample.turns[0]], [], len(images))
    start = time.perf_counter()
    inputs = target.processor(images=images or None, text=text, return_tensors="pt").to(target.model.device)
    if "pixel_values" in inputs:
        inputs["pixel_values"] = inputs["pixel_values"].to(target.model.dtype)
    if processor_s is not None:
        processor_s.append(time.perf_counter() - start)
    synchronize(target.model.device)
    start = time.perf_counter()
    out = target.model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens)
    synchronize(target.model.device)
    seconds = time.perf_counter() - start
    return out[0, inputs["input_ids"].shape[1]:].tolist(), seconds


def synchronize(device: torch.device) -> None:
    """Wait for the GPU's queued work before a host clock is read (nothing to wait for on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_times(models, rounds: int = 7, seq: int = SEQ, gamma: int = GAMMA) -> dict[str, dict[int, float]]:
    """The target's step of 1 and γ + 1 tokens after ``seq`` cached ones, eager and compiled, median of ``rounds``
    interleaved medians of 20 (ms); on a GPU each step is waited for before the clock is read."""
    from mmspec_cli.decoding.compiled import compiled_forward
    from mmspec_cli.decoding.kv_state import DynamicKV, HeldState, static_pool
    from mmspec_cli.models.parts import with_cache
    from mmspec_cli.models.positions import TEXT_POSITIONS

    model = models.target.model
    device = model.device
    vocab = model.get_output_embeddings().weight.shape[0]
    prefix = torch.randint(5, vocab, (1, seq), generator=torch.Generator().manual_seed(0)).to(device)
    compiled = compiled_forward(model, "target")
    static = HeldState(model.config, static_pool(model), "target").restart(seq + 64)  # held while this times it
    dynamic = DynamicKV(config=model.config)
    with torch.inference_mode():
        for state in (static, dynamic):
            model(input_ids=prefix, **with_cache(state.cache), use_cache=True,
                  position_ids=TEXT_POSITIONS.chain(0, seq).to(device))
            state.wrote(seq)

        def eager(n):
            ids = torch.full((1, n), 7, device=device)
            model(input_ids=ids, **with_cache(dynamic.cache), use_cache=True,
                  position_ids=TEXT_POSITIONS.chain(seq, n).to(device), logits_to_keep=n)
            dynamic.wrote(n)

        def fast(n):
            compiled(static, torch.full((1, n), 7, device=device), TEXT_POSITIONS.chain(seq, n).to(device), None)

        found = {"eager": {1: [], gamma + 1: []}, "compiled": {1: [], gamma + 1: []}}
        for _ in range(rounds):
            for mode, step, state in (("eager", eager, dynamic), ("compiled", fast, static)):
                for n in found[mode]:
                    times = []
                    for _ in range(25):
                        state.rollback(seq)
                        synchronize(device)
                        start = time.perf_counter()
                        step(n)
                        synchronize(device)
                        times.append(time.perf_counter() - start)
                    found[mode][n].append(statistics.median(times[5:]) * 1000)
    return {mode: {n: statistics.median(v) for n, v in sizes.items()} for mode, sizes in found.items()}


def cold_compile() -> list[float]:
    """Compile seconds of two fresh processes over one empty inductor cache (the first and the second)."""
    cache = tempfile.mkdtemp(prefix="mmspec-inductor-")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
    code = f"import sys; sys.path.insert(0, 'benchmarks'); import bench_compiled as b; b.GAMMA = {GAMMA}; b.compile_once()"
    seconds = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
        line = [x for x in done.stdout.splitlines() if x.startswith("compile_s ")]
        if not line:
            raise SystemExit(f"the compile probe failed: {done.stderr[-800:]}")
        seconds.append(float(line[0].split()[1]))
    return seconds


def compile_once() -> None:
    """Decode the first demo-single sample with ar and m compiled (the demo pair's steps); print compile_s."""
    from mmspec_cli.inputs.sources import resolve
    from mmspec_cli.decoding.compiled import LOG

    torch.set_num_threads(1)
    _, models = load()
    sample = resolve("demo-single", 1)[0]
    images = pictures(sample)
    for drafter in ("ar", "m"):
        base = models.decoder(drafter)
        from mmspec_cli.decoding.engine import SpeculativeDecoder

        SpeculativeDecoder(base.target, base.drafter, gamma=GAMMA, max_new_tokens=160, kv="compiled").generate(
            images, [sample.turns[0]])
    print(f"compile_s {LOG.total_s:.2f}")


def main() -> None:
    global GAMMA  # --gamma sets the draft length every function here reads
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=10, help="samples per suite (demo-single, demo-story)")
    parser.add_argument("--cold", action="store_true", help="also time compiling in two fresh processes")
    parser.add_argument("--configs", default=",".join(ALL_CONFIGS),
                        help="drafters to run (drafter+tree: its dynamic tree); ar is always run")
    parser.add_argument("--gamma", type=int, default=GAMMA, help="draft length γ of every chain (default 5)")
    args = parser.parse_args()
    GAMMA = args.gamma
    configs = ["ar"] + [c for c in args.configs.split(",") if c and c != "ar"]
    unknown = [c for c in configs if c not in ALL_CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configuration {', '.join(unknown)}: choose from {', '.join(ALL_CONFIGS)}")
    from mmspec_cli.inputs.sources import resolve
    from mmspec_cli.decoding.compiled import LOG

    torch.set_num_threads(1)
    print(f"machine: {machine()}")
    samples = resolve("demo-single", args.limit) + resolve("demo-story", args.limit)
    profile, models = load()
    times: dict[str, list[float]] = {}
    stats: dict[str, dict[str, float]] = {}
    mismatches: list[str] = []
    warm, warm_start = True, time.perf_counter()
    for index, sample in enumerate([samples[0]] + samples):  # the first pass compiles, untimed
        images = pictures(sample)
        processor_s: list[float] = []
        reference, hf_s = hf_generate(models.target, sample, processor_s=processor_s)
        built = decoders(models, [reference], configs)
        names = list(built)
        shift = index % len(names)
        if not warm:
            times.setdefault("HF generate", []).append(1000 * hf_s / len(reference))
            times.setdefault("HF processor + generate", []).append(1000 * (hf_s + processor_s[0]) / len(reference))
        for name in names[shift:] + names[:shift]:
            with torch.inference_mode():
                turn = built[name].generate(images, [sample.turns[0]]).turns[0]
            if turn.token_ids != reference:
                mismatches.append(f"{sample.id} {name}")
            if warm:
                continue
            times.setdefault(name, []).append(1000 * turn.stats.wall_s / len(turn.token_ids))
            s = stats.setdefault(name, {"tokens": 0, "blocks": 0, "drafted": 0, "draft_s": 0.0, "later_s": 0.0,
                                        "later_tokens": 0})
            s["tokens"] += turn.stats.new_tokens
            s["blocks"] += turn.stats.blocks
            s["drafted"] += sum(len(b.draft) for b in turn.blocks)
            s["draft_s"] += sum(b.draft_s for b in turn.blocks)
            later = turn.blocks[1:]  # the first block's verification also reads the prompt (the prefill)
            s["later_s"] += sum(b.draft_s + b.verify_s + b.update_s for b in later)
            s["later_tokens"] += sum(len(b.tokens) for b in later)
        if warm:
            print(f"warm-up ({time.perf_counter() - warm_start:.0f} s): {LOG.summary()}", flush=True)
            if not LOG.compiles:  # every compiled step fell back to eager (stderr says why): the table would mislead
                raise SystemExit("nothing compiled in the warm-up: the compiled rows would be eager (stderr says why)")
        warm = False
    steps = step_times(models, gamma=GAMMA)
    hf = quartiles(times["HF generate"])[0]
    hf_all = quartiles(times["HF processor + generate"])[0]
    print(f"\n{len(samples)} samples (first turn), greedy, γ = {GAMMA}; outputs identical to HF generate: "
          f"{'all' if not mismatches else 'NOT ' + ', '.join(mismatches)}")
    print(f"HF generate: {hf:.2f} ms/token; with its processor (as mmspec's turns are timed): {hf_all:.2f} ms/token")
    print("\n configuration | ms/token [q1, q3] | τ | over HF | over ar | Eq. (1) | measured / Eq. (1) | "
          "after the prefill: ms/token, over ar, / Eq. (1)")
    rows = {}
    for name in [n for n in times if not n.startswith("HF ")]:
        median, q1, q3 = quartiles(times[name])
        mode = name.split()[1]
        ar = quartiles(times[f"ar {mode}"])[0]
        s = stats[name]
        tau = s["tokens"] / s["blocks"]
        over_ar = ar / median
        c = (s["draft_s"] / s["drafted"] * 1000) / ar if s["drafted"] else 0.0
        gamma = s["drafted"] / s["blocks"]  # the mean draft length (a tree: its levels' nodes on the followed path)
        eq1 = tau / (GAMMA * c + 1) if not name.startswith(("ar", "oracle")) and "+tree" not in name else None
        later = 1000 * s["later_s"] / s["later_tokens"]
        ar_s = stats[f"ar {mode}"]
        later_over_ar = (1000 * ar_s["later_s"] / ar_s["later_tokens"]) / later
        rows[name] = {"ms": median, "tau": tau, "over_hf": hf / median, "over_ar": over_ar, "eq1": eq1,
                      "later_ms": later, "later_over_ar": later_over_ar}
        print(f" {name} | {median:.2f} [{q1:.2f}, {q3:.2f}] | {tau:.2f} | {hf / median:.2f}x | {over_ar:.2f}x | "
              + (f"{eq1:.2f}x | {over_ar / eq1:.2f}" if eq1 else "- | -")
              + f" | {later:.2f}, {later_over_ar:.2f}x" + (f", {later_over_ar / eq1:.2f}" if eq1 else "")
              + f"  (γ̄ {gamma:.2f}, c {c:.3f})")
    print("\n target step after 128 cached tokens (ms, median of 7 interleaved rounds): "
          + "; ".join(f"{mode}: 1 token {v[1]:.2f}, {GAMMA + 1} tokens {v[GAMMA + 1]:.2f}" for mode, v in steps.items()))
    for mode in ("eager", "compiled") if "oracle" in configs else ():
        bound = (GAMMA + 1) * steps[mode][1] / steps[mode][GAMMA + 1]
        measured, later = rows[f"oracle {mode}"]["over_ar"], rows[f"oracle {mode}"]["later_over_ar"]
        print(f" oracle {mode}: {measured:.2f}x over ar, bound {bound:.2f}x, measured / bound {measured / bound:.2f}; "
              f"after the prefill {later:.2f}x, / bound {later / bound:.2f}")
    print(f" ar compiled / HF generate: {rows['ar compiled']['ms'] / hf:.2f}; / HF with its processor: "
          f"{rows['ar compiled']['ms'] / hf_all:.2f}")
    drafters = [n for n in rows if n.endswith("compiled") and not n.startswith(("oracle", "ar "))]
    if drafters:
        best_name = max(drafters, key=lambda n: rows[n]["over_hf"])
        best = rows[best_name]
        print(f" best drafter compiled: {best_name}, {best['over_hf']:.2f}x over HF generate, "
              f"{hf_all / best['ms']:.2f}x over HF with its processor")
    print(f" {LOG.summary()}")
    if args.cold:
        first, second = cold_compile()
        print(f" compile time of ar + m (the demo pair's steps) in a fresh process: first {first:.1f} s, "
              f"second {second:.1f} s (inductor's cache on disk)")
    print(json.dumps({"rows": rows, "steps": steps, "hf_ms": hf, "hf_with_processor_ms": hf_all}), file=sys.stderr)
    print(f"\nmachine: {machine()}")


if __name__ == "__main__":
    main()
