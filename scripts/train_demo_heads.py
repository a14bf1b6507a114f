"""Train the shipped demo heads ``mmspec:demo-vispec``, ``mmspec:demo-eagle`` and ``mmspec:demo-eagle3`` and the
imitation network ``mmspec:demo-imitation`` (FastVLM, after layer 1, the demo profile's ``ssd.layer``) for
``mmspec:demo-target``.

    python scripts/train_demo_heads.py                     # writes mmspec_cli/shipped/demo-{vispec,eagle,imitation}
    python scripts/train_demo_heads.py --out /tmp/heads    # somewhere else
    python scripts/train_demo_heads.py --measure 10        # then τ of both heads on 10 samples of each demo suite

Both heads go through ``mmspec train-head``'s own code (:func:`mmspec_cli.training.run.train_head`) on
the demo training corpus (``demo-train``: seeds from ``demo.tasks.TRAIN_SEEDS``, none of them a
held-out suite's), with :data:`PLAN`'s settings. The target answers once (greedily: the suites
are decoded greedily) into ``--work``, and both heads reuse those answers. Acceptance is measured
on the first samples of the four demo suites, which training never sees.

Each network trains in a child process of its own, so that its wall time and peak memory
(``resource.getrusage``) are its own; both go into its ``config.json`` (``training``). The imitation
network trains first (its run answers the prompts, if ``--work`` holds no answers yet), then both
heads side by side, one core each. Deterministic: fixed seeds, 1 torch thread per child,
deterministic algorithms; everything is stored in float16.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class HeadPlan:
    """What decides the shipped heads (the defaults are what ships)."""

    conversations: int = 2000  # of demo-train
    steps: int = 600
    batch_size: int = 8
    lr: float = 3e-3
    mtp: int = 3
    eagle3_ttt: int = 7  # eagle3's unroll (EAGLE-3's training-time test); same answers, steps, batch and lr
    loss: str = "ce"  # ViSpec's paper's loss: within 20 CPU minutes it beats 10·L1 + 0.1·ListMLE (README)
    noise: float = 0.2
    answer_temperature: float = 0.0
    answer_tokens: int = 160  # the demo profile's max_new_tokens
    held_out_per_suite: int = 5  # acceptance measured on the first N samples of each demo suite
    seed: int = 0
    threads: int = 1  # the two heads train side by side, one core each
    imitation_layer: int = 1  # the demo profile's ssd.layer: what select-layer picks for the demo target
    imitation_steps: int = 600
    imitation_noise: float = 0.0


PLAN = HeadPlan()


def train_one(kind: str, out: Path, work: Path, plan: HeadPlan) -> dict:
    """Train one head in this process (the child's job); returns the report with wall time and peak memory."""
    import torch

    torch.set_num_threads(plan.threads)
    torch.use_deterministic_algorithms(True)
    from mmspec_cli.inputs.sources import resolve
    from mmspec_cli.models.profiles import load_profile
    from mmspec_cli.training.answers import AnswerSettings
    from mmspec_cli.training.corpus import DEMO_TRAIN, from_sample
    from mmspec_cli.training.run import TrainHeadSettings, train_head

    start = time.perf_counter()
    held = [from_sample(s) for s in resolve("demo-all", plan.held_out_per_suite)]
    imitation = kind == "imitation"
    settings = TrainHeadSettings(
        kind=kind, source=DEMO_TRAIN, out=out, steps=plan.imitation_steps if imitation else plan.steps, lr=plan.lr,
        mtp=plan.eagle3_ttt if kind == "eagle3" else plan.mtp, limit=plan.conversations, seed=plan.seed, batch_size=plan.batch_size, loss=plan.loss,
        noise=plan.imitation_noise if imitation else plan.noise, evaluate=held,
        ssd_layer=plan.imitation_layer if imitation else None,
        answers=AnswerSettings(temperature=plan.answer_temperature, max_new_tokens=plan.answer_tokens, suffix="",
                               seed=plan.seed, batch_size=64),
        answers_file=work / "demo-train.answers.jsonl")
    report = train_head(load_profile("demo"), settings)
    report["wall_s"] = round(time.perf_counter() - start, 1)
    report["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    report["plan"] = asdict(plan)
    _record(out, report)
    return report


def _record(out: Path, report: dict) -> None:
    """Add the wall time and peak memory to the ``training`` block of the head's config.json."""
    path = out / "config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    block = config["mmspec"] if "mmspec" in config else config["mmspec_imitation"]
    block["training"].update(wall_s=report["wall_s"], peak_rss_mb=report["peak_rss_mb"],
                                        plan=report["plan"])
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def measure(out: Path, per_suite: int) -> None:
    """τ of both heads (chain γ = 5, dynamic trees 30/3/8 and 60/5/10) on the first ``per_suite`` samples of each
    demo suite, greedy, each output checked against the target's own (``ar``)."""
    import torch

    torch.set_num_threads(1)
    from mmspec_cli.inputs.sources import DEMO_SUITES, demo_suite
    from mmspec_cli.decoding.engine import SpeculativeDecoder
    from mmspec_cli.drafters.head import HeadDrafter
    from mmspec_cli.drafters.autoregressive import NoDrafter
    from mmspec_cli.models.head_files import load_head
    from mmspec_cli.models.loading import load_model
    from mmspec_cli.models.profiles import load_profile

    profile = load_profile("demo")
    target = load_model(profile.target, "target")
    settings = {"chain": dict(tree=None), "dynamic 30/3/8": dict(tree="dynamic"),
                "dynamic 60/5/10": dict(tree="dynamic", tree_budget=60, tree_depth=5, tree_topk=10)}
    suites = {name: demo_suite(name, per_suite) for name in DEMO_SUITES}
    reference = {}
    ar = SpeculativeDecoder(target, NoDrafter(), gamma=5, max_new_tokens=profile.decoding.max_new_tokens)
    for name, samples in suites.items():
        for s in samples:
            reference[s.id] = ar.generate(list(s.images), list(s.turns), history=s.history).turns[0].token_ids
    rows = []
    for kind in ("eagle", "vispec", "eagle3"):
        head = load_head(str(out / f"demo-{kind}"), None, None, target)
        for label, tree in settings.items():
            decoder = SpeculativeDecoder(target, HeadDrafter(target, head), gamma=5,
                                         max_new_tokens=profile.decoding.max_new_tokens, **tree)
            per_suite_tau, tokens, blocks, mismatches = {}, 0, 0, 0
            for name, samples in suites.items():
                t = b = 0
                for s in samples:
                    turn = decoder.generate(list(s.images), list(s.turns), history=s.history).turns[0]
                    t, b = t + turn.stats.new_tokens, b + turn.stats.blocks
                    mismatches += turn.token_ids != reference[s.id]
                per_suite_tau[name] = t / b
                tokens, blocks = tokens + t, blocks + b
            rows.append((kind, label, per_suite_tau, sum(per_suite_tau.values()) / len(per_suite_tau), mismatches))
            print(f"{kind:7} {label:16} " + " ".join(f"{per_suite_tau[n]:.3f}" for n in DEMO_SUITES)
                  + f"  avg {rows[-1][3]:.3f}  mismatches {mismatches}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "mmspec_cli" / "shipped"), help="folder for demo-vispec/ and demo-eagle/")
    parser.add_argument("--work", default=str(ROOT / "build" / "demo-heads"), help="folder for the shared answers file")
    parser.add_argument("--only", choices=("vispec", "eagle", "eagle3", "imitation"), help="train this one here (what each child runs)")
    parser.add_argument("--measure", type=int, default=0, metavar="N",
                        help="after training (or alone with --no-train), τ on the first N samples of each demo suite")
    parser.add_argument("--no-train", action="store_true", help="only --measure the heads already in --out")
    args = parser.parse_args()
    out, work = Path(args.out), Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.only:
        report = train_one(args.only, out / f"demo-{args.only}", work, PLAN)
        print(json.dumps(report), flush=True)
        return
    if not args.no_train:
        # the answers first (the imitation network's run makes them, and trains fast), then both heads side by side
        for group in (("imitation",), ("vispec", "eagle"), ("eagle3",)):
            children = {kind: subprocess.Popen([sys.executable, __file__, "--only", kind, "--out", str(out), "--work",
                                                str(work)], stdout=subprocess.PIPE, text=True,
                                               env={**os.environ, "PYTHONPATH": str(ROOT)}) for kind in group}
            for kind, child in children.items():
                stdout, _ = child.communicate()
                if child.returncode != 0:
                    sys.exit(child.returncode)
                _summary(kind, json.loads(stdout.strip().splitlines()[-1]), out)
    if args.measure:
        measure(out, args.measure)


def _summary(kind: str, report: dict, out: Path) -> None:
    """One line per trained network: wall time, peak memory, size on disk, τ before and after training."""
    size = sum(p.stat().st_size for p in (out / f"demo-{kind}").iterdir())
    acc = report.get("acceptance", {})
    print(f"demo-{kind}: {report['wall_s']:.0f} s wall ({report['seconds']['answers']:.0f} s answering, "
          f"{report['seconds']['training']:.0f} s training), peak RSS {report['peak_rss_mb']:.0f} MB, "
          f"{size / 1e6:.2f} MB on disk; τ (chain γ = 5) on {acc.get('held_out')} held-out samples "
          f"{(acc.get('before') or {}).get('block_efficiency', float('nan')):.3f} -> "
          f"{(acc.get('after') or {}).get('block_efficiency', float('nan')):.3f}", flush=True)


if __name__ == "__main__":
    main()
