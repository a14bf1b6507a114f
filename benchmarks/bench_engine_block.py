"""The engine of issue 31 measured: the old commit against the new tree, on the same inputs, in one run.

Seven figures, each judged against the issue's target (PASS/FAIL; the script exits 0 whatever it measures):

1. **The engine's own time per block**: a block's wall time minus the time spent inside model forwards, demo
   family, drafters ``ar, m, tabed, eagle, oracle``, eager and compiled, old and new. Target: new ≤ 0.5 × old.
2. **``oracle`` compiled**, new tree: measured speedup over ``ar`` / its bound (γ+1)·T_p(1)/T_p(γ+1), after the
   prefill. Target: ≥ 0.95.
3. **Greedy outputs**: every drafter and tree kind (chain, ``tree_width=2``, ``tree="dynamic"``), eager and
   compiled: the new tree's tokens == the old tree's == the target's own HF ``generate(do_sample=False)``.
4. **``pld``** (prompt lookup), new tree, on demo-story and demo-followup: τ and speed over ``ar``, beside Hugging
   Face's prompt lookup (``generate(prompt_lookup_num_tokens=N)``) on the same inputs.
5. **Product lines** of ``mmspec_cli/decoding`` + ``mmspec_cli/drafters`` and **members of the drafter contract**,
   old and new. Target: ≤ 6 members.
6. **``--gamma-schedule cost``** against every constant γ from 1 to 8, compiled, ``m`` and ``eagle``, new tree.
   Target: within 3% of the best constant γ and faster than γ = 5, on each suite. Beside the totals, the ratio
   to that best constant within each interleaved pass (``--reps``), median and range: how much of a gap the
   passes' own spread covers.
7. **Measured speedup over ``ar`` / Eq. (1) with the verification priced as measured**, τ / (γ·c + T(γ+1)/T(1)),
   compiled, ``m``, ``tabed``, ``eagle``, new tree. Target: ≥ 0.9.

How. Each measurement runs in a subprocess (this file with ``--worker JOB``) with one tree first on ``PYTHONPATH``
(checked: the worker refuses to run if ``mmspec_cli`` comes from elsewhere), ``MMSPEC_THREADS=1`` and
``torch.set_num_threads(1)``. Old and new alternate round by round (figure 1: R rounds, one process per tree per
round, the tree that goes first alternating). Only the public API of both trees is used (``ModelSet.load``,
``ModelSet.decoder``, ``apply_overrides``, ``decoder.stream`` and its ``BlockVerified`` events, the demo suites of
``mmspec_cli.inputs.sources``); the time inside model forwards is measured by instrumentation that lives here only:

- torch's global module forward hooks (``register_module_forward_pre_hook`` / ``register_module_forward_hook``)
  time every eager module call (the outermost only: a depth count, so a decoder layer inside a model is not counted
  twice); a hook returns at once while dynamo traces (``torch.compiler.is_compiling()``), so nothing of it enters a
  compiled graph;
- every function ``torch.compile`` returns is wrapped in a timer (``torch.compile`` is replaced in the worker before
  ``mmspec_cli`` is imported), so a compiled graph's call (dynamo's entry included) is forward time, and the
  Python around it (picking the graph, padding, its key) is the engine's. This is the same in both trees whatever
  class calls the graphs (the old tree's ``CompiledGraphs.__call__``); an ``nn.Module`` given to ``torch.compile`` is
  left as it is and timed by the module hooks.

A block's wall time is the time between two consecutive events of ``decoder.stream`` (the consumer's own work kept
out); the first block of each turn (its verification also prefills the prompt, with the images) is left out of
figures 1, 2 and 7: they measure the loop after the prefill. In figure 1, eager blocks run with hooks on every module
call (their cost falls inside the forwards, so it is not charged to the engine); compiled blocks after the warm-up
run no eager module at all (the count is printed: a compiled step that silently fell back to eager shows there).

    python benchmarks/bench_engine_block.py                       # everything, about 25 minutes on 2 CPU cores
    python benchmarks/bench_engine_block.py --quick               # a smoke run of a few minutes
    python benchmarks/bench_engine_block.py --only 1,3,5 --old /path/to/old/tree --new /path/to/new/tree
    # on a GPU machine that has no git history: extract the old tree first, then pass it
    mkdir -p old && git archive dd64559 | tar -x -C old && python benchmarks/bench_engine_block.py --only 1,2 --old old

``--old`` defaults to ``--old-commit`` (dd64559) extracted with ``git archive`` into a temporary folder; ``--new``
to the repository this script lives in. ``--out FILE`` keeps every number as JSON.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tokenize
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]
ENGINE_DRAFTERS = ("ar", "m", "tabed", "eagle", "oracle")
EQ1_DRAFTERS = ("m", "tabed", "eagle")
TOKEN_DRAFTERS = ("ar", "m", "t", "c", "p", "mt", "tabed", "ssd", "eagle", "vispec", "oracle")
TREE_KINDS = {"chain": {}, "width2": {"tree_width": 2}, "dynamic": {"tree": "dynamic"}}
SCHEDULE_DRAFTERS = ("m", "eagle")
CONSTANT_GAMMAS = range(1, 9)
SUITES = ("demo-story", "demo-followup")  # the demo suites with the longest prompts (110-175 tokens)
GAMMA = 5  # the demo profile's γ, used by every figure
ALL_FIGURES = (1, 2, 3, 4, 5, 6, 7)
# 40 repeats: the profile's time is mostly compiling, and with 10 its ratios moved between runs of the same code
# (T(6)/T(1) 1.13-1.36; with 40, 1.31 in two runs: docs/BENCHMARKS.md, ninth session)
LATENCY_ARGS = "--seq 128,256 --gammas 1,2,3,4,5,6,7,8,9 --batch 1,2 --repeat 40"


# ----------------------------------------------------------------------------------------------------------------
# The parent: runs workers, prints the figures.
# ----------------------------------------------------------------------------------------------------------------

class Trees:
    """The two source trees and the temporary folders of the run."""

    def __init__(self, old: Path, new: Path, scratch: Path):
        self.old, self.new, self.scratch = old, new, scratch
        self.paths = {"old": old, "new": new}


def extract_commit(commit: str, into: Path) -> Path:
    """``git archive COMMIT`` of this script's repository, unpacked into ``into`` (nothing is written to the repo)."""
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def run_worker(trees: Trees, side: str, job: dict, env: dict | None = None, timeout: float = 1800) -> dict:
    """Run ``job`` in a fresh process over ``side``'s tree; its JSON result, or {"error": ...}."""
    tree = trees.paths[side]
    job = {**job, "tree": str(tree), "side": side}
    path = Path(tempfile.mkstemp(prefix=f"job-{job['kind']}-{side}-", suffix=".json", dir=trees.scratch)[1])
    out = path.with_suffix(".out.json")
    job["out"] = str(out)
    path.write_text(json.dumps(job))
    started = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, str(HERE), "--worker", str(path)], capture_output=True, text=True,
                              env=worker_env(tree, env), cwd=trees.scratch, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"{job['kind']} on the {side} tree ran past {timeout:.0f} s"}
    seconds = time.perf_counter() - started
    if done.returncode != 0 or not out.exists():
        tail = "\n".join(done.stderr.strip().splitlines()[-12:])
        return {"error": f"{job['kind']} on the {side} tree failed ({done.returncode}):\n{tail}"}
    result = json.loads(out.read_text())
    result["process_s"] = seconds
    result["stderr_notes"] = [line for line in done.stderr.splitlines()
                              if line.startswith(("warning:", "error:", "note:")) or "gamma-schedule" in line
                              or "profile-latency" in line]
    return result


