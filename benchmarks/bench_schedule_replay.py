"""How far can a draft-length schedule beat constant γ here? An exact replay, free of timing noise.

Issue 31's figure 6 asks ``--gamma-schedule cost`` to come within 3% of the best constant γ and to beat γ = 5 on each
demo suite. Measured end to end, the gap sits inside the passes' own spread (docs/BENCHMARKS.md), so this script
takes the noise out:

1. **Acceptance maps.** For each sample's last turn (greedy), the target's own output y, and for every position t the
   number A(t) of the drafter's greedy chain of ``--depth`` tokens proposed after y[:t] that match y[t:]. Greedy
   drafting is deterministic given the context, so a block that starts at t and drafts γ accepts exactly
   min(A(t), γ), whatever schedule brought it there: any schedule's blocks follow from A. The map is checked against
   the engine's own blocks at constant γ = 3, 5, 8 (``mismatches`` must be 0).
2. **Block times.** The engine's compiled blocks at each constant γ = 1 .. 8 (after a warm-up pass; each turn's first
   block left out), timed from one ``stream`` event to the next: the median wall time per (γ, accepted), or per γ
   where fewer than 5 blocks had that pair.
3. **Replay.** Every constant γ, the product's own :class:`~mmspec_cli.decoding.schedules.GammaSchedule` under
   ``cost`` (its step costs read from ``profile-latency``'s cache, as the CLI reads them; each block's measured time
   is the time of step 2 it is replayed at), and the **per-turn oracle**: each turn at the constant γ best for that
   turn (a bound no schedule that learns within a turn can be sure to reach), and the best **two-state pair** in
   hindsight (one constant after a block accepted in full, another after a rejection: what reading the last block's
   outcome could gain at most, :class:`TwoStates`). Tokens per ms over each suite. A
   turn's first block is replayed at its γ's steady time too: the prompt's prefill, which it also does, costs
   every schedule the same, and is left out.

The ratios printed are those of figure 6 (the schedule against the best constant and against γ = 5), with the
per-turn oracle's beside them: the headroom an adaptive schedule has on these samples.

    mmspec profile-latency --profile demo --compile --seq 128,256 --gammas 1,2,3,4,5,6,7,8,9 --batch 1,2 --repeat 10 --threads 1
    python benchmarks/bench_schedule_replay.py --drafter m --samples 8 [--skip 8] [--out FILE]

It runs the demo profile on one thread, so the step costs must be cached for one thread (``--threads 1`` above). It
exits 0 whatever it measures; 2, with the command to run, when they are not cached.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from bench_demo_suites import machine

SUITES = ("demo-story", "demo-followup")
GAMMAS = range(1, 9)
CHECKED_GAMMAS = (3, 5, 8)
MAX_NEW = 160


def models_for(drafter: str, compiled: bool):
    from mmspec_cli.api import ModelSet
    from mmspec_cli.models.profiles import apply_overrides, load_profile

    return ModelSet.load(apply_overrides(load_profile("demo"), compile=compiled, max_new_tokens=MAX_NEW), [drafter],
                         threads=1)


def decoder_at(models, drafter: str, **overrides):
    from mmspec_cli.models.profiles import apply_overrides

    chosen = copy.copy(models)
    chosen.profile = apply_overrides(models.profile, **overrides)
    return chosen.decoder(drafter)


def samples(n: int, skip: int) -> list:
    from mmspec_cli.inputs.sources import resolve

    return [(suite, sample) for suite in SUITES for sample in resolve(suite, skip + n)[skip:]]


def last_turn(decoder, sample) -> tuple[str, list[int]]:
    """The prompt text and the greedy output of ``sample``'s last turn."""
    from mmspec_cli.decoding.events import TurnFinished, TurnStarted

    text, output = "", []
    for event in decoder.stream(list(sample.images), list(sample.turns), history=tuple(sample.history),
                                max_new_tokens=MAX_NEW):
        if isinstance(event, TurnStarted):
            text = event.prompt
        elif isinstance(event, TurnFinished):
            output = list(event.result.token_ids)
    return text, output


def acceptance_map(models, drafter: str, text: str, images: list, output: list[int],
                   depth: int) -> tuple[int, list[int]]:
    """The prompt's length, and A(t) for t = 0 .. len(output) − 1: the drafter driven by hand through the turn, as the
    engine drives it (turn start, then per position: propose after output[:t], keep none of it, the target holding
    output[:t])."""
    from mmspec_cli.decoding.drafter import DraftShape, Kept, TurnStart
    from mmspec_cli.decoding.sampling import SamplingParams, TokenPicker
    from mmspec_cli.models.prompts import process

    decoder = decoder_at(models, drafter)
    prompt = process(decoder.target.processor, text, images)
    decoder.step.begin_turn()
    decoder.drafter.begin_turn(TurnStart(text, images, decoder.cached_target, len(output) + depth + 64, prompt))
    picker = TokenPicker(SamplingParams())
    found = []
    for t in range(len(output)):
        if t:  # what a block leaves: the drafts dropped, the target holding the verified tokens but the last
            decoder.drafter.roll_back(Kept(0))
            decoder.cached_target.hold(prompt.ids + output[:t - 1], vision=prompt.vision, prompt_len=len(prompt.ids))
            decoder.step.prompt_fed = True
        draft = decoder.drafter.propose(output[:t], DraftShape(depth), picker)
        matched = 0
        while matched < len(draft.tokens) and t + matched < len(output) and draft.tokens[matched] == output[t + matched]:
            matched += 1
        found.append(matched)
    return len(prompt.ids), found


