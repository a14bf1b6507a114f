"""The CUDA paths on a GPU, with the shipped demo family: what no CPU run exercises.

One run, on one CUDA device, for each dtype asked (float32, float16):

1. **Losslessness on the GPU.** Every drafter decodes the first N samples of ``demo-single`` and
   ``demo-pair`` (interleaved: sample by sample, drafter by drafter, on the same loaded models);
   its greedy token ids are compared with ``ar``'s on the same sample. Half precision is where a
   target verifying γ+1 tokens in one forward and decoding one token at a time can round
   differently; the count of samples that differ is printed, not hidden.
2. **Walltime.** Per drafter: block efficiency τ, and the measured speedup = ar's seconds per token /
   the drafter's, over the same samples (median of the per-sample ratios, with the spread), from the
   last of ``--passes`` passes (the first pass meets each new shape's first-call costs).
3. **Caption/prefill overlap** (only on CUDA by default): ``c`` with ``overlap_prefill`` on and off,
   interleaved, the captioner's cache cleared before each run; the whole ``generate`` call is timed.
4. **CUDA-event latency**: ``profile-latency``'s own measurement (``bench.latency.measure`` with a
   CUDA-event ``Timer``): T_p, T_q and c = T_q / T_p at a few grid points.

    python benchmarks/bench_cuda.py [--samples N] [--passes P] [--dtypes float32,float16] [--out DIR]

The script exits 0 whatever it measures; it needs a CUDA device.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

from mmspec_cli.api import ModelSet
from mmspec_cli.bench import latency
from mmspec_cli.inputs.samples import load_sample_images
from mmspec_cli.inputs.sources import demo_suite
from mmspec_cli.drafters import captioner as captioner_module
from mmspec_cli.models.profiles import load_profile

DRAFTERS = ("ar", "m", "t", "c", "p", "mt", "tabed", "ssd")
SUITES = ("demo-single", "demo-pair")


def machine() -> dict:
    return {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version()}


def profile_for(dtype: str):
    """The demo profile with every model on CUDA in ``dtype``."""
    profile = load_profile("demo")
    changes = {role: dataclasses.replace(getattr(profile, role), dtype=dtype, device="cuda")
               for role in ("target", "draft", "captioner")}
    return dataclasses.replace(profile, **changes)


def timed(call):
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = call()
    torch.cuda.synchronize()
    return out, time.perf_counter() - start


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.3f} [{min(values):.3f}, {max(values):.3f}]"


def decode_all(models: ModelSet, samples: list, drafters: tuple[str, ...], passes: int) -> dict:
    """Interleaved runs: per drafter, the token ids, τ and seconds per token of every sample, from the
    last of ``passes`` passes over the samples (the first meets every shape's first-call costs)."""
    loaded = [(s, load_sample_images(s)) for s in samples]
    for _ in range(passes - 1):
        _one_pass(models, loaded, drafters)
    return _one_pass(models, loaded, drafters)


def _one_pass(models: ModelSet, loaded: list, drafters: tuple[str, ...]) -> dict:
    first, images = loaded[0]
    for name in drafters:  # warm-up: CUDA context, kernels, allocator
        models.decoder(name).generate(images, list(first.turns), history=first.history, max_new_tokens=8)
    runs = {name: [] for name in drafters}
    for sample, images in loaded:
        for name in drafters:
            generation, _ = timed(lambda: models.decoder(name).generate(images, list(sample.turns),
                                                                      history=sample.history))
            stats = generation.stats
            runs[name].append({"id": sample.id, "tokens": [t.token_ids for t in generation.turns],
                               "tau": stats.block_efficiency,
                               "s_per_token": stats.wall_s / max(stats.new_tokens, 1)})
    return runs


def summarise(runs: dict) -> list[dict]:
    reference = runs["ar"]
    rows = []
    for name, per_sample in runs.items():
        differ = [r["id"] for r, a in zip(per_sample, reference) if r["tokens"] != a["tokens"]]
        ratios = [a["s_per_token"] / r["s_per_token"] for r, a in zip(per_sample, reference)]
        rows.append({"drafter": name, "samples": len(per_sample), "differ_from_ar": len(differ),
                     "differing_ids": differ[:5], "tau": statistics.fmean(r["tau"] for r in per_sample),
                     "speedup_median": statistics.median(ratios), "speedup_min": min(ratios),
                     "speedup_max": max(ratios)})
    return rows


def overlap(models: ModelSet, samples: list, repeats: int) -> dict:
    """``c`` with the caption overlapped with the target's prefill, and without: whole-call seconds."""
    loaded = [(s, load_sample_images(s)) for s in samples]
    times = {True: [], False: []}
    tokens = {True: [], False: []}
    for _ in range(repeats):
        for sample, images in loaded:
            for on in (True, False):
                captioner_module._CACHE.clear()  # caption every time, as a new image would be
                decoder = models.decoder("c")
                decoder.overlap_prefill = on
                generation, seconds = timed(lambda: decoder.generate(images, list(sample.turns),
                                                                     history=sample.history))
                times[on].append(seconds)
                tokens[on].append([t.token_ids for t in generation.turns])
    return {"on_s": spread(times[True]), "off_s": spread(times[False]),
            "ratio_off_over_on": statistics.median(times[False]) / statistics.median(times[True]),
            "same_tokens": tokens[True] == tokens[False]}


def cuda_latency(models: ModelSet, profile) -> dict:
    timer = latency.Timer(models.target.model.device, warmup=3, repeat=30)
    result = latency.measure(models.target.model, models.draft.model, profile.target.model, profile.draft.model,
                             [1, 2, 4], [128, 512], [1, 5], timer)
    return {"device": result.device, "target_ms": result.target_ms, "draft_ms": result.draft_ms,
            "c_B1_S128_g5": result.ratio(1, 128, 5), "c_B2_S128_g5": result.ratio(2, 128, 5),
            "remarks": [dataclasses.asdict(r) for r in latency.check_remarks(result)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=10, help="samples per suite")
    parser.add_argument("--dtypes", default="float32,float16")
    parser.add_argument("--drafters", default=",".join(DRAFTERS))
    parser.add_argument("--passes", type=int, default=2, help="passes over the samples; the last is reported")
    parser.add_argument("--overlap-repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_cuda.py needs a CUDA device")
    drafters = tuple(args.drafters.split(","))
    samples = [s for suite in SUITES for s in demo_suite(suite, args.samples)]
    report = {"machine": machine(), "samples": len(samples), "results": {}}
    print(json.dumps(report["machine"]))
    for dtype in args.dtypes.split(","):
        profile = profile_for(dtype)
        models = ModelSet.load(profile, list(drafters))
        rows = summarise(decode_all(models, samples, drafters, args.passes))
        result = {"drafters": rows, "overlap": overlap(models, samples[:3], args.overlap_repeats),
                  "latency": cuda_latency(models, profile)}
        report["results"][dtype] = result
        print(f"\n== {dtype} on {report['machine']['gpu']}: {len(samples)} samples ({', '.join(SUITES)}) ==")
        print(f"{'drafter':>8}  {'τ':>5}  {'speedup median [min, max]':>28}  differ from ar")
        for r in rows:
            print(f"{r['drafter']:>8}  {r['tau']:5.2f}  {r['speedup_median']:8.3f} "
                  f"[{r['speedup_min']:.3f}, {r['speedup_max']:.3f}]{'':>6}  {r['differ_from_ar']}/{r['samples']}")
        o = result["overlap"]
        print(f"caption/prefill overlap (c, whole call s): on {o['on_s']}  off {o['off_s']}  "
              f"off/on {o['ratio_off_over_on']:.3f}  same tokens: {o['same_tokens']}")
        lat = result["latency"]
        print(f"CUDA events: c(B=1, S=128, γ=5) = {lat['c_B1_S128_g5']:.3f}, c(B=2) = {lat['c_B2_S128_g5']:.3f}; "
              + "; ".join(f"Remark {r['remark']} worst {r['worst']:.1%}" for r in lat["remarks"]))
        del models
        torch.cuda.empty_cache()
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_cuda.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
