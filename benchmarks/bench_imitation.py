"""``ssd`` with and without FastVLM's imitation network (IN) on the demo suites, against ``ar``.

One run, one machine, the default (``demo``) profile (whose ``ssd.imitation`` names the shipped
IN), greedy, on the first ``--limit`` samples of each demo suite. Per sample the drafters run one
after another (``ar`` first), so they share the machine's state; per drafter and suite:

- τ, block efficiency (the bonus token included);
- the measured walltime speedup over ``ar`` (``ar``'s seconds per token over the drafter's);
- Eq. (1), τ / (γ·c + 1), with c the mean draft step over the mean verification call, both from
  the engine's own block timings (the first block of each turn left out: it holds the prefill),
  as ``select-layer --empirical`` measures it; for dynamic trees γ is the levels drafted;
- the token check: every output compared with ``ar``'s.

Settings: ``ssd`` (with the IN) and ``ssd:plain`` (without) at the IN's layer, as chains (γ = 5)
and dynamic trees (30/3/8); and ``ssd:plain`` at the layer ``select-layer`` picks without the IN,
when that is another layer.

    python benchmarks/bench_imitation.py [--limit 10]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
from pathlib import Path

from bench_demo_suites import SUITES, machine

from mmspec_cli.api import ModelSet
from mmspec_cli.inputs.samples import load_sample_images
from mmspec_cli.inputs.sources import resolve
from mmspec_cli.models.profiles import load_profile

TREES = {"chain": {}, "dynamic 30/3/8": {"tree": "dynamic", "tree_budget": 30, "tree_depth": 3, "tree_topk": 8}}


def chosen_without_imitation(limit: int) -> int:
    """The layer ``select-layer`` picks by reward for the plain draft (its calibration: demo-single)."""
    script = Path(sys.executable).parent / "mmspec"
    done = subprocess.run([str(script), "select-layer", "demo-single", "--limit", str(limit), "--json"],
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout)["chosen_by_reward"]


def run_suite(models: ModelSet, suite: str, limit: int, runs: list[tuple[str, str, int, dict]]) -> dict:
    """Decode ``suite`` with ``ar`` and every run (label, drafter, layer, tree); totals per label."""
    decoders = {"ar": models.decoder("ar")}
    for label, drafter, layer, tree in runs:
        decoding = dataclasses.replace(models.profile.decoding, **tree)
        shaped = dataclasses.replace(models, profile=dataclasses.replace(models.profile, decoding=decoding))
        decoders[label] = shaped.decoder(drafter, ssd_layer=layer)  # the same loaded models, this tree
    totals = {label: {"tokens": 0, "wall": 0.0, "calls": 0, "draft": [], "verify": [], "levels": [], "mismatch": 0}
              for label in decoders}
    for sample in resolve(suite, limit):
        images = load_sample_images(sample)
        reference = None
        for label, decoder in decoders.items():
            generation = decoder.generate(images, list(sample.turns), history=sample.history)
            ids = [turn.token_ids for turn in generation.turns]
            reference = ids if reference is None else reference
            t = totals[label]
            t["mismatch"] += ids != reference
            for turn in generation.turns:
                t["tokens"] += turn.stats.new_tokens
                t["wall"] += turn.stats.wall_s
                t["calls"] += turn.stats.blocks
                for block in turn.blocks[1:]:
                    if block.draft:
                        levels = max((len(b) for b in block.tree), default=len(block.draft)) if block.tree else len(block.draft)
                        t["draft"].append(block.draft_s / levels)
                        t["verify"].append(block.verify_s)
                        t["levels"].append(levels)
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=10, help="samples per suite")
    args = parser.parse_args()
    profile = load_profile(None)
    layer = profile.ssd.layer
    plain_pick = chosen_without_imitation(3)
    runs = []
    for name, tree in TREES.items():
        runs += [(f"ssd+IN L{layer} {name}", "ssd", layer, tree), (f"ssd L{layer} {name}", "ssd:plain", layer, tree)]
        if plain_pick != layer:
            runs.append((f"ssd L{plain_pick} {name}", "ssd:plain", plain_pick, tree))
    models = ModelSet.load(profile, ["ar", "ssd", "ssd:plain"])
    print(f"machine: {machine()}; first {args.limit} samples of each suite, greedy; IN trained for layer {layer}; "
          f"select-layer picks layer {plain_pick} without it")
    table: dict[str, dict[str, tuple[float, float, float]]] = {}
    for suite in SUITES:
        totals = run_suite(models, suite, args.limit, runs)
        ar = totals["ar"]["wall"] / totals["ar"]["tokens"]
        for label, t in totals.items():
            if label == "ar":
                continue
            tau = t["tokens"] / t["calls"]
            c = statistics.fmean(t["draft"]) / statistics.fmean(t["verify"]) if t["draft"] else float("nan")
            gamma = statistics.fmean(t["levels"]) if t["levels"] else 5
            table.setdefault(label, {})[suite] = (tau, ar / (t["wall"] / t["tokens"]), tau / (gamma * c + 1))
            if t["mismatch"]:
                print(f"  MISMATCH: {label} on {suite}: {t['mismatch']} samples differ from ar")
    print("\nτ / measured speedup over ar / Eq. (1), per suite: " + ", ".join(s.replace("demo-", "") for s in SUITES))
    for label, rows in table.items():
        cells = "  ".join(f"{rows[s][0]:.3f} {rows[s][1]:.2f}x {rows[s][2]:.2f}x" for s in SUITES)
        mean = [statistics.fmean(rows[s][i] for s in SUITES) for i in range(3)]
        print(f"  {label:<26} {cells}   mean τ {mean[0]:.3f}, {mean[1]:.2f}x, Eq.(1) {mean[2]:.2f}x")
    print("\ntargets:")
    for name in TREES:
        with_in, without = table[f"ssd+IN L{layer} {name}"], table[f"ssd L{layer} {name}"]
        ratio = statistics.fmean(with_in[s][0] for s in SUITES) / statistics.fmean(without[s][0] for s in SUITES)
        print(f"  {name}: τ with the IN / without, mean over suites: {ratio:.3f}x (target 1.3x: "
              f"{'met' if ratio >= 1.3 else 'MISSED'}); speedup over ar per suite: "
              + ", ".join(f"{with_in[s][1]:.2f}x" for s in SUITES)
              + f" ({'met' if all(with_in[s][1] > 1.0 for s in SUITES) else 'MISSED'}: above 1.0 on every suite)")
    print(f"machine: {machine()}")


if __name__ == "__main__":
    main()