def mismatches(models, drafter: str, chosen: list, maps: dict) -> tuple[int, int]:
    """(blocks checked, blocks whose accepted count is not min(A(start), γ)) over the engine's own runs."""
    checked = wrong = 0
    for _, sample in chosen:
        for gamma in CHECKED_GAMMAS:
            turn = decoder_at(models, drafter, gamma=gamma).generate(
                list(sample.images), list(sample.turns), history=tuple(sample.history),
                max_new_tokens=MAX_NEW).turns[-1]
            start, found = 0, maps[sample.id]
            for block in turn.blocks:
                if start < len(found):
                    checked += 1
                    wrong += min(found[start], len(block.draft)) != block.accepted
                start += len(block.tokens)
    return checked, wrong


def block_times(drafter: str, chosen: list) -> list[tuple[int, int, float]]:
    """(γ drafted, accepted, ms) of every compiled block after each turn's first, constant γ = 1 .. 8, interleaved."""
    from mmspec_cli.decoding.events import BlockVerified, TurnStarted

    models = models_for(drafter, compiled=True)
    decoders = {g: decoder_at(models, drafter, gamma=g, compile=True) for g in GAMMAS}
    found = []
    for rep in range(2):  # the first pass compiles every shape
        for k, (_, sample) in enumerate(chosen):
            order = list(GAMMAS)[k % len(GAMMAS):] + list(GAMMAS)[:k % len(GAMMAS)]
            for gamma in order:
                first, mark = True, time.perf_counter()
                for event in decoders[gamma].stream(list(sample.images), list(sample.turns),
                                                    history=tuple(sample.history), max_new_tokens=MAX_NEW):
                    now = time.perf_counter()
                    if isinstance(event, TurnStarted):
                        first = True
                    elif isinstance(event, BlockVerified):
                        if rep == 1 and not first:
                            found.append((len(event.draft), event.accepted, 1000 * (now - mark)))
                        first = False
                    mark = time.perf_counter()
    return found


class BlockClock:
    """The replay's time of a block: the median measured for its (γ, accepted), else for its γ."""

    def __init__(self, blocks: list[tuple[int, int, float]]):
        pairs, per_gamma = defaultdict(list), defaultdict(list)
        for gamma, accepted, ms in blocks:
            pairs[(gamma, accepted)].append(ms)
            per_gamma[gamma].append(ms)
        self.pairs = {key: statistics.median(v) for key, v in pairs.items() if len(v) >= 5}
        self.per_gamma = {g: statistics.median(v) for g, v in per_gamma.items()}

    def ms(self, gamma: int, accepted: int) -> float:
        return self.pairs.get((gamma, accepted), self.per_gamma[gamma])


def replay(turn: dict, clock: BlockClock, gamma: int | None = None, schedule=None) -> tuple[int, float, list[int]]:
    """One turn's blocks at constant ``gamma`` or under ``schedule``: (tokens, ms, γ of each block)."""
    found, n, prompt_len = turn["A"], turn["tokens"], turn["prompt_len"]
    t, ms, drafted = 0, 0.0, []
    while t < n:
        context = prompt_len + t
        g = gamma if schedule is None else schedule.length(context)
        accepted = min(found[t], g)
        spent = clock.ms(g, accepted)
        if schedule is not None:
            schedule.update(g, accepted, spent, context)
        t += accepted + 1
        ms += spent
        drafted.append(g)
    return n, ms, drafted


class TwoStates:
    """A schedule of two constants: ``after_full`` after a block whose drafts were all accepted (and at a turn's
    start), ``after_rejection`` after one with a rejection. Acceptance comes in runs, so whether the last block was
    accepted in full tells of the next; the best pair in hindsight bounds what a rule reading that state can gain."""

    def __init__(self, after_full: int, after_rejection: int):
        self.after_full, self.after_rejection, self.full = after_full, after_rejection, True

    def length(self, context: int) -> int:
        return self.after_full if self.full else self.after_rejection

    def update(self, drafted: int, accepted: int, measured_ms: float | None = None, context: int = 0) -> None:
        self.full = accepted == drafted


