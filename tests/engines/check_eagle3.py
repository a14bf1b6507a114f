"""An mmspec EAGLE-3 head in vLLM and in mmspec, same target, same prompts: same tokens, and the acceptance of both.

Runs in mmspec's venv; vLLM runs in .venv-vllm (vllm_env.py) through vllm_run.py, one engine at a time::

    .venv/bin/python tests/engines/check_eagle3.py [HEAD] [--prompts 5] [--max-tokens 64] [--spec-tokens 3] \\
        [--source demo-story] [--work DIR] [--report FILE.json]

HEAD defaults to the shipped head ``mmspec_cli/shipped/demo-eagle3`` (exit code 2, one line, when it is absent).

Steps:

1. ``mmspec export-head HEAD --to vllm --out WORK/head-vllm`` (the real command, in a subprocess).
2. vLLM 0.32's CPU attention refuses the demo target's head_dim 36, so the target's language model is written as a
   Llama folder (llama_folder.py) and BOTH it and the exported head are re-written with head_dim 64 computing the
   same functions (:func:`llama_folder.pad_head_dim`, :func:`llama_folder.pad_eagle3_head_dim`). The padded head
   is checked against the exported one in mmspec's own ``Eagle3Head``: the same logits on random inputs (max
   |difference| <= 1e-4).
3. The prompts: the first question of each of the first ``--prompts`` conversations of ``--source``, rendered
   text-only through the target's chat template as mmspec renders them (``render_prompt`` + ``process``); their
   token ids go to vLLM as they are. Greedy, ``--max-tokens`` new tokens, stop at EOS; K = ``--spec-tokens``.
   Runs: vLLM without speculation ("base"), vLLM with the padded exported head ("eagle3"), mmspec with the
   ORIGINAL head (γ = K, chain, ``SpeculativeDecoder`` + ``HeadDrafter``), and mmspec once more "aligned to vLLM"
   (below).
4. Checks: vLLM's tokens with the head == vLLM's without == mmspec's. Acceptance: vLLM's counters
   (``vllm:spec_decode_*``; mean acceptance length = 1 + accepted / drafts) beside mmspec's τ (new tokens /
   blocks) and both engines' per-position acceptance.

Why the two numbers differ although the head and the tokens are the same (``DIFFERENCES``), and the aligned run:
vLLM's prefill emits the first token with no draft, and its first draft (made in the same step) proposes tokens
2..K+1; mmspec's first block drafts tokens 1..γ and verifies them with the prefill, so its blocks start one token
earlier and cover other stretches of the answer. vLLM drafts K tokens at every step, even when fewer are left of
the budget, and counts acceptances past the budget's end and past EOS (the sampler's count, before the output is
cut); mmspec cuts γ to what is left and counts only the drafts it keeps. The aligned mmspec run removes both: its
prompt is the prompt plus vLLM's first token (``extra_prompt_ids``), its budget is long enough that γ is never cut
before the N-th token, and it records each block's raw ``verdict.accepted``; its blocks that start before the N-th
token are then exactly vLLM's drafts, so its counters should be vLLM's (what is left: float kernels, padding).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
DEMO_TARGET = REPO / "mmspec_cli" / "shipped" / "demo-target"
SHIPPED_HEAD = REPO / "mmspec_cli" / "shipped" / "demo-eagle3"
PADDED_HEAD_DIM = 64
LOGITS_TOLERANCE = 1e-4
#: What can make vLLM's mean acceptance length and mmspec's τ differ on the same head, target and tokens.
DIFFERENCES = [
    "alignment: vLLM's prefill emits the first token undrafted and its drafts start at token 2; mmspec's first block "
    "drafts tokens 1..γ and is verified by the prefill, so the two engines' blocks cover other stretches of the "
    "answer (the aligned mmspec run starts from vLLM's first token and removes this)",
    "what is counted: vLLM's mean acceptance length is 1 + accepted / drafts over decode steps only; mmspec's τ is "
    "new tokens / blocks, its first block (the prefill) included; 'vllm_tokens_per_target_step' counts vLLM alike",
    "budget end: vLLM drafts K tokens at every step even when fewer than K + 1 are left, and counts acceptances "
    "past max_tokens; mmspec cuts γ to what is left (γ = room − 1) and counts only kept drafts",
    "EOS: vLLM's count is the sampler's, before the output is cut at EOS; mmspec counts accepted drafts up to EOS",
    "numerics: vLLM runs the head and the target in float32 with its own CPU kernels (fused QKV, its attention, "
    "batched prompts), mmspec in transformers' float32 eager/SDPA; a near-tie argmax can differ",
    "padding: vLLM runs both models with head_dim 64 (zero-padded, theta^(64/36), q scaled); the same function up "
    "to float rounding (checked: logits within 1e-4)",
]


# --------------------------------------------------------------------------- mmspec side


def load_target(dtype: str = "float32"):
    from mmspec_cli.models.loading import load_model
    from mmspec_cli.models.profiles import ModelSpec

    return load_model(ModelSpec(model="mmspec:demo-target", dtype=dtype, device="cpu"), "target")


def demo_questions(source: str = "demo-story", n: int = 5) -> list[str]:
    """The first question of each of the first ``n`` conversations of ``source`` (its images left out)."""
    from mmspec_cli.inputs.sources import resolve

    return [sample.turns[0] for sample in resolve(source, n)]


def prompt_ids(target, question: str) -> list[int]:
    """The token ids mmspec feeds for ``question`` alone, with no image."""
    from mmspec_cli.models.prompts import process, render_prompt

    return process(target.processor, render_prompt(target.processor, [question], [], 0), []).ids


def export_for_vllm(head, out) -> Path:
    """``mmspec export-head HEAD --to vllm --out OUT``, the installed command, in a subprocess."""
    mmspec = Path(sys.executable).with_name("mmspec")
    cmd = [str(mmspec), "export-head", str(head), "--to", "vllm", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout}{done.stderr}")
    return Path(out)


def head_from_folder(folder, seed: int = 0):
    """mmspec's ``Eagle3Head`` of a head folder (any layout mmspec reads), float32, with a random embedding (no
    target needed)."""
    import torch

    from mmspec_cli.models.eagle3 import Eagle3Head, default_layers
    from mmspec_cli.models.eagle3_files import EMBEDDING, layer_config, read_folder, to_mmspec

    raw, tensors = read_folder(Path(folder), str(folder))
    config, tensors = to_mmspec(raw, tensors, str(folder))
    layers = config["mmspec"].get("layers") or list(default_layers(8))
    head = Eagle3Head(layer_config(config), layers, config["draft_vocab_size"], config["target_hidden_size"])
    g = torch.Generator().manual_seed(seed)
    embedding = torch.randn(config["vocab_size"], config["hidden_size"], generator=g)
    state = {k: (v.float() if v.is_floating_point() else v) for k, v in tensors.items()}
    head.load_state_dict({**state, EMBEDDING: embedding}, strict=True)
    return head.float().eval()


def padded_head_difference(original, padded, seq: int = 24, offset: int = 37, seed: int = 0) -> float:
    """Max |logit difference| between two head folders on the same random (B=2, seq) inputs: fused pairs through
    the layer at positions offset.., a second step fed with the first's outputs (as a drafted entry is), then the
    draft logits."""
    import torch

    a, b = head_from_folder(original), head_from_folder(padded)
    g = torch.Generator().manual_seed(seed)
    width = len(a.layers_read) * a.target_hidden
    features = torch.randn(2, seq, width, generator=g)
    tokens = torch.randint(0, a.config.vocab_size, (2, seq), generator=g)
    positions = (offset + torch.arange(seq)).expand(2, seq)
    worst = 0.0
    with torch.no_grad():
        outs = []
        for head in (a, b):
            embeds = a.embed_tokens(tokens)  # the same embedding for both (the target's, in the engines)
            h = head.body(head.fuse(embeds, features), positions, None)
            h2 = head.body(head.feed_own(embeds, h), positions + 1, None)
            outs.append((head.draft_logits(h), head.draft_logits(h2)))
        for x, y in zip(*outs):
            worst = max(worst, (x - y).abs().max().item())
    return worst


@contextlib.contextmanager
def extra_prompt_ids(extra: list[int]):
    """While inside: mmspec's decoder feeds ``extra`` token ids after each rendered prompt (the aligned run; a
    harness patch of ``mmspec_cli.decoding.engine.process``, undone on exit)."""
    from mmspec_cli.decoding import engine
    from mmspec_cli.models.prompts import ModelPrompt

    original = engine.process

    def process(processor, text, images):
        prompt = original(processor, text, images)
        return ModelPrompt(ids=list(prompt.ids) + list(extra), vision=prompt.vision)

    engine.process = process
    try:
        yield
    finally:
        engine.process = original


def per_position(drafts: list[tuple[int, int]], k: int) -> tuple[list[int], list[int]]:
    """(accepted, drafted) per draft position from (drafted length, accepted) pairs: position i counts the drafts
    of more than i tokens, and those whose first i + 1 tokens were accepted."""
    accepted, drafted = [0] * k, [0] * k
    for length, acc in drafts:
        for i in range(min(length, k)):
            drafted[i] += 1
            accepted[i] += acc > i
    return accepted, drafted


def mmspec_runs(head_dir, questions: list[str], k: int, n: int, first_tokens: list[int] | None = None) -> dict:
    """mmspec with the head (γ = k, greedy chain) on each question; and, given vLLM's first tokens, the aligned run.

    Returns {"outputs", "stats" (sums), "tau", "per_pos", "drafted_per_pos", "wall_s", "aligned": {...}}."""
    from mmspec_cli.decoding.engine import SpeculativeDecoder
    from mmspec_cli.decoding.metrics import RunStats
    from mmspec_cli.drafters.head import HeadDrafter
    from mmspec_cli.models.head_files import load_head

    target = load_target()
    head = load_head(str(head_dir), "eagle3", None, target)
    outputs, stats, blocks, wall = [], [], [], 0.0
    for question in questions:
        decoder = SpeculativeDecoder(target, HeadDrafter(target, head), gamma=k, max_new_tokens=n)
        t0 = time.perf_counter()
        turn = decoder.generate([], [question]).turns[0]
        wall += time.perf_counter() - t0
        outputs.append(list(turn.token_ids))
        stats.append(turn.stats)
        blocks.append([(len(b.draft), b.accepted) for b in turn.blocks])
    total = RunStats.total(stats)
    accepted, drafted = per_position([b for bs in blocks for b in bs], k)
    result = {"outputs": outputs, "new_tokens": total.new_tokens, "blocks": total.blocks,
              "drafted": total.drafted, "accepted": total.accepted, "tau": total.block_efficiency,
              "tau_per_prompt": [s.block_efficiency for s in stats],
              "acceptance_rate": total.acceptance_rate, "per_pos": accepted, "drafted_per_pos": drafted,
              "full_gamma_blocks": sum(1 for bs in blocks for length, _ in bs if length == k),
              "wall_s": round(wall, 2)}
    if first_tokens is not None:
        result["aligned"] = aligned_run(target, head, questions, k, n, first_tokens)
    return result


def aligned_run(target, head, questions: list[str], k: int, n: int, first_tokens: list[int]) -> dict:
    """mmspec's blocks where vLLM's steps are: prompt + vLLM's first token, γ = k never cut before token n (budget
    n − 1 + k), each block's raw ``verdict.accepted``; the blocks that start before the n-th token, counted as vLLM
    counts its drafts."""
    from mmspec_cli.decoding.engine import SpeculativeDecoder
    from mmspec_cli.drafters.head import HeadDrafter

    drafts, outputs, per_prompt = [], [], []
    for question, first in zip(questions, first_tokens):
        decoder = SpeculativeDecoder(target, HeadDrafter(target, head), gamma=k, max_new_tokens=n - 1 + k)
        raw: list[tuple[int, int, int]] = []  # (tokens before the block, drafted, accepted)
        run, done = decoder.step.run, [0]

        def recorded(prompt, generated, gamma, picker, run=run, raw=raw):
            outcome = run(prompt, generated, gamma, picker)
            raw.append((1 + len(generated), len(outcome.draft), outcome.verdict.accepted))
            return outcome

        decoder.step.run = recorded
        with extra_prompt_ids([first]):
            turn = decoder.generate([], [question]).turns[0]
        outputs.append([first] + list(turn.token_ids))
        kept = [(length, acc) for start, length, acc in raw if start < n]
        assert all(length == k for length, _ in kept), kept
        drafts.extend(kept)
        per_prompt.append({"drafts": len(kept), "accepted": sum(a for _, a in kept)})
    accepted, _ = per_position(drafts, k)
    count, total = len(drafts), sum(a for _, a in drafts)
    return {"drafts": count, "draft_tokens": k * count, "accepted_tokens": total, "accepted_per_pos": accepted,
            "mean_acceptance_length": 1 + total / count if count else None, "per_prompt": per_prompt,
            "outputs_first_n": [o[:n] for o in outputs]}


def identity_vocabulary_fixup(folder) -> list[str]:
    """vLLM 0.32's ``Eagle3LlamaForCausalLM`` has no ``draft_id_to_target_id`` parameter when ``draft_vocab_size``
    equals the target's vocabulary, and refuses a head that holds ``d2t`` then ("There is no module or parameter
    named 'draft_id_to_target_id'"). A head over the whole vocabulary (the demo target's 1200 tokens) has an
    all-zero ``d2t`` (identity): drop ``d2t`` and ``t2d`` from ``folder`` (a copy this check owns) and say so.
    Returns the fix-ups made (empty: the export loads as it is)."""
    import torch
    from safetensors.torch import load_file, save_file

    config = json.loads((Path(folder) / "config.json").read_text())
    tensors = load_file(str(Path(folder) / "model.safetensors"))
    if config.get("draft_vocab_size") != config.get("vocab_size") or "d2t" not in tensors:
        return []
    if bool(torch.any(tensors["d2t"] != 0)):
        raise AssertionError("draft_vocab_size == vocab_size but d2t is not the identity")
    dropped = [name for name in ("d2t", "t2d") if name in tensors]
    save_file({k: v for k, v in tensors.items() if k not in dropped}, str(Path(folder) / "model.safetensors"),
              metadata={"format": "pt"})
    return [f"dropped the identity {' and '.join(dropped)} (draft_vocab_size == vocab_size == "
            f"{config['vocab_size']}): vLLM 0.32 refuses d2t then (no 'draft_id_to_target_id' parameter)"]


# --------------------------------------------------------------------------- vLLM side


def vllm_python() -> Path:
    sys.path.insert(0, str(HERE))
    from vllm_env import ensure_venv

    return ensure_venv(REPO / ".venv-vllm")


def run_vllm(python, target, head, prompts_file, out, n: int, k: int) -> dict:
    """vllm_run.py in .venv-vllm: "base" and "eagle3" (its log to ``out``.log)."""
    cmd = [str(python), str(HERE / "vllm_run.py"), "--target", str(target), "--head", str(head), "--prompts",
           str(prompts_file), "--max-tokens", str(n), "--spec-tokens", str(k), "--dtype", "float32", "--out",
           str(out)]
    with open(str(out) + ".log", "w") as log:
        subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=3000)
    return json.loads(Path(out).read_text())


# --------------------------------------------------------------------------- the check


def prepare(head, work: Path, source: str, n_prompts: int, head_dim: int = PADDED_HEAD_DIM) -> dict:
    """Export, pad, check the padded head; the prompts. Returns the folders, questions, prompt ids and timings."""
    sys.path.insert(0, str(HERE))
    from llama_folder import pad_eagle3_head_dim, pad_head_dim, write_language_model

    t0 = time.perf_counter()
    exported = export_for_vllm(head, work / "head-vllm")
    t1 = time.perf_counter()
    llama = pad_head_dim(write_language_model(DEMO_TARGET, work / "demo-llama", dtype="float32"),
                         work / f"demo-llama{head_dim}", head_dim)
    padded = pad_eagle3_head_dim(exported, work / f"head-vllm{head_dim}", head_dim)
    difference = padded_head_difference(exported, padded)
    if difference > LOGITS_TOLERANCE:
        raise AssertionError(f"the padded head's logits differ from the exported head's by {difference:.2e}")
    fixups = identity_vocabulary_fixup(padded)
    target = load_target()
    questions = demo_questions(source, n_prompts)
    prompts = [prompt_ids(target, q) for q in questions]
    (work / "prompts.json").write_text(json.dumps(prompts))
    return {"exported": exported, "llama": llama, "padded": padded, "questions": questions, "prompts": prompts,
            "padded_logits_max_diff": difference, "export_fixups": fixups, "export_s": round(t1 - t0, 2),
            "prepare_s": round(time.perf_counter() - t0, 2)}


def compare(vllm: dict, mm: dict, n: int, k: int, n_prompts: int) -> dict:
    """The comparison: outputs, acceptance side by side, and what is asserted."""
    base, spec = vllm["configs"]["base"], vllm["configs"]["eagle3"]
    counters = spec["spec"]
    vllm_tokens = sum(len(o) for o in spec["outputs"])
    aligned = mm["aligned"]
    return {
        "outputs": {"vllm_eagle3_equals_vllm_base": spec["outputs"] == base["outputs"],
                    "mmspec_equals_vllm_base": mm["outputs"] == base["outputs"],
                    "aligned_mmspec_equals_vllm_base": aligned["outputs_first_n"] == base["outputs"],
                    "lengths": [len(o) for o in base["outputs"]],
                    "ended_at_eos": [len(o) < n for o in base["outputs"]]},
        "vllm": {"drafts": counters.get("drafts"), "draft_tokens": counters.get("draft_tokens"),
                 "accepted_tokens": counters.get("accepted_tokens"),
                 "accepted_per_pos": counters.get("accepted_per_pos"),
                 "acceptance_rate_per_pos": [a / counters["drafts"] for a in counters["accepted_per_pos"]]
                 if counters.get("drafts") else None,
                 "mean_acceptance_length": counters.get("mean_acceptance_length"),
                 "tokens_per_target_step": vllm_tokens / (n_prompts + counters.get("drafts", 0))},
        "mmspec": {key: mm[key] for key in ("new_tokens", "blocks", "drafted", "accepted", "tau", "tau_per_prompt",
                                            "acceptance_rate", "per_pos", "drafted_per_pos", "full_gamma_blocks")}
        | {"acceptance_rate_per_pos": [a / d if d else None for a, d in zip(mm["per_pos"], mm["drafted_per_pos"])],
           "mean_acceptance_length": 1 + mm["accepted"] / mm["blocks"] if mm["blocks"] else None},
        "mmspec_aligned_to_vllm": {key: v for key, v in aligned.items() if key != "outputs_first_n"},
        "aligned_equals_vllm_counters": [aligned[key] for key in ("drafts", "accepted_tokens", "accepted_per_pos")]
        == [counters.get(key) for key in ("drafts", "accepted_tokens", "accepted_per_pos")],
    }


def run_check(head=SHIPPED_HEAD, work=None, source: str = "demo-story", n_prompts: int = 5, n: int = 64,
              k: int = 3) -> dict:
    """Everything above; returns the report (raises nothing on a mismatch: see :func:`failures`)."""
    os.environ.setdefault("MMSPEC_THREADS", "1")
    head = Path(head)
    if not (head / "config.json").is_file():
        raise FileNotFoundError(f"no EAGLE-3 head at {head} (train one, or pass a head folder)")
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        work = Path(work) if work else Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="eagle3-")))
        work.mkdir(parents=True, exist_ok=True)
        prep = prepare(head, work, source, n_prompts)
        python = vllm_python()
        vllm = run_vllm(python, prep["llama"], prep["padded"], work / "prompts.json", work / "vllm.json", n, k)
        errors = {name: c["error"] for name, c in vllm["configs"].items() if "error" in c}
        if errors:
            raise RuntimeError(f"vLLM failed: {errors} (log: {work / 'vllm.json.log'})")
        first = [o[0] for o in vllm["configs"]["base"]["outputs"]]
        mm = mmspec_runs(head, prep["questions"], k, n, first)
    report = {
        "head": str(head), "source": source, "prompts": n_prompts, "max_tokens": n, "spec_tokens": k,
        "vllm_version": vllm["vllm_version"], "padded_head_dim": PADDED_HEAD_DIM,
        "padded_logits_max_diff": prep["padded_logits_max_diff"], "export_fixups": prep["export_fixups"],
        "prompt_lengths": [len(p) for p in prep["prompts"]], "questions": prep["questions"],
        **compare(vllm, mm, n, k, n_prompts),
        "differences": DIFFERENCES,
        "timings_s": {"export": prep["export_s"], "prepare": prep["prepare_s"],
                      "vllm_base": {key: vllm["configs"]["base"][key] for key in ("start_s", "generate_s", "wall_s")},
                      "vllm_eagle3": {key: vllm["configs"]["eagle3"][key] for key in ("start_s", "generate_s",
                                                                                      "wall_s")},
                      "mmspec_decode": mm["wall_s"], "total": round(time.perf_counter() - start, 2)},
        "machine": machine(),
    }
    report["failures"] = failures(report)
    return report


def failures(report: dict) -> list[str]:
    """What the check asserts, as sentences of what went wrong (empty: all well).

    Export: the exported folder loads in vLLM as written (a fix-up this check had to make is a failure, reported).
    Tokens: equal in all three runs. Acceptance: the aligned mmspec run (vLLM's block boundaries, γ never cut,
    raw counts) must give vLLM's counters, to within one accepted token per prompt and position (float kernels:
    a near-tie may flip); mmspec's own τ is reported, not asserted, beside vLLM's (its gap is the alignment and
    budget-end accounting, DIFFERENCES)."""
    out = [f"`mmspec export-head --to vllm` wrote a head vLLM {report['vllm_version']} refuses; the check {fix}"
           for fix in report.get("export_fixups", [])]
    outputs = report["outputs"]
    if not outputs["vllm_eagle3_equals_vllm_base"]:
        out.append("vLLM's tokens with the head differ from vLLM's without it")
    if not outputs["mmspec_equals_vllm_base"]:
        out.append("mmspec's tokens differ from vLLM's")
    if not outputs["aligned_mmspec_equals_vllm_base"]:
        out.append("the aligned mmspec run's tokens differ from vLLM's")
    vllm, aligned = report["vllm"], report["mmspec_aligned_to_vllm"]
    if vllm["drafts"] != aligned["drafts"]:
        out.append(f"vLLM made {vllm['drafts']} drafts, the aligned mmspec run {aligned['drafts']}")
    slack = report["prompts"]
    for i, (a, b) in enumerate(zip(vllm["accepted_per_pos"] or [], aligned["accepted_per_pos"])):
        if abs(a - b) > slack:
            out.append(f"position {i}: vLLM accepted {a}, the aligned mmspec run {b} (more than {slack} apart)")
    if report["padded_logits_max_diff"] > LOGITS_TOLERANCE:
        out.append(f"padded head logits differ by {report['padded_logits_max_diff']:.2e}")
    return out


def machine() -> dict:
    import platform

    import torch

    return {"cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform()}


def table(report: dict) -> str:
    """A short text table of the report."""
    v, m, a = report["vllm"], report["mmspec"], report["mmspec_aligned_to_vllm"]
    k = report["spec_tokens"]

    def rates(values, counts):
        return " ".join(f"{x / c:.3f}" if c else "-" for x, c in zip(values, counts))

    rows = [
        ("engine", "drafts", "accepted", "accept. length", "τ (tokens/target call)", f"per position 1..{k}"),
        ("vLLM eagle3", v["drafts"], v["accepted_tokens"], f"{v['mean_acceptance_length']:.3f}",
         f"{v['tokens_per_target_step']:.3f}", rates(v["accepted_per_pos"], [v["drafts"]] * k)),
        ("mmspec eagle3", m["blocks"], m["accepted"], f"{m['mean_acceptance_length']:.3f}", f"{m['tau']:.3f}",
         rates(m["per_pos"], m["drafted_per_pos"])),
        ("mmspec aligned", a["drafts"], a["accepted_tokens"], f"{a['mean_acceptance_length']:.3f}", "-",
         rates(a["accepted_per_pos"], [a["drafts"]] * k)),
    ]
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows]
    o = report["outputs"]
    lines.append(f"tokens: vLLM eagle3 == vLLM base: {o['vllm_eagle3_equals_vllm_base']}; mmspec == vLLM: "
                 f"{o['mmspec_equals_vllm_base']}; lengths {o['lengths']}")
    lines.append("failures: " + ("; ".join(report["failures"]) or "none"))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("head", nargs="?", default=str(SHIPPED_HEAD), help="an mmspec EAGLE-3 head folder for the demo "
                   "target (default: the shipped demo-eagle3)")
    p.add_argument("--source", default="demo-story")
    p.add_argument("--prompts", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--spec-tokens", type=int, default=3)
    p.add_argument("--work", help="keep the folders, prompts and vLLM's log here (default: a temporary folder)")
    p.add_argument("--report", help="also write the JSON report here")
    args = p.parse_args(argv)
    if not (Path(args.head) / "config.json").is_file():
        print(f"skipped: no EAGLE-3 head at {args.head} (train one with `mmspec train-head eagle3`, or pass one)")
        return 2
    report = run_check(args.head, args.work, args.source, args.prompts, args.max_tokens, args.spec_tokens)
    text = json.dumps(report, indent=1)
    print(text)
    print(table(report))
    if args.report:
        Path(args.report).write_text(text)
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
