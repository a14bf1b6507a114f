"""A LLaVA-1.5-7B-shaped target on one CUDA GPU, random float16 weights built from its config (issue 20).

No download: the model is LLaVA-1.5-7B's shape (a 32-layer, 4096-wide Llama with a 32064-token vocabulary behind
a 24-layer CLIP ViT-L/14 at 336 px, 576 image tokens) with random weights, and its processor is the demo
family's tokenizer and chat template with a 336 px CLIP image processor. The target can emit ids the tokenizer
does not know; they decode to nothing, as with any target trained by someone else.

One process, greedy, γ = 5, the first turn of ``--samples`` demo-single samples (one image each). For each
sample, in an order that rotates from sample to sample: HF ``generate``, then mmspec eager (``kv="dynamic"``)
and compiled (``kv="compiled"``: CUDA graphs through ``torch.compile(mode="reduce-overhead")``) for ``ar``,
``oracle`` (replaying the same mode's ``ar`` output) and ``ssd`` (the first ``--ssd-layer`` layers draft).
A first, untimed pass over the first sample compiles every step shape.

Printed:
- the memory-bandwidth floor of one decoding step: the bytes of the language model's weights (read once per
  token) over the device-to-device copy bandwidth measured here (bytes read + written); and ``ar``'s
  ms per token against it, eager and compiled, and HF ``generate``'s;
- every drafter's ms per token (median over samples, [min, max]), τ, speedup over ``ar`` of the same mode;
- ``oracle`` against its bound (γ + 1) · T(1) / T(γ + 1), T(n) the target's step of n tokens after ``--seq``
  cached tokens, eager and compiled, timed here;
- which outputs differ from HF ``generate``'s (float16: a compiled kernel may round differently from the eager
  one, so compiled outputs are compared with eager ``ar``'s and the differences counted, not hidden).

Every result is appended to ``--out``/results.jsonl as it is measured, so an interrupted run keeps them.

    python benchmarks/bench_cuda_7b.py [--samples 3] [--tokens 128] [--ssd-layer 8] [--out DIR]

It needs a CUDA device with about 20 GB free; it exits 0 whatever it measures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from bench_compiled import hf_generate, pictures, step_times, synchronize
from bench_demo_suites import machine

GAMMA = 5
IMAGE_SIZE, PATCH = 336, 14


#: LLaVA-1.5-7B's language model (llava-hf/llava-1.5-7b-hf); ``--small`` shrinks it to check this script on a CPU.
FULL = {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 32}
SMALL = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 4}


def llava15_7b_config(tokenizer, shape: dict):
    """LLaVA-1.5-7B's configuration (llava-hf/llava-1.5-7b-hf), with the demo tokenizer's special ids."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    text = LlamaConfig(**shape, vocab_size=32064, max_position_embeddings=4096, rms_norm_eps=1e-5,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    vision = CLIPVisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                              image_size=IMAGE_SIZE, patch_size=PATCH, projection_dim=768, hidden_act="quick_gelu")
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    return LlavaConfig(text_config=text, vision_config=vision, image_token_index=image_id, vision_feature_layer=-2,
                       vision_feature_select_strategy="default", projector_hidden_act="gelu",
                       image_seq_length=(IMAGE_SIZE // PATCH) ** 2, tie_word_embeddings=False)


def build(ssd_layer: int, tokens: int, device: str, shape: dict, dtype: torch.dtype):
    """The ModelSet of a random float16 LLaVA-1.5-7B-shaped target on ``device``, and its profile."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from mmspec_cli.api import ModelSet
    from mmspec_cli.models.loading import LoadedModel, model_location
    from mmspec_cli.models.profiles import load_profile

    processor = AutoProcessor.from_pretrained(model_location("mmspec:demo-target"))
    processor.image_processor.size = {"shortest_edge": IMAGE_SIZE}
    processor.image_processor.crop_size = {"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    processor.patch_size = PATCH
    torch.manual_seed(0)
    with torch.device(device):
        model = LlavaForConditionalGeneration._from_config(llava15_7b_config(processor.tokenizer, shape),
                                                           dtype=dtype)
    model.eval()
    profile = load_profile(None)
    profile = dataclasses.replace(
        profile, decoding=dataclasses.replace(profile.decoding, gamma=GAMMA, max_new_tokens=tokens),
        ssd=dataclasses.replace(profile.ssd, layer=ssd_layer))
    target = LoadedModel(role="target", name="llava-1.5-7b-shaped (random float16)", model=model, processor=processor)
    return ModelSet(profile=profile, target=target)


def top2_margins(target, sample, reference: list[int]) -> list[float]:
    """The gap between the largest and second largest logit of the target at each of ``reference``'s tokens, from
    one forward over the prompt and the reference (teacher forcing): how close each greedy choice was to a tie."""
    from mmspec_cli.models.prompts import render_prompt

    images = pictures(sample)
    text = render_prompt(target.processor, [sample.turns[0]], [], len(images))
    inputs = target.processor(images=images or None, text=text, return_tensors="pt").to(target.model.device)
    inputs["pixel_values"] = inputs["pixel_values"].to(target.model.dtype)
    answer = torch.tensor([reference], device=target.model.device)
    inputs["input_ids"] = torch.cat([inputs["input_ids"], answer], dim=1)
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    with torch.inference_mode():
        logits = target.model(**inputs, logits_to_keep=len(reference) + 1).logits[0, :-1].float()
    top = logits.topk(2, dim=-1).values
    assert logits.shape[0] == len(reference)
    return (top[:, 0] - top[:, 1]).tolist()


def copy_bandwidth(gib: int = 4, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + written), median of ``repeats`` copies."""
    source = torch.empty(gib * 2**30 // 4, dtype=torch.float32, device="cuda").normal_()
    target = torch.empty_like(source)
    times = []
    for _ in range(repeats + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        target.copy_(source)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    del source, target
    torch.cuda.empty_cache()
    return 2 * gib * 2**30 / statistics.median(times[2:])


def language_model_bytes(model) -> int:
    """Bytes of the weights one decoding step reads: the language model and the LM head (not the vision tower)."""
    parts = [model.model.language_model, model.get_output_embeddings()]
    return sum(p.numel() * p.element_size() for part in parts for p in part.parameters())


SMALL_HELP = "a 4-layer, 256-wide float32 language model on the CPU: a check of this script, not a measurement"


def chosen_device(small: bool) -> str:
    """``cuda``, or the CPU under ``--small``; a machine without CUDA is refused."""
    if not small and not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA device (--small checks the script on a CPU)")
    return "cpu" if small else "cuda"


def results_log(out: Path) -> Callable[..., None]:
    """A function that appends its keywords to ``out``/results.jsonl as one JSON line, at once (``out`` created):
    an interrupted run keeps what it measured."""
    out.mkdir(parents=True, exist_ok=True)
    log = (out / "results.jsonl").open("a")

    def record(**fields) -> None:
        log.write(json.dumps(fields) + "\n")
        log.flush()

    return record


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}, {max(values):.2f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=3, help="demo-single samples (first turn of each)")
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per turn at most")
    parser.add_argument("--ssd-layer", type=int, default=None,
                        help="the target's layers ssd drafts with (default 8; 2 of the 4 under --small)")
    parser.add_argument("--seq", type=int, default=640, help="cached tokens before the timed steps T(1), T(γ+1)")
    parser.add_argument("--modes", default="eager,compiled")
    parser.add_argument("--out", type=Path, default=Path("results/cuda-7b"))
    parser.add_argument("--dtype", default="float16", help="the target's weights (float32 shows what rounding does)")
    parser.add_argument("--small", action="store_true", help=SMALL_HELP)
    args = parser.parse_args()
    device = chosen_device(args.small)
    from mmspec_cli.inputs.sources import resolve
    from mmspec_cli.decoding.compiled import LOG
    from mmspec_cli.decoding.engine import SpeculativeDecoder

    record = results_log(args.out)
    print(f"machine: {machine()}", flush=True)
    bandwidth = copy_bandwidth() if device == "cuda" else float("nan")
    began = time.perf_counter()
    dtype = getattr(torch, args.dtype)
    ssd_layer = args.ssd_layer if args.ssd_layer is not None else (2 if args.small else 8)
    models = build(ssd_layer, args.tokens, device, SMALL if args.small else FULL, dtype)
    synchronize(torch.device(device))
    weights = language_model_bytes(models.target.model)
    floor_ms = 1000 * weights / bandwidth
    print(f"built in {time.perf_counter() - began:.1f} s; language-model weights {weights / 1e9:.2f} GB, copy bandwidth "
          f"{bandwidth / 1e12:.2f} TB/s: floor {floor_ms:.2f} ms/token ({1000 / floor_ms:.0f} tokens/s)", flush=True)
    record(kind="machine", machine=machine(), bandwidth=bandwidth, weights=weights, floor_ms=floor_ms)
    modes = {"eager": "dynamic", "compiled": "compiled"}
    modes = {m: modes[m] for m in args.modes.split(",")}
    samples = resolve("demo-single", args.samples)
    times: dict[str, list[float]] = {}
    taus: dict[str, list[float]] = {}
    differ: dict[str, int] = {}
    after: dict[str, list[float]] = {}  # ms per token of every block but the first
    for index, sample in enumerate([samples[0]] + samples):  # the first pass compiles, untimed
        warm = index == 0
        images = pictures(sample)
        reference, hf_s = hf_generate(models.target, sample, args.tokens)
        margins = top2_margins(models.target, sample, reference)
        if not warm:
            times.setdefault("HF generate", []).append(1000 * hf_s / len(reference))
        order = list(modes.items())
        order = order[index % len(order):] + order[:index % len(order)]
        for mode, kv in order:
            recorded = None
            for drafter in ("ar", "oracle", "ssd"):
                base = models.decoder(drafter, recorded=recorded)
                decoder = SpeculativeDecoder(base.target, base.drafter, gamma=GAMMA, max_new_tokens=args.tokens, kv=kv)
                with torch.inference_mode():
                    turn = decoder.generate(images, [sample.turns[0]]).turns[0]
                if drafter == "ar":
                    recorded = [turn.token_ids]
                name = f"{drafter} {mode}"
                same = turn.token_ids == reference
                first = next((i for i, (a, b) in enumerate(zip(turn.token_ids, reference)) if a != b), None)
                where = "" if same or first is None else (
                    f" at token {first}, where HF's top-2 logit margin is {margins[first]:.4f} (the median margin is "
                    f"{statistics.median(margins):.4f})")
                print(f"{'warm-up ' if warm else ''}{sample.id} {name}: {turn.stats.new_tokens} tokens, "
                      f"{1000 * turn.stats.wall_s / turn.stats.new_tokens:.2f} ms/token, τ "
                      f"{turn.stats.block_efficiency:.2f}, {'same as' if same else 'DIFFERS from'} HF generate{where}",
                      flush=True)
                later = turn.blocks[1:]  # the first block's verification also reads the prompt (the prefill)
                later_s = sum(b.draft_s + b.verify_s + b.update_s for b in later)
                later_tokens = sum(len(b.tokens) for b in later)
                record(kind="turn", warm_up=warm, sample=sample.id, configuration=name, tokens=turn.stats.new_tokens,
                       wall_s=turn.stats.wall_s, tau=turn.stats.block_efficiency, same_as_hf=same,
                       later_s=later_s, later_tokens=later_tokens, first_difference=first,
                       margin_there=None if first is None else margins[first])
                if warm:
                    continue
                if later_tokens:
                    after.setdefault(name, []).append(1000 * later_s / later_tokens)
                differ[name] = differ.get(name, 0) + (not same)
                times.setdefault(name, []).append(1000 * turn.stats.wall_s / turn.stats.new_tokens)
                taus.setdefault(name, []).append(turn.stats.block_efficiency)
        if warm and LOG.summary():
            print(f"warm-up: {LOG.summary()}", flush=True)
    steps = step_times(models, rounds=5, seq=args.seq, gamma=GAMMA) if "compiled" in modes else None
    hf = statistics.median(times["HF generate"])
    print(f"\n{len(samples)} samples, greedy, γ = {GAMMA}, up to {args.tokens} new tokens; memory-bandwidth floor "
          f"{floor_ms:.2f} ms/token")
    print(f" HF generate: {spread(times['HF generate'])} ms/token, floor / it {floor_ms / hf:.2f}")
    print(" configuration | ms/token [min, max] | τ | over ar (same mode) | floor / ms per token | after the prefill: "
          "ms/token, over ar, floor / it | differ from HF")
    for name in [n for n in times if n != "HF generate"]:
        mode = name.split()[1]
        ar, ms = statistics.median(times[f"ar {mode}"]), statistics.median(times[name])
        ar_after, ms_after = statistics.median(after[f"ar {mode}"]), statistics.median(after[name])
        print(f" {name} | {spread(times[name])} | {statistics.median(taus[name]):.2f} | {ar / ms:.2f}x | "
              f"{floor_ms / ms:.2f} | {spread(after[name])}, {ar_after / ms_after:.2f}x, {floor_ms / ms_after:.2f} | "
              f"{differ[name]}/{len(samples)}")
    if steps:
        print(f" target step after {args.seq} cached tokens (ms): "
              + "; ".join(f"{mode}: 1 token {v[1]:.2f}, {GAMMA + 1} tokens {v[GAMMA + 1]:.2f}" for mode, v in steps.items()))
        for mode in modes:
            bound = (GAMMA + 1) * steps[mode][1] / steps[mode][GAMMA + 1]
            measured = statistics.median(times[f"ar {mode}"]) / statistics.median(times[f"oracle {mode}"])
            later = statistics.median(after[f"ar {mode}"]) / statistics.median(after[f"oracle {mode}"])
            print(f" oracle {mode}: {measured:.2f}x over ar, bound {bound:.2f}x, measured / bound {measured / bound:.2f}; "
                  f"after the prefill {later:.2f}x, / bound {later / bound:.2f}")
            record(kind="oracle", mode=mode, measured=measured, after_prefill=later, bound=bound, steps=steps[mode])
    print(f" {LOG.summary() or 'nothing compiled'}")
    print(f"\nmachine: {machine()}")
    print(json.dumps({"times": times, "after": after, "taus": taus, "differ": differ, "steps": steps,
                      "floor_ms": floor_ms}),
          file=sys.stderr)


if __name__ == "__main__":
    main()