def worker_env(tree: Path, extra: dict | None = None) -> dict:
    """A worker's environment: ``tree`` first on ``PYTHONPATH`` (packages a machine keeps there, as the GPU machines'
    carried wheels, after it), one thread."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MMSPEC_DEBUG")}
    path = os.pathsep.join(p for p in [str(tree), *os.environ.get("PYTHONPATH", "").split(os.pathsep)] if p)
    env.update({"PYTHONPATH": path, "MMSPEC_THREADS": "1", "OMP_NUM_THREADS": "1",
                "TOKENIZERS_PARALLELISM": "false", "PYTHONHASHSEED": "0"})
    env.update(extra or {})
    return env


def small_products(rows: tuple[int, ...] = (1, 6), calls: int = 2000) -> dict[str, float]:
    """µs per call (median) of a linear of 144 -> 396 features (the demo target's MLP) over each of ``rows``, float32,
    in this process (one thread): how much more six verified tokens' products cost than one's on this machine, which
    moved between sessions (docs/BENCHMARKS.md, issue 31's eleventh session)."""
    import torch

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(396, 144, generator=generator)
    found = {}
    for n in rows:
        x = torch.randn(n, 144, generator=generator)
        times = []
        for k in range(calls + 200):
            start = time.perf_counter()
            torch.nn.functional.linear(x, weight)
            if k >= 200:  # warm-up calls first
                times.append(time.perf_counter() - start)
        found[str(n)] = 1e6 * statistics.median(times)
    return found


def median_range(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q = statistics.quantiles(values, n=4)
    return statistics.median(values), q[0], q[2]


def verdict(ok: bool | None) -> str:
    return "SKIP" if ok is None else ("PASS" if ok else "FAIL")


# --- figure 1 (and the data of 2 and 7) ---------------------------------------------------------------------------

def engine_runs(trees: Trees, figures: set[int], opts) -> dict:
    """Per tree: a list (one per round) of {mode: {drafter: summary}}."""
    sides = ["old", "new"] if 1 in figures else ["new"]
    modes = ["eager", "compiled"] if 1 in figures else ["compiled"]
    drafters = list(ENGINE_DRAFTERS) if 1 in figures else sorted(
        {"ar"} | ({"oracle"} if 2 in figures else set()) | (set(EQ1_DRAFTERS) if 7 in figures else set()),
        key=ENGINE_DRAFTERS.index)
    job = {"kind": "blocks", "drafters": drafters, "modes": modes, "samples": opts.engine_samples,
           "max_new_tokens": opts.max_new_tokens, "history_turns": opts.history_turns}
    runs: dict[str, list] = {side: [] for side in sides}
    for r in range(opts.rounds):
        order = sides if r % 2 == 0 else sides[::-1]
        for side in order:
            result = run_worker(trees, side, job)
            print(f"  round {r + 1}/{opts.rounds}, {side} tree: "
                  + (result["error"].splitlines()[0] if "error" in result else f"{result['process_s']:.0f} s"),
                  flush=True)
            if "error" in result:
                print(result["error"])
            runs[side].append(result)
    return runs


def steady(summaries: list[dict]) -> dict:
    """The rounds' steady-state blocks pooled: engine µs per block (each block), and the sums."""
    pooled = {"engine_us": [], "wall_s": 0.0, "forward_s": 0.0, "tokens": 0, "blocks": 0, "drafted": 0,
              "eager_calls": 0, "round_medians": []}
    for s in summaries:
        pooled["engine_us"] += s["engine_us"]
        pooled["round_medians"].append(statistics.median(s["engine_us"]) if s["engine_us"] else float("nan"))
        for key in ("wall_s", "forward_s", "tokens", "blocks", "drafted", "eager_calls"):
            pooled[key] += s[key]
    return pooled


def figure_engine(runs: dict, report: dict) -> None:
    print("\n## 1. The engine's own time per block (block wall time - time inside model forwards), after the prefill")
    if not runs.get("old") or not runs.get("new"):
        print("no runs of both trees: SKIP")
        return
    ok_all, rows = True, {}
    # wall time beside it: a change that moves host work into a graph (or into a model's own forward) moves it
    # into "forwards" without making anything faster; its wall time says whether it did
    print("mode | drafter | old µs/block (IQR; range of round medians) | new µs/block (IQR; range) | new/old | "
          "blocks old/new | ms in forwards per block old/new | wall ms per token old/new (new/old) | verdict")
    for mode in ("eager", "compiled"):
        for drafter in ENGINE_DRAFTERS:
            found = {}
            for side in ("old", "new"):
                parts = [r[mode][drafter] for r in runs[side] if "error" not in r and drafter in r.get(mode, {})]
                if parts:
                    found[side] = steady(parts)
            if len(found) < 2 or not found["old"]["engine_us"] or not found["new"]["engine_us"]:
                print(f"{mode} | {drafter} | missing | | | | | FAIL")
                ok_all = False
                continue
            cells, medians = [], {}
            for side in ("old", "new"):
                m, q1, q3 = quartiles(found[side]["engine_us"])
                lo, hi = min(found[side]["round_medians"]), max(found[side]["round_medians"])
                medians[side] = m
                cells.append(f"{m:.0f} ({q1:.0f}-{q3:.0f}; {lo:.0f}-{hi:.0f})")
            ratio = medians["new"] / medians["old"] if medians["old"] > 0 else float("inf")
            ok = ratio <= 0.5
            ok_all &= ok
            fwd = [1000 * found[s]["forward_s"] / max(found[s]["blocks"], 1) for s in ("old", "new")]
            wall = [1000 * found[s]["wall_s"] / max(found[s]["tokens"], 1) for s in ("old", "new")]
            eager = [found[s]["eager_calls"] for s in ("old", "new")]
            note = f" (eager module calls in these blocks old/new: {eager[0]}/{eager[1]})" if mode == "compiled" else ""
            print(f"{mode} | {drafter} | {cells[0]} | {cells[1]} | {ratio:.2f} | {found['old']['blocks']}/"
                  f"{found['new']['blocks']} | {fwd[0]:.2f}/{fwd[1]:.2f} | {wall[0]:.3f}/{wall[1]:.3f} "
                  f"({wall[1] / wall[0]:.3f}) | {verdict(ok)}{note}")
            rows[f"{mode} {drafter}"] = {"old_us": medians["old"], "new_us": medians["new"], "ratio": ratio,
                                         "old_wall_ms_per_token": wall[0], "new_wall_ms_per_token": wall[1]}
    print(f"figure 1 verdict (every row new ≤ 0.5 × old): {verdict(ok_all)}")
    report["figure1"] = {"rows": rows, "pass": ok_all}


def profiled_bound(latency: dict | None, contexts: list[float]) -> float | None:
    """(γ+1)·T_p(1)/T_p(γ+1) from profile-latency's JSON at the mean of ``contexts``; None without both sizes."""
    try:
        target = {tuple(int(x) for x in k.split(",")): v for k, v in (latency or {})["target_ms"].items()}
    except (KeyError, ValueError, AttributeError, TypeError):
        return None
    context = statistics.mean(contexts) if contexts else 0
    t1 = at({s: v for (s, n), v in target.items() if n == 1}, context)
    tv = at({s: v for (s, n), v in target.items() if n == GAMMA + 1}, context)
    return None if t1 is None or tv is None else (GAMMA + 1) * t1 / tv


def per_token(s: dict, key: str) -> float:
    return s[key] / s["tokens"] if s["tokens"] else float("nan")


def figure_oracle(runs: dict, latency: dict | None, report: dict) -> None:
    print("\n## 2. oracle compiled: measured speedup over ar / its bound, after the prefill")
    print("bound = ar's forward time per token / oracle's forward time per token, both measured in the same blocks "
          "(= (γ+1)·T_p(1)/T_p(γ+1) when every block verifies γ+1 tokens); measured = ar's wall time per token / "
          "oracle's")
    result = None
    for side in ("old", "new"):
        parts = {d: [r["compiled"][d] for r in runs.get(side, []) if "error" not in r and d in r.get("compiled", {})]
                 for d in ("ar", "oracle")}
        if not parts["ar"] or not parts["oracle"]:
            continue
        ar, oracle = steady(parts["ar"]), steady(parts["oracle"])
        measured = per_token(ar, "wall_s") / per_token(oracle, "wall_s")
        bound = per_token(ar, "forward_s") / per_token(oracle, "forward_s")
        tau = oracle["tokens"] / max(oracle["blocks"], 1)
        share = measured / bound
        label = "" if side == "new" else " (for reference)"
        print(f"{side}{label}: ar {1000 * per_token(ar, 'wall_s'):.3f} ms/token, oracle "
              f"{1000 * per_token(oracle, 'wall_s'):.3f} ms/token (τ {tau:.2f}); measured {measured:.2f}x, bound "
              f"{bound:.2f}x, measured/bound {share:.3f}")
        profiled = profiled_bound(latency, [x for r in parts["oracle"] for x in r["contexts"]])
        if profiled:
            print(f"  cross-check: the bound from profile-latency's compiled T_p at the mean context: {profiled:.2f}x "
                  f"(measured/that bound {measured / profiled:.3f}; not judged)")
        if side == "new":
            result = share
    ok = None if result is None else result >= 0.95
    print(f"figure 2 verdict (new: measured/bound ≥ 0.95): {verdict(ok)}")
    report["figure2"] = {"measured_over_bound": result, "pass": ok}


# --- figure 3 -----------------------------------------------------------------------------------------------------

def figure_tokens(trees: Trees, opts, report: dict) -> None:
    print("\n## 3. Greedy outputs: new == old == the target's own HF generate(do_sample=False)")
    job = {"kind": "tokens", "drafters": list(TOKEN_DRAFTERS), "samples": opts.token_samples,
           "max_new_tokens": opts.token_max_new, "kinds": list(TREE_KINDS)}
    found = {}
    for side in ("old", "new"):
        found[side] = run_worker(trees, side, job)
        if "error" in found[side]:
            print(found[side]["error"])
        else:
            print(f"  {side} tree: {found[side]['process_s']:.0f} s")
    if any("error" in f for f in found.values()):
        print(f"figure 3 verdict: {verdict(False)} (a run failed)")
        report["figure3"] = {"pass": False}
        return
    old, new = found["old"], found["new"]
    compared = mismatches = 0
    lines, changed, refused = [], [], []
    for case in sorted(set(old["cases"]) | set(new["cases"]), key=lambda c: (c.split()[2], c.split()[1],
                                                                              c.split()[0])):
        a, b = old["cases"].get(case), new["cases"].get(case)
        if a is None or b is None:  # a drafter only one tree has (pld)
            only = "new" if a is None else "old"
            got = a or b
            if "tokens" in got:
                hf_ok = all(got["tokens"][k] == (new if only == "new" else old)["hf"][k] for k in got["tokens"])
                compared += 1
                mismatches += not hf_ok
                lines.append(f"{case}: {only} tree only, equal to HF: {'yes' if hf_ok else 'NO'}")
            else:
                lines.append(f"{case}: {only} tree only, refused: {got['error']}")
            continue
        if "error" in a or "error" in b:
            if "error" in a and "error" in b:
                refused.append(case)
            else:
                changed.append(f"{case}: old {'refused: ' + a['error'] if 'error' in a else 'ran'}, new "
                               f"{'refused: ' + b['error'] if 'error' in b else 'ran'}")
            continue
        compared += 1
        bad = []
        for sample, tokens in b["tokens"].items():
            if tokens != a["tokens"].get(sample):
                bad.append(f"{sample}: new != old")
            if tokens != new["hf"][sample]:
                bad.append(f"{sample}: new != HF")
            if a["tokens"].get(sample) != old["hf"][sample]:
                bad.append(f"{sample}: old != HF")
        if bad:
            mismatches += 1
            lines.append(f"{case}: MISMATCH ({'; '.join(bad)})")
    hf_same = old["hf"] == new["hf"]
    print(f"cases compared (drafter × tree kind × mode, each over {len(new['hf'])} sample(s) of "
          f"{opts.token_max_new} tokens): {compared}; mismatches: {mismatches}; HF's own output the same under both "
          f"trees: {'yes' if hf_same else 'NO'}")
    print(f"refused by both trees ({len(refused)}): {', '.join(refused) or 'none'}")
    for line in changed:
        print(f"refused by one tree only: {line}")
    for line in lines:
        print(line)
    for kind in TREE_KINDS:
        for mode in ("eager", "compiled"):
            ran = [c.split()[0] for c, v in new["cases"].items() if c.split()[1:] == [kind, mode] and "tokens" in v]
            print(f"  {kind}, {mode}: {' '.join(ran) or 'none'}")
    ok = mismatches == 0 and hf_same and not changed and compared > 0
    print(f"figure 3 verdict (no mismatch, the same refusals): {verdict(ok)}")
    report["figure3"] = {"compared": compared, "mismatches": mismatches, "refused_by_both": refused,
                         "changed": changed, "pass": ok}


def ended_without_numbers(result: dict, figure: int, report: dict) -> bool:
    """A worker's failure or skip, printed with the figure's verdict and kept in ``report``; whether there was one."""
    if "error" in result:
        print(result["error"])
        print(f"figure {figure} verdict: {verdict(False)}")
        report[f"figure{figure}"] = {"pass": False}
        return True
    if result.get("skipped"):
        print(f"skipped: {result['skipped']}")
        print(f"figure {figure} verdict: {verdict(None)}")
        report[f"figure{figure}"] = {"skipped": result["skipped"], "pass": None}
        return True
    return False


# --- figure 4 -----------------------------------------------------------------------------------------------------

def figure_pld(trees: Trees, opts, report: dict) -> None:
    print("\n## 4. pld (prompt lookup) against HF's prompt lookup, new tree, eager")
    job = {"kind": "pld", "samples": [[suite, opts.pld_samples] for suite in SUITES],
           "max_new_tokens": opts.max_new_tokens, "reps": opts.reps, "hf_tokens": [GAMMA, 10]}
    result = run_worker(trees, "new", job)
    if ended_without_numbers(result, 4, report):
        return
    print(f"γ = {GAMMA}; HF: target.generate(do_sample=False, prompt_lookup_num_tokens=N), its n-gram size "
          f"max_matching_ngram_size left at HF's default (2); τ = new tokens / target forwards (HF's counted with a "
          f"forward hook); speed = the baseline's seconds per token / the row's (mmspec: ar, eager; HF: HF's own "
          f"greedy generate); {opts.reps} interleaved pass(es)")
    print("suite | row | τ | ms/token | speed over its baseline | outputs equal greedy")
    for suite, rows in result["suites"].items():
        for name, row in rows.items():
            print(f"{suite} | {name} | {row['tau']:.2f} | {row['ms_per_token']:.3f} | {row['speedup']:.2f}x | "
                  f"{'yes' if row['equal'] else 'NO'}")
    ok = all(row["equal"] for rows in result["suites"].values() for row in rows.values())
    print(f"figure 4 verdict (reported; pld's outputs equal ar's): {verdict(ok)}")
    report["figure4"] = {"suites": result["suites"], "pass": ok}


# --- figure 5 -----------------------------------------------------------------------------------------------------

def code_lines(path: Path) -> tuple[int, int]:
    """(non-blank lines, lines of code: non-blank, not comment-only, outside docstrings) of one Python file."""
    text = path.read_text()
    lines = text.splitlines()
    nonblank = {i for i, line in enumerate(lines, 1) if line.strip()}
    comments = set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT and lines[tok.start[0] - 1].strip().startswith("#"):
            comments.add(tok.start[0])
    docstrings = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and \
                    isinstance(first.value.value, str):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    return len(nonblank), len(nonblank - comments - docstrings)


def public_members(tree: Path, class_name: str) -> tuple[str, list[str]] | None:
    """(file, the public names declared on class ``class_name``: methods, properties, class attributes and
    annotations) in ``mmspec_cli/decoding`` or ``mmspec_cli/drafters``; None when no such class exists."""
    for folder in ("decoding", "drafters"):
        for path in sorted((tree / "mmspec_cli" / folder).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef) and node.name == class_name:
                    names = []
                    for item in node.body:
                        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                            names.append(item.name)
                        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                            names.append(item.target.id)
                        elif isinstance(item, ast.Assign):
                            names += [t.id for t in item.targets if isinstance(t, ast.Name)]
                    public = [n for n in dict.fromkeys(names) if not n.startswith("_")]
                    return str(path.relative_to(tree)), public
    return None


def figure_size(trees: Trees, report: dict) -> None:
    print("\n## 5. Product lines in mmspec_cli/decoding + mmspec_cli/drafters; members of the drafter contract")
    print("lines: non-blank; code = non-blank, neither a comment-only line nor inside a module/class/function "
          "docstring. members: the public names declared on the class (methods, properties, class attributes and "
          "annotations), inherited ones not counted; the TreeDrafting mixin's added where the tree has one")
    result = {}
    for side, tree in trees.paths.items():
        files = sorted(path for folder in ("decoding", "drafters")
                       for path in (tree / "mmspec_cli" / folder).glob("*.py"))
        nonblank = code = 0
        for path in files:
            a, b = code_lines(path)
            nonblank, code = nonblank + a, code + b
        contract = public_members(tree, "Drafter")
        mixin = public_members(tree, "TreeDrafting")
        members = (contract[1] if contract else []) + (mixin[1] if mixin else [])
        result[side] = {"files": len(files), "nonblank": nonblank, "code": code, "members": len(members),
                        "drafter": contract, "tree_drafting": mixin}
        print(f"{side}: {len(files)} files, {nonblank} non-blank lines, {code} lines of code; drafter contract "
              f"{len(members)} members")
        if contract:
            print(f"  Drafter ({contract[0]}): {len(contract[1])}: {', '.join(contract[1])}")
        if mixin:
            print(f"  TreeDrafting ({mixin[0]}): {len(mixin[1])}: {', '.join(mixin[1])}")
    ok = result["new"]["members"] <= 6 and result["new"]["drafter"] is not None
    print(f"lines new/old: {result['new']['code'] / max(result['old']['code'], 1):.2f} (code), "
          f"{result['new']['nonblank'] / max(result['old']['nonblank'], 1):.2f} (non-blank)")
    print(f"figure 5 verdict (new contract ≤ 6 members): {verdict(ok)}")
    report["figure5"] = {**result, "pass": ok}


# --- figures 6 and 7 ----------------------------------------------------------------------------------------------

def profile_latency(trees: Trees, opts) -> tuple[Path, dict | None, str | None]:
    """``mmspec profile-latency --profile demo --compile`` of the new tree, once, into a fresh MMSPEC_CACHE."""
    cache = trees.scratch / "mmspec-cache"
    cache.mkdir(exist_ok=True)
    args = [sys.executable, "-m", "mmspec_cli", "profile-latency", "--profile", "demo", "--compile", "--threads",
            "1", "--json", *opts.latency_args.split()]
    print(f"  {' '.join(['mmspec', *args[3:]])} (MMSPEC_CACHE={cache})", flush=True)
    started = time.perf_counter()
    try:
        done = subprocess.run(args, capture_output=True, text=True, cwd=trees.scratch, timeout=1800,
                              env=worker_env(trees.new, {"MMSPEC_CACHE": str(cache)}))
    except subprocess.TimeoutExpired:
        return cache, None, "profile-latency ran past 1800 s"
    print(f"  profile-latency: {time.perf_counter() - started:.0f} s", flush=True)
    if done.returncode != 0:
        return cache, None, f"profile-latency failed ({done.returncode}): {done.stderr.strip().splitlines()[-1:]}"
    try:
        return cache, json.loads(done.stdout.strip().splitlines()[-1]), None
    except (json.JSONDecodeError, IndexError):
        return cache, None, f"profile-latency printed no JSON: {done.stdout[-300:]}"


def figure_schedule(trees: Trees, cache: Path, latency_error: str | None, opts, report: dict) -> None:
    print("\n## 6. --gamma-schedule cost against every constant γ (1-8), compiled, new tree")
    if latency_error:
        print(f"profile-latency: {latency_error}; the cost schedule runs without its measurements")
    job = {"kind": "schedule", "samples": [[suite, opts.schedule_samples] for suite in SUITES],
           "drafters": list(SCHEDULE_DRAFTERS), "max_new_tokens": opts.max_new_tokens, "reps": opts.reps,
           "gammas": list(CONSTANT_GAMMAS), "cost_gamma": opts.cost_gamma}
    result = run_worker(trees, "new", job, env={"MMSPEC_CACHE": str(cache)})
    if ended_without_numbers(result, 6, report):
        return
    for note in result["stderr_notes"]:
        print(f"  worker said: {note}")
    print(f"cost runs with γ = {opts.cost_gamma} (a turn's opening blocks'); tokens/s = new tokens / the turns' decoding seconds (the turns' "
          f"stats.wall_s: compile time left out), all {opts.schedule_samples} sample(s) of each suite × {opts.reps} "
          f"interleaved pass(es)")
    print("drafter | suite | " + " | ".join(f"γ={g}" for g in CONSTANT_GAMMAS) +
          " | cost (mean γ drafted) | cost / best constant | per pass: median (range) | cost / γ=5 | verdict")
    ok_all = True
    rows = {}
    for drafter, suites in result["rates"].items():
        for suite, rates in suites.items():
            constants = {int(g): rates[str(g)] for g in CONSTANT_GAMMAS}
            best_gamma = max(constants, key=constants.get)
            best = constants[best_gamma]
            cost = rates["cost"]
            ok = cost >= 0.97 * best and cost > constants[5]
            ok_all &= ok
            # the pass-to-pass spread: cost against that same best constant γ, and γ = 5, within each pass
            per_pass = [(p["cost"] / p[str(best_gamma)], p["cost"] / p["5"]) for p in rates.get("passes", [])]
            rows[f"{drafter} {suite}"] = {"constants": constants, "cost": cost, "ok": ok, "best_gamma": best_gamma,
                                          "per_pass": per_pass}
            spread = (f"{statistics.median(b for b, _ in per_pass):.3f} ({min(b for b, _ in per_pass):.3f}-"
                      f"{max(b for b, _ in per_pass):.3f})" if per_pass else "-")
            print(f"{drafter} | {suite} | " + " | ".join(f"{constants[g]:.0f}" for g in CONSTANT_GAMMAS) +
                  f" | {cost:.0f} ({result['mean_gamma'][drafter][suite]:.2f}) | {cost / best:.3f} (γ={best_gamma}) | "
                  f"{spread} | {cost / constants[5]:.3f} | {verdict(ok)}")
    print(f"figure 6 verdict (cost ≥ 0.97 × the best constant γ and > γ=5, every row): {verdict(ok_all)}")
    report["figure6"] = {"rows": rows, "pass": ok_all}


def at(points: dict[int, float], x: float) -> float | None:
    """``points`` (S -> ms) linearly interpolated at ``x`` (the nearest end outside the grid); None when empty."""
    if not points:
        return None
    grid = sorted(points)
    if x <= grid[0] or len(grid) == 1:
        return points[grid[0]]
    if x >= grid[-1]:
        return points[grid[-1]]
    hi = next(s for s in grid if s >= x)
    lo = max(s for s in grid if s < x)
    return points[lo] + (points[hi] - points[lo]) * (x - lo) / (hi - lo)


def figure_eq1(runs: dict, latency: dict | None, latency_error: str | None, report: dict) -> None:
    print("\n## 7. Measured speedup over ar / Eq. (1) with the verification priced as measured, compiled")
    if latency is None:
        print(f"no latency profile ({latency_error}): {verdict(False)}")
        report["figure7"] = {"pass": False}
        return
    try:
        target = {tuple(int(x) for x in k.split(",")): v for k, v in latency["target_ms"].items()}
        draft = {tuple(int(x) for x in k.split(",")): v for k, v in latency["draft_ms"].items()}
        heads = {kind: {int(s): v for s, v in ms.items()} for kind, ms in latency["head_ms"].items()}
    except (KeyError, ValueError, AttributeError) as exc:
        print(f"profile-latency's JSON has no usable target_ms/draft_ms/head_ms ({exc!r}): {verdict(False)}")
        report["figure7"] = {"pass": False}
        return
    print("Eq. = τ / (γ·c + T(γ+1)/T(1)), c = the draft step (B rows: 1 for m, 2 for tabed; the head's step for "
          "eagle) / T(1); T(n) = the target's compiled forward of n tokens after S cached ones; all from "
          "profile-latency, interpolated linearly in S at the blocks' mean context (prompt + half the answer); τ and "
          "the measured speedup over the blocks after the prefill (figure 1's compiled runs)")
    result, ok_all = {}, True
    for side in ("new", "old"):
        parts = {d: [r["compiled"][d] for r in runs.get(side, []) if "error" not in r and d in r.get("compiled", {})]
                 for d in ("ar", *EQ1_DRAFTERS)}
        if not parts["ar"]:
            continue
        ar = steady(parts["ar"])
        for drafter in EQ1_DRAFTERS:
            if not parts[drafter]:
                continue
            s = steady(parts[drafter])
            context = statistics.mean(x for r in parts[drafter] for x in r["contexts"])
            t1 = at({s: v for (s, n), v in target.items() if n == 1}, context)
            tv = at({s: v for (s, n), v in target.items() if n == GAMMA + 1}, context)
            if drafter == "eagle":
                step = at(heads.get("eagle", {}), context)
            else:
                rows = 2 if drafter == "tabed" else 1
                step = at({s: v for (b, s), v in draft.items() if b == rows}, context)
            if None in (t1, tv, step):
                print(f"{side} | {drafter}: profile-latency lacks T(1), T({GAMMA + 1}) or the draft step: "
                      f"{verdict(False)}")
                ok_all &= side != "new"
                continue
            tau = s["tokens"] / max(s["blocks"], 1)
            c = step / t1
            eq = tau / (GAMMA * c + tv / t1)
            measured = per_token(ar, "wall_s") / per_token(s, "wall_s")
            share = measured / eq
            ok = share >= 0.9
            if side == "new":
                ok_all &= ok
            result[f"{side} {drafter}"] = {"tau": tau, "c": c, "verify_ratio": tv / t1, "eq1": eq,
                                           "measured": measured, "share": share}
            print(f"{side}{'' if side == 'new' else ' (for reference)'} | {drafter} | mean context {context:.0f} | "
                  f"τ {tau:.2f} | c {c:.3f} | T({GAMMA + 1})/T(1) {tv / t1:.2f} | Eq. {eq:.2f}x | "
                  f"measured {measured:.2f}x | measured/Eq. {share:.2f} | {verdict(ok) if side == 'new' else ''}")
    ok = ok_all and any(k.startswith("new") for k in result)
    print(f"figure 7 verdict (new: measured/Eq. ≥ 0.9 for m, tabed, eagle): {verdict(ok)}")
    report["figure7"] = {"rows": result, "pass": ok}


# --- main ---------------------------------------------------------------------------------------------------------

def options(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", type=Path, help="the old tree (default: --old-commit extracted with git archive)")
    parser.add_argument("--old-commit", default="dd64559")
    parser.add_argument("--new", type=Path, default=REPO, help="the new tree (default: this script's repository)")
    parser.add_argument("--only", default=None, help="figures to run, e.g. 1,3,5 (default: all)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 round, fewer samples and tokens")
    parser.add_argument("--rounds", type=int, default=None, help="figure 1: rounds of old and new (default 3)")
    parser.add_argument("--reps", type=int, default=None,
                        help="figures 4, 6: interleaved passes over the samples (default 2; --quick 1)")
    parser.add_argument("--cost-gamma", type=int, default=GAMMA,
                        help="figure 6: the γ given with --gamma-schedule cost, which only a turn's opening blocks draft "
                             "(default 5: the demo profile's, what a user's run gets)")
    parser.add_argument("--latency-args", default=LATENCY_ARGS, help="profile-latency's grid (figures 6, 7)")
    parser.add_argument("--history-turns", type=int, default=0,
                        help="figures 1, 2, 7: give each sample this many earlier (question, answer) turns as history, "
                             "so its prompt is longer (24: about 1,500 tokens on the demo family; default 0)")
    parser.add_argument("--out", type=Path, default=None, help="also write every number here as JSON")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (jobs, caches, old tree)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    quick = args.quick
    args.figures = set(ALL_FIGURES) if args.only is None else {int(x) for x in args.only.split(",") if x.strip()}
    args.rounds = args.rounds or (1 if quick else 3)
    args.reps = args.reps or (1 if quick else 2)
    args.max_new_tokens = 64 if quick else 160
    args.engine_samples = [["demo-story", 1]] if quick else [["demo-story", 2], ["demo-followup", 2]]
    args.token_samples = [["demo-story", 1]] if quick else [["demo-story", 1], ["demo-followup", 1]]
    args.token_max_new = 24 if quick else 48
    args.pld_samples = 1 if quick else 4
    args.schedule_samples = 1 if quick else 3
    return args


def main() -> None:
    args = options()
    if args.worker:
        worker_main(Path(args.worker))
        return
    import torch

    from bench_demo_suites import machine

    torch.set_num_threads(1)  # as the workers run: the machine line names their thread count
    started = time.perf_counter()
    scratch = Path(tempfile.mkdtemp(prefix="mmspec-engine-block-"))
    report: dict = {"figures": sorted(args.figures)}
    try:
        old = args.old.resolve() if args.old else extract_commit(args.old_commit, scratch / "old-tree")
        trees = Trees(old, args.new.resolve(), scratch)
        print(f"machine: {machine()} (each worker: MMSPEC_THREADS=1, torch.set_num_threads(1)); Python "
              f"{sys.version.split()[0]}")
        print(f"load average at the start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        print(f"old tree: {old}{'' if args.old else f' (commit {args.old_commit})'}; new tree: {trees.new}")
        print(f"figures {','.join(map(str, sorted(args.figures)))}{' (--quick)' if args.quick else ''}; demo profile, "
              f"greedy, γ = {GAMMA}")
        report["machine"] = machine()
        report["small_products_us"] = small_products()
        one, six = report["small_products_us"]["1"], report["small_products_us"]["6"]
        print(f"small matrix products here (a linear of 144 -> 396, the demo target's MLP, float32, one thread; median "
              f"of 2000): 1 row {one:.1f} µs, 6 rows {six:.1f} µs ({six / one:.2f}x): context for figure 7's T(6)/T(1)")
        if 5 in args.figures:
            guarded(lambda: figure_size(trees, report))
        runs: dict = {}
        if args.figures & {1, 2, 7}:
            print("\n(figures 1, 2, 7: the block runs)", flush=True)
            runs = guarded(lambda: engine_runs(trees, args.figures, args)) or {}
        if 1 in args.figures:  # it needs the block runs alone: printed before the slow latency profile
            guarded(lambda: figure_engine(runs, report))
        latency, latency_error, cache = None, None, scratch / "mmspec-cache"
        if args.figures & {2, 6, 7}:
            print("\n(figures 2, 6, 7: the latency profile of the new tree)", flush=True)
            found = guarded(lambda: profile_latency(trees, args))
            if found:
                cache, latency, latency_error = found
            else:
                latency_error = "profile-latency raised"
        if 2 in args.figures:
            guarded(lambda: figure_oracle(runs, latency, report))
        if 3 in args.figures:
            guarded(lambda: figure_tokens(trees, args, report))
        if 4 in args.figures:
            guarded(lambda: figure_pld(trees, args, report))
        if 6 in args.figures:
            guarded(lambda: figure_schedule(trees, cache, latency_error, args, report))
        if 7 in args.figures:
            guarded(lambda: figure_eq1(runs, latency, latency_error, report))
        print("\n## Verdicts")
        for n in sorted(args.figures):
            entry = report.get(f"figure{n}", {})
            print(f"figure {n}: {verdict(entry.get('pass')) if entry else 'FAIL (not measured)'}")
        print(f"\nmachine: {machine()}; load average at the end: "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; wall time {time.perf_counter() - started:.0f} s")
        if args.out:
            args.out.write_text(json.dumps(report, indent=1, default=str))
    finally:
        if args.keep:
            print(f"kept {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)


def guarded(step):
    """Run one figure; a failure is printed and the run goes on (the script exits 0 whatever it measures)."""
    try:
        return step()
    except Exception:
        print(f"this figure raised:\n{traceback.format_exc()}")
        return None


# ----------------------------------------------------------------------------------------------------------------
# The worker: one tree, one job, in its own process. Only the public API of both trees is used.
# ----------------------------------------------------------------------------------------------------------------

class ForwardClock:
    """Seconds spent inside model forwards: eager module calls (torch's global module hooks, the outermost call
    only) and calls of the functions ``torch.compile`` returned. On a GPU the device is synchronized at both edges
    of each outermost forward (``sync``), so a forward's kernels count as forward time and the kernels the engine
    launched between forwards (an argmax, a mask) as the engine's, instead of surfacing at the next read."""

    def __init__(self):
        self.depth = 0
        self.began = 0.0
        self.seconds = 0.0
        self.eager_calls = 0  # outermost eager module calls
        self.graph_calls = 0  # outermost compiled-function calls
        self.sync = None  # torch.cuda.synchronize when the models are on a GPU (install)

    def enter(self) -> None:
        if self.depth == 0:
            if self.sync is not None:
                self.sync()
            self.began = time.perf_counter()
        self.depth += 1

    def leave(self) -> None:
        self.depth -= 1
        if self.depth == 0:
            if self.sync is not None:
                self.sync()
            self.seconds += time.perf_counter() - self.began

    def install(self) -> None:
        """Before ``mmspec_cli`` is imported: the module hooks, and ``torch.compile`` replaced by a timed one."""
        import torch
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        compiling = torch.compiler.is_compiling
        clock = self
        clock.sync = torch.cuda.synchronize if torch.cuda.is_available() else None

        def before(module, args):
            if compiling():  # dynamo traces this away: nothing of the clock enters a graph
                return None
            if clock.depth == 0:
                clock.eager_calls += 1
            clock.enter()
            return None

        def after(module, args, output):
            if compiling():
                return None
            clock.leave()
            return None

        register_module_forward_pre_hook(before)
        register_module_forward_hook(after, always_call=True)
        original = torch.compile

        def timed_compile(model=None, **kwargs):
            if model is None:  # used as @torch.compile(...)
                return lambda fn: timed_compile(fn, **kwargs)
            compiled = original(model, **kwargs)
            return compiled if isinstance(model, torch.nn.Module) else TimedGraph(compiled, clock)

        torch.compile = timed_compile


class TimedGraph:
    """A compiled function whose calls count as forward time (attributes pass through)."""

    def __init__(self, fn, clock: ForwardClock):
        self._fn, self._clock = fn, clock

    def __call__(self, *args, **kwargs):
        clock = self._clock
        if clock.depth == 0:
            clock.graph_calls += 1
        clock.enter()
        try:
            return self._fn(*args, **kwargs)
        finally:
            clock.leave()

    def __getattr__(self, name):
        return getattr(self._fn, name)


def worker_main(path: Path) -> None:
    job = json.loads(path.read_text())
    clock = ForwardClock()
    if job["kind"] == "blocks":
        clock.install()  # before mmspec_cli (and its torch.compile calls) is imported
    import torch

    torch.set_num_threads(1)
    import mmspec_cli

    where = Path(mmspec_cli.__file__).resolve()
    if not where.is_relative_to(Path(job["tree"]).resolve()):
        raise SystemExit(f"mmspec_cli was imported from {where}, not from the tree {job['tree']}")
    jobs = {"blocks": job_blocks, "tokens": job_tokens, "pld": job_pld, "schedule": job_schedule}
    result = jobs[job["kind"]](job, clock)
    Path(job["out"]).write_text(json.dumps(result))


def load_models(drafters, compiled: bool):
    """The demo profile's models for ``drafters`` (``compile`` set in the profile when compiled decoders are built)."""
    from mmspec_cli.api import ModelSet
    from mmspec_cli.models.profiles import apply_overrides, load_profile

    profile = apply_overrides(load_profile("demo"), compile=True) if compiled else load_profile("demo")
    return ModelSet.load(profile, list(drafters), threads=1)


def decoder_for(models, drafter: str, recorded=None, step_costs=None, **overrides):
    """A fresh decoder of ``drafter`` over ``models``, with the profile's decoding settings overridden (and, for
    ``--gamma-schedule cost``, the step costs it chooses γ from)."""
    import copy

    from mmspec_cli.models.profiles import apply_overrides

    chosen = copy.copy(models)
    chosen.profile = apply_overrides(models.profile, **overrides)
    if step_costs is not None:
        return chosen.decoder(drafter, step_costs=step_costs)
    return chosen.decoder(drafter, recorded=recorded) if recorded is not None else chosen.decoder(drafter)


def interleaved(names: Sequence[str], samples: Sequence, reps: int) -> Iterator[tuple[int, Any, str]]:
    """(pass, sample, name) in the order a comparison runs them: every name on each sample, the name that goes first
    rotating sample by sample and pass by pass, so that no name always runs first or after the same one."""
    for rep in range(reps):
        for k, sample in enumerate(samples):
            shift = (k + rep) % len(names)
            for name in names[shift:] + names[:shift]:
                yield rep, sample, name


def samples_of(spec) -> list:
    from mmspec_cli.inputs.sources import resolve

    return [sample for suite, n in spec for sample in resolve(suite, n)]


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:200]


def stream_blocks(decoder, sample, clock: ForwardClock, max_new_tokens: int) -> tuple[list[dict], list, str]:
    """Decode ``sample``; per block: wall and forward seconds, tokens, whether it is a turn's first; the turns'
    token ids; the last turn's prompt text. A block's wall time runs from the event before it to its own event."""
    from mmspec_cli.decoding.events import BlockVerified, TurnFinished, TurnStarted

    blocks, turns, prompt = [], [], ""
    first = True
    mark_t, mark_f, mark_e = time.perf_counter(), clock.seconds, clock.eager_calls
    for event in decoder.stream(list(sample.images), list(sample.turns), history=tuple(sample.history),
                                max_new_tokens=max_new_tokens):
        now, forward, eager = time.perf_counter(), clock.seconds, clock.eager_calls
        if isinstance(event, TurnStarted):
            first, prompt = True, event.prompt
        elif isinstance(event, BlockVerified):
            blocks.append({"wall": now - mark_t, "forward": forward - mark_f, "eager": eager - mark_e,
                           "tokens": len(event.tokens), "drafted": len(event.draft), "first": first})
            first = False
        elif isinstance(event, TurnFinished):
            turns.append(list(event.result.token_ids))
        mark_t, mark_f, mark_e = time.perf_counter(), clock.seconds, clock.eager_calls
    return blocks, turns, prompt


def job_blocks(job: dict, clock: ForwardClock) -> dict:
    """Figure 1's runs: per mode and drafter, the blocks after each turn's first, over every sample, after a warm-up
    pass over every sample (which compiles every shape the measured pass meets)."""
    drafters, modes = job["drafters"], job["modes"]
    models = load_models([d for d in drafters], compiled="compiled" in modes)
    samples = with_history(samples_of(job["samples"]), job.get("history_turns", 0))
    limit = job["max_new_tokens"]
    result = {}
    for mode in modes:
        settings = {"compile": mode == "compiled", "max_new_tokens": limit}
        built = {d: decoder_for(models, d, **settings) for d in drafters if d != "oracle"}
        recorded = {}
        for sample in samples:  # warm-up; ar's tokens are what oracle replays
            for name, decoder in built.items():
                _, turns, _ = stream_blocks(decoder, sample, clock, limit)
                if name == "ar":
                    recorded[sample.id] = turns
        if "oracle" in drafters:  # a fresh oracle per run: it replays its recording's turns once
            for sample in samples:
                stream_blocks(decoder_for(models, "oracle", recorded=recorded[sample.id], **settings), sample,
                              clock, limit)
        found = {d: {"engine_us": [], "wall_s": 0.0, "forward_s": 0.0, "tokens": 0, "blocks": 0, "drafted": 0,
                     "eager_calls": 0, "contexts": []} for d in drafters}
        for k, sample in enumerate(samples):
            order = drafters[k % len(drafters):] + drafters[:k % len(drafters)]  # rotated: each sees the same load
            for name in order:
                decoder = (decoder_for(models, "oracle", recorded=recorded[sample.id], **settings)
                           if name == "oracle" else built[name])
                blocks, _, _ = stream_blocks(decoder, sample, clock, limit)
                entry = found[name]
                made = 0
                for block in blocks:
                    made += block["tokens"]
                    if block["first"]:
                        continue
                    entry["engine_us"].append(1e6 * (block["wall"] - block["forward"]))
                    entry["wall_s"] += block["wall"]
                    entry["forward_s"] += block["forward"]
                    entry["tokens"] += block["tokens"]
                    entry["blocks"] += 1
                    entry["drafted"] += block["drafted"]
                    entry["eager_calls"] += block["eager"]
                entry["contexts"].append(prompt_length(models, sample) + made / 2)
        result[mode] = found
    return result


#: A given earlier turn, repeated to lengthen a prompt (``--history-turns``): the demo family's own words.
HISTORY_TURN = ("What shapes are in the picture, and what colours are they?",
                "There is a red circle on the left, a blue square in the middle and a green triangle on the right; "
                "the circle is the largest shape and the triangle the smallest.")


def with_history(samples: list, turns: int) -> list:
    """``samples`` with ``turns`` copies of :data:`HISTORY_TURN` before their own history: longer prompts, the same
    questions."""
    import dataclasses

    if not turns:
        return samples
    return [dataclasses.replace(s, history=(HISTORY_TURN,) * turns + tuple(s.history)) for s in samples]


def prompt_length(models, sample) -> int:
    """The sample's prompt length in target tokens (images expanded), from the rendered prompt."""
    from mmspec_cli.models.prompts import render_prompt

    processor = models.target.processor
    text = render_prompt(processor, list(sample.turns), [], len(sample.images), history=tuple(sample.history))
    inputs = processor(images=list(sample.images) or None, text=text, return_tensors="pt")
    return int(inputs["input_ids"].shape[1])


def hf_inputs(target, sample, prompt: str):
    """The processor's tensors for ``prompt`` (the text mmspec rendered for the turn) and the sample's images."""
    images = list(sample.images)
    inputs = target.processor(images=images or None, text=prompt, return_tensors="pt").to(target.model.device)
    if "pixel_values" in inputs:
        inputs["pixel_values"] = inputs["pixel_values"].to(target.model.dtype)
    return inputs


def hf_generate(target, sample, prompt: str, max_new_tokens: int, **kwargs) -> tuple[list[int], int, float]:
    """HF ``generate`` greedy (``kwargs``: prompt lookup): the new tokens, the target's forwards, seconds (the
    processor outside the clock)."""
    import torch

    inputs = hf_inputs(target, sample, prompt)
    calls = [0]
    handle = target.model.register_forward_pre_hook(lambda module, args: calls.__setitem__(0, calls[0] + 1))
    try:
        with torch.inference_mode():
            start = time.perf_counter()
            out = target.model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens, **kwargs)
            seconds = time.perf_counter() - start
    finally:
        handle.remove()
    return out[0, inputs["input_ids"].shape[1]:].tolist(), calls[0], seconds


def job_tokens(job: dict, clock: ForwardClock) -> dict:
    """Figure 3: every drafter × tree kind × mode on the samples; the target's own HF generate of each prompt."""
    drafters = list(job["drafters"])
    try:
        load_models(["pld"], compiled=False)
        drafters.append("pld")
    except Exception:
        pass
    models = load_models(drafters, compiled=True)
    samples = samples_of(job["samples"])
    limit = job["max_new_tokens"]
    hf, recorded, cases = {}, {}, {}
    for sample in samples:
        ar = decoder_for(models, "ar", max_new_tokens=limit)
        _, turns, prompt = stream_blocks(ar, sample, clock, limit)
        recorded[sample.id] = turns
        hf[sample.id] = hf_generate(models.target, sample, prompt, limit)[0]
    for mode in ("eager", "compiled"):
        for kind in job["kinds"]:
            for drafter in drafters:
                if drafter in ("ar", "oracle") and kind != "chain":
                    continue  # ar drafts nothing (a tree is moot); oracle replays a chain (refused with a tree)
                case = f"{drafter} {kind} {mode}"
                try:
                    tokens = {}
                    for sample in samples:
                        decoder = decoder_for(models, drafter, recorded=recorded[sample.id] if drafter == "oracle"
                                              else None, compile=mode == "compiled", max_new_tokens=limit,
                                              **TREE_KINDS[kind])
                        _, turns, _ = stream_blocks(decoder, sample, clock, limit)
                        tokens[sample.id] = turns[-1]
                    cases[case] = {"tokens": tokens}
                except Exception as exc:
                    cases[case] = {"error": one_line(exc)}
    return {"hf": hf, "cases": cases, "drafters": drafters}


def job_pld(job: dict, clock: ForwardClock) -> dict:
    """Figure 4: mmspec ``ar`` and ``pld`` (eager) beside HF greedy and HF prompt lookup, interleaved per sample."""
    drafter = job.get("drafter", "pld")  # another name only to try this job on a tree without pld
    try:
        models = load_models(["ar", drafter], compiled=False)
    except Exception as exc:
        return {"skipped": f"the new tree has no drafter {drafter} ({one_line(exc)})"}
    limit = job["max_new_tokens"]
    decoders = {"mmspec ar": decoder_for(models, "ar", max_new_tokens=limit),
                f"mmspec {drafter}": decoder_for(models, drafter, max_new_tokens=limit)}
    configs = [*decoders, "HF greedy", *(f"HF prompt lookup N={n}" for n in job["hf_tokens"])]
    # HF's lookup copies image placeholders from the prompt into its candidates, and LLaVA's forward then refuses
    # them ("Image features and image tokens do not match"): suppressing the placeholder (which greedy decoding
    # never emits) makes HF cut candidates at it (its PromptLookupCandidateGenerator checks the logits processors)
    image_token = models.target.model.config.image_token_id
    suites = {}
    for suite, n in job["samples"]:
        samples = samples_of([[suite, n]])
        prompts = {}
        for k, sample in enumerate(samples):  # warm-up (the first sample), and each prompt as mmspec renders it
            for decoder in (decoders.values() if k == 0 else [decoders["mmspec ar"]]):
                _, _, prompts[sample.id] = stream_blocks(decoder, sample, clock, limit)
        rows = {name: {"tokens": 0, "calls": 0, "seconds": 0.0, "outputs": {}} for name in configs}
        for _, sample, name in interleaved(configs, samples, job["reps"]):
            if name in decoders:
                turn = decoders[name].generate(list(sample.images), list(sample.turns),
                                               history=tuple(sample.history), max_new_tokens=limit).turns[-1]
                tokens, calls, seconds = list(turn.token_ids), turn.stats.blocks, turn.stats.wall_s
            else:
                extra = {} if name == "HF greedy" else {"prompt_lookup_num_tokens": int(name.split("=")[1]),
                                                        "suppress_tokens": [image_token]}
                tokens, calls, seconds = hf_generate(models.target, sample, prompts[sample.id], limit, **extra)
            row = rows[name]
            row["tokens"] += len(tokens)
            row["calls"] += calls
            row["seconds"] += seconds
            row["outputs"][sample.id] = tokens
        out = {}
        for name, row in rows.items():
            base = rows["mmspec ar" if name in decoders else "HF greedy"]
            per_token = row["seconds"] / max(row["tokens"], 1)
            out[name] = {"tau": row["tokens"] / max(row["calls"], 1), "ms_per_token": 1000 * per_token,
                         "speedup": base["seconds"] / max(base["tokens"], 1) / per_token if per_token else 0.0,
                         "equal": row["outputs"] == base["outputs"]}
        suites[suite] = out
    return {"suites": suites}


def job_schedule(job: dict, clock: ForwardClock) -> dict:
    """Figure 6: ``--gamma-schedule cost`` beside constant γ = 1..8, compiled, interleaved per sample."""
    from mmspec_cli.models.profiles import apply_overrides, load_profile

    schedule = job.get("schedule", "cost")  # another name only to try this job on a tree without cost
    try:
        apply_overrides(load_profile("demo"), gamma_schedule=schedule)
    except Exception as exc:
        return {"skipped": f"the new tree refuses --gamma-schedule {schedule} ({one_line(exc)})"}
    models = load_models(job["drafters"], compiled=True)
    limit = job["max_new_tokens"]
    configs = [*(str(g) for g in job["gammas"]), "cost"]
    rates, mean_gamma = {}, {}
    for drafter in job["drafters"]:
        costs = None
        if schedule == "cost":  # what the CLI does: the step costs profile-latency cached, read for this drafter
            from mmspec_cli.bench.latency import run_step_costs

            cost_profile = apply_overrides(models.profile, compile=True, gamma_schedule=schedule, gamma=job["cost_gamma"])
            found, note = run_step_costs(cost_profile, [drafter], models.target.model.device, 1)
            if note:
                print(note, file=sys.stderr)
            costs = found.get(drafter)
        decoders = {name: decoder_for(models, drafter, compile=True, max_new_tokens=limit,
                                      **({"gamma_schedule": schedule, "gamma": job["cost_gamma"], "step_costs": costs}
                                         if name == "cost" else {"gamma": int(name)}))
                    for name in configs}
        rates[drafter], mean_gamma[drafter] = {}, {}
        for suite, n in job["samples"]:
            samples = samples_of([[suite, n]])
            for decoder in decoders.values():  # warm-up: compiles every chain length and verification size
                for sample in samples:
                    decoder.generate(list(sample.images), list(sample.turns), history=tuple(sample.history),
                                     max_new_tokens=limit)
            tokens = [{name: 0 for name in configs} for _ in range(job["reps"])]  # per pass
            seconds = [{name: 0.0 for name in configs} for _ in range(job["reps"])]
            drafted = []
            for rep, sample, name in interleaved(configs, samples, job["reps"]):
                turn = decoders[name].generate(list(sample.images), list(sample.turns),
                                               history=tuple(sample.history), max_new_tokens=limit).turns[-1]
                tokens[rep][name] += turn.stats.new_tokens
                seconds[rep][name] += turn.stats.wall_s
                if name == "cost":
                    drafted += [len(block.draft) for block in turn.blocks]
            rates[drafter][suite] = {name: sum(t[name] for t in tokens) / sum(s[name] for s in seconds)
                                     for name in configs}
            rates[drafter][suite]["passes"] = [{name: t[name] / s[name] for name in configs}
                                               for t, s in zip(tokens, seconds)]
            mean_gamma[drafter][suite] = statistics.mean(drafted) if drafted else 0.0
    return {"rates": rates, "mean_gamma": mean_gamma}


if __name__ == "__main__":
    main()
