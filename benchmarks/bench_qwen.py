"""The tiny Qwen-VL families: mmspec's drafters against HF assisted generation with the same draft, in one run.

There is no trained Qwen pair here, so on each tiny family of ``tests/tiny_qwen.py`` (random float64
weights; the draft is the target with Gaussian noise, so it agrees often, not always; an ``eagle`` head
trained for the target with ``mmspec train-head``), one ``mmspec bench`` run per family interleaves
``ar, m, t, p, tabed, eagle, hf-assisted`` sample by sample on the same manifest (images of several sizes,
0 to 2 per sample), greedy, γ = 4. It prints block efficiency τ, ms per token and the measured speedup
over ``ar`` per drafter, and the token check (every output against ``ar``'s). HF assisted generation's
assistant does not receive the pixels (docs/BENCHMARKS.md says how that was checked).

    python benchmarks/bench_qwen.py [--samples 12] [--steps 600] [--families qwen2_vl,...] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_demo_suites import fmt, machine, mmspec  # noqa: E402
from tests import tiny, tiny_qwen  # noqa: E402

DRAFTERS = "ar,m,t,p,tabed,eagle,hf-assisted"
QUESTIONS = ["what is in the image?", "describe the picture in detail", "how many shapes are there?",
             "what changed between the two images?"]


def build(root: Path, family: str) -> Path:
    """The tiny target and draft saved to ``root``, a profile naming them; its path."""
    tokenizer = tiny_qwen.train_tokenizer()
    processor = tiny_qwen.make_processor(family, tokenizer)
    target = tiny_qwen.make_model(family, len(tokenizer), seed=0, hidden=64, layers=4)
    draft = tiny.perturbed_copy(target, 0.3, seed=1)
    spec = {"dtype": "float32", "device": "cpu"}
    profile = {"target": {"model": tiny_qwen.save(target, processor, root / "target"), **spec},
               "draft": {"model": tiny_qwen.save(draft, processor, root / "draft"), **spec},
               "head": [{"model": str(root / "eagle"), "kind": "eagle"}],
               "decoding": {"gamma": 4, "max_new_tokens": 48, "temperature": 0}}
    path = root / "profile.yaml"
    path.write_text(yaml.safe_dump(profile))
    return path


def manifest(root: Path, samples: int) -> Path:
    images = []
    for i, image in enumerate(tiny_qwen.images(3)):
        images.append(f"img{i}.png")
        image.save(root / images[-1])
    lines = []
    for i in range(samples):
        count = i % 3
        lines.append({"id": f"s{i}", "images": [images[(i + k) % 3] for k in range(count)],
                      "turns": [QUESTIONS[i % len(QUESTIONS)]], "category": f"{count} images"})
    path = root / "manifest.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=12)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--steps", type=int, default=600, help="train-head steps for the eagle head")
    parser.add_argument("--families", default=",".join(tiny_qwen.FAMILIES))
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-qwen-"))
    print(f"machine: {machine()}")
    for family in args.families.split(","):
        root = out / family
        root.mkdir(parents=True, exist_ok=True)
        profile = build(root, family)
        data = manifest(root, args.samples)
        # the demo heads' settings (scripts/train_demo_heads.py): greedy answers, no suffix, lr 3e-3
        mmspec("train-head", "eagle", str(data), "--profile", str(profile), "--out", str(root / "eagle"),
               "--steps", str(args.steps), "--lr", "3e-3", "--answer-temperature", "0", "--answer-suffix", "",
               "--answer-tokens", "48")
        records = root / "records.jsonl"
        summary = json.loads(mmspec("bench", str(data), "--profile", str(profile), "--drafters", DRAFTERS,
                                    "--out", str(records), "--format", "json"))
        print(f"\n{family} ({args.samples} samples, 0-2 images each, γ = 4, greedy; records: {records})")
        print(f"{'category':<10} {'drafter':<12} {'tau':>6} {'tokens/s':>9} {'speedup':>8}")
        for row in summary["rows"]:
            print(f"{row['category']:<10} {row['drafter']:<12} {fmt(row['block_efficiency']):>6} "
                  f"{fmt(row['tokens_per_s'], 1):>9} {fmt(row['speedup']):>8}")
        check = summary["token_check"]
        print(f"token check: {check['compared']} outputs compared with ar's, {len(check['mismatches'])} mismatches"
              + (f" ({check['reason']})" if not check["ran"] else ""))

if __name__ == "__main__":
    main()
