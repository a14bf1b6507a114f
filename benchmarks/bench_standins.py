"""Text-only drafting with a language model on the stand-ins of real checkpoints: τ and speed of ``t`` with a
language model's stand-in beside ``m`` with the profile's vision-language draft, against ``ar``, on the same target:
Qwen2.5-VL-7B with Qwen2.5-0.5B-Instruct (profile ``qwen25-vl-7b-text``) and Qwen2.5-VL-3B (``qwen25-vl-7b``), and
LLaVA-1.5-7B with Vicuna-68M and TABED's LVLM-68M (``llava15-7b``).

The stand-ins (``tests/standins``) are the models' own published files with their sizes shrunk and random weights,
each draft's weights near its target's: the figures are for the mechanics (the table from target ids to the draft's
runs on every token), not for the speed a real 0.5B or 3B draft gives. Greedy, float32, one thread, MMSpec's pixel
bound, the same prompts (0, 1 and 2 images: a 4000×3000 photo and a chart) for every drafter, the drafters interleaved
prompt by prompt and round by round; medians with [min, max] over rounds; every output compared with ``ar``'s.

    python benchmarks/bench_standins.py [--rounds 3] [--new 48]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

QUESTIONS = ("What does the image show?", "Describe the chart in detail.", "Write a short story about a lighthouse.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new", type=int, default=48, help="new tokens per turn")
    args = parser.parse_args()
    cache = Path(tempfile.mkdtemp(prefix="mmspec-standins-"))
    os.environ.update(HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")

    import torch

    from mmspec_cli.api import ModelSet
    from mmspec_cli.models.profiles import load_profile
    from tests.standins import build_hub_cache
    from tests.test_standins import QWEN_MAX_PIXELS, chart, photo

    torch.set_num_threads(1)
    build_hub_cache(cache, ("Qwen/Qwen2.5-VL-7B-Instruct", "Qwen/Qwen2.5-VL-3B-Instruct",
                            "Qwen/Qwen2.5-0.5B-Instruct", "llava-hf/llava-1.5-7b-hf", "mjbooo/lvlm68m",
                            "double7/vicuna-68m"))

    def profile(name, draft=None):
        chosen = load_profile(name)
        bound = QWEN_MAX_PIXELS[14] if name.startswith("qwen") else None
        vision = chosen.drafter != "t" and draft is None
        spec = dict(dtype="float32", device="cpu")
        return dataclasses.replace(
            chosen, target=dataclasses.replace(chosen.target, max_pixels=bound, **spec),
            draft=dataclasses.replace(chosen.draft, model=draft or chosen.draft.model,
                                      max_pixels=bound if vision else None, **spec),
            decoding=dataclasses.replace(chosen.decoding, max_new_tokens=args.new))

    qwen_text = ModelSet.load(profile("qwen25-vl-7b-text"), ["ar", "t"], threads=None)
    qwen_vision = ModelSet.load(profile("qwen25-vl-7b"), ["m"], threads=None)
    llava = ModelSet.load(profile("llava15-7b"), ["ar", "m"], threads=None)
    llava_text = ModelSet.load(profile("llava15-7b", "double7/vicuna-68m"), ["t"], threads=None)
    families = {
        "Qwen2.5-VL-7B": {"ar": qwen_text.decoder("ar"), "t (Qwen2.5-0.5B, a language model)": qwen_text.decoder("t"),
                          "m (Qwen2.5-VL-3B)": qwen_vision.decoder("m")},
        "LLaVA-1.5-7B": {"ar": llava.decoder("ar"), "t (Vicuna-68M, a language model)": llava_text.decoder("t"),
                         "m (LVLM-68M)": llava.decoder("m")},
    }
    cases = [(q, [photo(), chart()][:n]) for q in QUESTIONS for n in (0, 1, 2)]
    load = os.getloadavg()[0]
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, 1 thread, load average "
          f"{load:.2f} at the start; {len(cases)} prompts, {args.new} new tokens, {args.rounds} rounds", flush=True)
    for family, decoders in families.items():
        measure(family, decoders, cases, args.rounds)


def measure(family, decoders, cases, rounds) -> None:
    """Interleaved prompt by prompt and round by round; ms/token, speedup per round, τ, turns differing from ar's."""
    per_round = {name: [] for name in decoders}
    tau = {name: [] for name in decoders}
    mismatches = {name: 0 for name in decoders}
    for _ in range(rounds):
        wall = {name: 0.0 for name in decoders}
        tokens = {name: 0 for name in decoders}
        for question, images in cases:
            reference = None
            for name, decoder in decoders.items():
                start = time.perf_counter()
                turn = decoder.generate(images, [question]).turns[0]
                wall[name] += time.perf_counter() - start
                tokens[name] += len(turn.token_ids)
                tau[name].append(turn.stats.block_efficiency)
                reference = turn.token_ids if reference is None else reference
                mismatches[name] += turn.token_ids != reference
        for name in decoders:
            per_round[name].append(1000 * wall[name] / max(tokens[name], 1))
    print(f"{family}:")
    print("  drafter: ms/token median [min, max]; speedup over ar per round, median [min, max]; τ mean; "
          "turns differing from ar's")
    for name in decoders:
        ms = per_round[name]
        speed = [a / b for a, b in zip(per_round["ar"], ms)]
        print(f"    {name}: {statistics.median(ms):.2f} [{min(ms):.2f}, {max(ms):.2f}] ms/token; "
              f"{statistics.median(speed):.2f}x [{min(speed):.2f}, {max(speed):.2f}]; τ {statistics.mean(tau[name]):.2f}; "
              f"{mismatches[name]} of {len(tau[name])} differ")


if __name__ == "__main__":
    main()