def rates(turns: list[dict], clock: BlockClock, costs) -> dict:
    """Per suite: tokens per ms of each constant γ, of ``cost`` (and its mean γ), and of the per-turn oracle."""
    from mmspec_cli.decoding.schedules import GammaSchedule

    out = {}
    for suite in SUITES:
        mine = [turn for turn in turns if turn["suite"] == suite]
        constant = {}
        per_turn = {g: [replay(turn, clock, gamma=g) for turn in mine] for g in GAMMAS}
        for g in GAMMAS:
            constant[g] = sum(r[0] for r in per_turn[g]) / sum(r[1] for r in per_turn[g])
        scheduled = [replay(turn, clock, schedule=GammaSchedule("cost", 5, costs=costs)) for turn in mine]
        oracle = [max((per_turn[g][i] for g in GAMMAS), key=lambda r: r[0] / r[1]) for i in range(len(mine))]
        pairs = {}
        for full in GAMMAS:
            for rejected in GAMMAS:
                runs = [replay(turn, clock, schedule=TwoStates(full, rejected)) for turn in mine]
                pairs[(full, rejected)] = sum(r[0] for r in runs) / sum(r[1] for r in runs)
        two_state = max(pairs, key=pairs.get)
        out[suite] = {
            "constant": constant,
            "cost": sum(r[0] for r in scheduled) / sum(r[1] for r in scheduled),
            "cost_mean_gamma": statistics.mean(g for r in scheduled for g in r[2]),
            "per_turn_oracle": sum(r[0] for r in oracle) / sum(r[1] for r in oracle),
            "two_state": pairs[two_state],
            "two_state_gammas": list(two_state),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", default="m", help="a drafter that drafts greedy chains (default m)")
    parser.add_argument("--samples", type=int, default=8, help="samples per suite (default 8)")
    parser.add_argument("--skip", type=int, default=0, help="skip the first N samples of each suite (a held-out set)")
    parser.add_argument("--depth", type=int, default=9, help="the acceptance map's chain length (default 9)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from mmspec_cli.bench.latency import run_step_costs
    from mmspec_cli.models.profiles import apply_overrides, load_profile

    started = time.perf_counter()
    cost_profile = apply_overrides(load_profile("demo"), compile=True, gamma_schedule="cost", gamma=5)
    found, note = run_step_costs(cost_profile, [args.drafter], "cpu", 1)
    if args.drafter not in found:
        print(note or f"error: no step costs for {args.drafter}", file=sys.stderr)
        raise SystemExit(2)
    costs = found[args.drafter]
    print(f"machine: {machine()}; drafter {args.drafter}; {args.samples} samples per suite after {args.skip}")

    models = models_for(args.drafter, compiled=False)
    chosen = samples(args.samples, args.skip)
    turns, maps = [], {}
    for suite, sample in chosen:
        text, output = last_turn(decoder_at(models, args.drafter), sample)
        prompt_len, maps[sample.id] = acceptance_map(models, args.drafter, text, list(sample.images), output,
                                                     args.depth)
        turns.append({"suite": suite, "id": sample.id, "prompt_len": prompt_len, "tokens": len(output),
                      "A": maps[sample.id]})
    checked, wrong = mismatches(models, args.drafter, chosen, maps)
    print(f"acceptance maps: {len(turns)} turns; against the engine's own blocks at γ = "
          f"{', '.join(map(str, CHECKED_GAMMAS))}: {checked} blocks, {wrong} mismatches")
    clock = BlockClock(block_times(args.drafter, chosen))
    print("compiled block ms per γ (median): " + ", ".join(f"{g}: {clock.per_gamma[g]:.3f}" for g in GAMMAS))
    report = rates(turns, clock, costs)
    for suite, r in report.items():
        best = max(GAMMAS, key=lambda g: r["constant"][g])
        print(f"\n{suite}: tokens per ms, constant γ: " + ", ".join(f"{g}: {r['constant'][g]:.3f}" for g in GAMMAS))
        print(f"  best constant γ = {best}; cost {r['cost']:.3f} (mean γ {r['cost_mean_gamma']:.2f}): "
              f"{r['cost'] / r['constant'][best]:.3f} of the best constant, {r['cost'] / r['constant'][5]:.3f} of γ = 5")
        print(f"  per-turn oracle {r['per_turn_oracle']:.3f}: {r['per_turn_oracle'] / r['constant'][best]:.3f} of the "
              f"best constant, {r['per_turn_oracle'] / r['constant'][5]:.3f} of γ = 5")
        full, rejected = r["two_state_gammas"]
        print(f"  best two-state pair in hindsight (γ {full} after a block accepted in full, {rejected} after a "
              f"rejection) {r['two_state']:.3f}: {r['two_state'] / r['constant'][best]:.3f} of the best constant, "
              f"{r['two_state'] / r['constant'][5]:.3f} of γ = 5")
    print(f"\nmachine: {machine()}; wall time {time.perf_counter() - started:.0f} s")
    if args.out:
        args.out.write_text(json.dumps({"machine": machine(), "drafter": args.drafter, "samples": args.samples,
                                        "skip": args.skip, "checked": checked, "mismatches": wrong,
                                        "block_ms": clock.per_gamma,
                                        "block_ms_accepted": [[g, a, ms] for (g, a), ms in clock.pairs.items()],
                                        "rates": report, "turns": turns}, indent=1))


if __name__ == "__main__":
    main()
