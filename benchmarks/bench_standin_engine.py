"""The engine's own time per block over a real vocabulary: an earlier tree against this one, on the stand-ins of
Qwen2.5-VL-7B (target) and Qwen2.5-VL-3B (draft).

The stand-ins (``tests/standins``) are the checkpoints' own published files with their sizes shrunk and random
weights: their vocabulary is the real one (152,064 logits a row), their dtype the profile's (bfloat16), and the
target's ``generation_config.json`` asks for a repetition penalty of 1.05, which mmspec applies as ``generate`` does.
The forwards are tiny, so what this measures is the host's work a block does over such a vocabulary: the greedy
choices, the penalty, TABED's mixtures and evidence. It is what ``bench_engine_block.py``'s figure 1 measures on the
demo family (1,200 logits a row), with the same clock: a block's wall time minus the time inside model forwards
(torch's global module hooks, outermost call).

Profile ``qwen25-vl-7b`` (its γ = 5), greedy, drafters ``ar, m, tabed``, two text-only questions of 48 new tokens
each, every turn's first block (the prefill) left out; each tree in its own process (``PYTHONPATH``), one thread,
the trees alternating round by round (``--rounds``), the drafters interleaved inside a process. Each tree's tokens
are compared with the other's: greedy, they must be the same. ``--sampling`` samples at temperature 1 with top-p 0.9
(seed 1); there the trees draw the same tokens only where their distributions agree (a tree from before issue 31's
seventh session split tokens tied at the nucleus's edge). ``--tree width`` or ``dynamic`` drafts token trees (2
branches; or the profile's dynamic trees) instead of chains, where the target's rows a sampled tree's rule reads
matter. Medians with the quartiles; the ratios are after/before of the medians. Exits 0 whatever it measures.

    git worktree add /tmp/before <commit>   # or: mkdir /tmp/before && git archive <commit> | tar -x -C /tmp/before
    python benchmarks/bench_standin_engine.py --before /tmp/before [--rounds 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]
DRAFTERS = ("ar", "m", "tabed")
QUESTIONS = ("Write a short story about a lighthouse.", "Describe a busy market in detail.")
NEW_TOKENS = 48
CHECKPOINTS = ("Qwen/Qwen2.5-VL-7B-Instruct", "Qwen/Qwen2.5-VL-3B-Instruct")


def options(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, help="the earlier tree (a worktree or an extracted commit)")
    parser.add_argument("--after", type=Path, default=REPO, help="the later tree (default: this repository)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--sampling", action="store_true",
                        help="sample at temperature 1 with top-p 0.9 (seed 1) instead of greedy decoding")
    parser.add_argument("--tree", choices=("chain", "width", "dynamic"), default="chain",
                        help="the blocks' shape: chains (default), width trees of 2 branches, or dynamic trees at the "
                             "profile's settings (budget 30, depth 3, top-k 8); ar drafts nothing either way")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def worker(job_path: Path) -> None:
    """One tree: load the profile over the stand-ins, decode every question with every drafter (a warm-up pass
    first), write per drafter the engine µs of each block after the prefill, the wall and token totals, the tokens."""
    job = json.loads(job_path.read_text())
    sys.path.insert(0, str(HERE.parent))
    from bench_engine_block import ForwardClock, stream_blocks

    clock = ForwardClock()
    clock.install()  # before mmspec_cli is imported
    import torch

    torch.set_num_threads(1)
    import mmspec_cli
    from mmspec_cli.api import ModelSet
    from mmspec_cli.models.profiles import apply_overrides, load_profile

    if not Path(mmspec_cli.__file__).resolve().is_relative_to(Path(job["tree"]).resolve()):
        raise SystemExit(f"mmspec_cli was imported from {mmspec_cli.__file__}, not from {job['tree']}")
    sampling = {"temperature": 1.0, "top_p": 0.9, "seed": 1} if job["sampling"] else {}
    shape = {"chain": {}, "width": {"tree_width": 2}, "dynamic": {"tree": "dynamic"}}[job["shape"]]
    profile = apply_overrides(load_profile("qwen25-vl-7b"), max_new_tokens=NEW_TOKENS, **sampling, **shape)
    models = ModelSet.load(profile, list(DRAFTERS), threads=1)
    decoders = {name: models.decoder(name) for name in DRAFTERS}
    found = {name: {"engine_us": [], "wall_s": 0.0, "tokens": 0, "outputs": []} for name in DRAFTERS}
    for measured in (False, True):
        for k, question in enumerate(QUESTIONS):
            sample = types.SimpleNamespace(images=[], turns=[question], history=())  # what stream_blocks reads
            for name in DRAFTERS[k % len(DRAFTERS):] + DRAFTERS[:k % len(DRAFTERS)]:
                blocks, turns, _ = stream_blocks(decoders[name], sample, clock, NEW_TOKENS)
                if not measured:
                    continue
                entry = found[name]
                for block in blocks:
                    if not block["first"]:  # the turn's first block also prefills the prompt
                        entry["engine_us"].append(1e6 * (block["wall"] - block["forward"]))
                        entry["wall_s"] += block["wall"]
                        entry["tokens"] += block["tokens"]
                entry["outputs"] += turns
    Path(job["out"]).write_text(json.dumps(found))


def run_tree(tree: Path, cache: Path, scratch: Path, sampling: bool, shape: str) -> dict:
    job = scratch / f"job-{time.monotonic_ns()}.json"
    out = job.with_suffix(".out.json")
    job.write_text(json.dumps({"tree": str(tree), "out": str(out), "sampling": sampling, "shape": shape}))
    from bench_engine_block import worker_env  # the tree first on PYTHONPATH, the machine's after it; one thread

    env = worker_env(tree, {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"})
    done = subprocess.run([sys.executable, str(HERE), "--worker", str(job)], env=env, cwd=scratch,
                          capture_output=True, text=True)
    if done.returncode != 0 or not out.exists():
        raise SystemExit(f"the run over {tree} failed:\n" + "\n".join(done.stderr.strip().splitlines()[-12:]))
    return json.loads(out.read_text())


def quartiles(values: list[float]) -> str:
    q1, median, q3 = statistics.quantiles(values, n=4)
    return f"{median:8.0f} ({q1:.0f}-{q3:.0f})"


def main() -> None:
    args = options()
    if args.worker:
        worker(Path(args.worker))
        return
    if args.before is None:
        raise SystemExit("--before DIR is needed: the earlier tree to compare with")
    sys.path[:0] = [str(REPO), str(HERE.parent)]
    import torch

    from bench_demo_suites import machine
    from tests.standins import build_hub_cache

    torch.set_num_threads(1)  # as the workers run: the machine line names their thread count

    scratch = Path(tempfile.mkdtemp(prefix="mmspec-standin-engine-"))
    cache = scratch / "hub"
    build_hub_cache(cache, CHECKPOINTS)
    sides = {"before": args.before.resolve(), "after": args.after.resolve()}
    print(f"machine: {machine()}; each worker one thread")
    print(f"before: {sides['before']}; after: {sides['after']}; {args.rounds} rounds, the trees alternating; "
          + ("sampling at temperature 1, top-p 0.9, seed 1" if args.sampling else "greedy") + f"; blocks: {args.tree}")
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    for r in range(args.rounds):
        for side in (("before", "after") if r % 2 == 0 else ("after", "before")):
            started = time.perf_counter()
            runs[side].append(run_tree(sides[side], cache, scratch, args.sampling, args.tree))
            print(f"  round {r + 1}, {side}: {time.perf_counter() - started:.0f} s", flush=True)
    print("\n| drafter | engine µs/block, before | after | after/before | ms/token, before | after | after/before |"
          " same tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for name in DRAFTERS:
        engine = {side: [v for run in runs[side] for v in run[name]["engine_us"]] for side in sides}
        per_token = {side: 1e3 * sum(run[name]["wall_s"] for run in runs[side])
                     / sum(run[name]["tokens"] for run in runs[side]) for side in sides}
        same = all(run[name]["outputs"] == runs["before"][0][name]["outputs"] for side in sides for run in runs[side])
        ratio = statistics.median(engine["after"]) / statistics.median(engine["before"])
        print(f"| {name} | {quartiles(engine['before'])} | {quartiles(engine['after'])} | {ratio:.2f} | "
              f"{per_token['before']:.2f} | {per_token['after']:.2f} | {per_token['after'] / per_token['before']:.2f} |"
              f" {'yes' if same else 'NO'} |")
    print(f"\nmachine at the end: {machine()}")


if __name__ == "__main__":
    main()
