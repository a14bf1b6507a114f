"""mmspec's speculative engine against Hugging Face assisted generation, side by side, on CPU.

One run builds tiny LLaVA target/draft pairs with ``tests.tiny``, saves them, loads them
through ``mmspec_cli.models.loading.load_model`` (float32, cpu) and, on the SAME models and inputs
(1 image + a question, greedy, γ constant), measures:

1. output token ids of mmspec (drafter ``m``) and of ``target.generate(assistant_model=draft)``:
   they must be identical (both are lossless greedy speculative decoding);
2. block efficiency τ = new tokens / target forward calls. mmspec's comes from
   ``generation.stats``; HF's from a public ``register_forward_hook`` on the target model
   (the hook also cross-checks mmspec's count);
3. per-token wall time of each (a warm-up/check run first, then the median of ``--repeats``
   runs, the two engines interleaved and alternating who goes first), the ratio mmspec/HF,
   and how much of each token's time is spent outside the models' forward calls (hooks);
4. the time of ONE draft step (a single-token forward with a KV cache holding an S-token
   prompt) with ``--batch`` rows against 1 row;
5. a decoder-reuse check: the same ``SpeculativeDecoder`` asked about a second image must
   answer as HF does for that image.

Model pairs. transformers' assisted generation (5.x) never gives the assistant the image: the
assistant's prefill runs with ``is_first_iteration=not generation_config.is_assistant``
(generation/utils.py ``_sample``), and ``prepare_inputs_for_generation`` drops everything in
``MULTIMODAL_INPUTS_TO_DROP_OUTSIDE_PREFILL`` (``pixel_values``, ``mm_encoder_outputs``) outside
a first iteration, so the image placeholder tokens reach the assistant as plain token
embeddings. mmspec's ``m`` drafter does feed the pixels. Identical drafts (hence identical τ)
therefore need models whose output does not depend on the pixels:

* ``blind``: target and draft (a perturbed copy of the target, noise ``--draft-scale``) whose
  projector outputs exactly the ``<image>`` token embedding (linear_2 weight 0, bias = that
  embedding): a forward with pixels equals one without. The vision towers still run. Same
  drafts in both engines -> τ must be identical, and the time ratio compares the engines alone.
* ``small``: the same pixel-independent target with a small random pixel-independent draft
  (cheap draft, τ near 1: the engines' per-block overhead weighs most here).
* ``image``: an ordinary target and its perturbed copy, both using the image. Outputs must
  still be identical; τ differs (HF's assistant is image-blind), so τ and time are reported,
  not judged.

Also: HF's ``AssistedCandidateGenerator`` reads ``num_assistant_tokens``,
``num_assistant_tokens_schedule`` and ``assistant_confidence_threshold`` from the ASSISTANT's
``generation_config`` (candidate_generator.py), not from the kwargs of ``target.generate``;
they are set there too, else HF drafts up to 20 tokens and stops at confidence < 0.4.

Run ``python benchmarks/bench_engine_vs_hf.py`` (about 3 minutes on 2 CPU cores) or
``--quick`` for a smoke run. It always exits 0: it is a measurement; verdicts are printed.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import platform
import pstats
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: the tests' model builders
from tests import tiny  # noqa: E402  (test code, not part of the installed package)
from mmspec_cli.drafters import build_drafter  # noqa: E402
from mmspec_cli.decoding.engine import SpeculativeDecoder  # noqa: E402
from mmspec_cli.bench.hf_assisted import assisted_generate  # noqa: E402
from mmspec_cli.models.loading import LoadedModel, load_model  # noqa: E402
from mmspec_cli.models.profiles import ModelSpec  # noqa: E402
from mmspec_cli.models.parts import with_cache  # noqa: E402
from mmspec_cli.models.prompts import render_prompt  # noqa: E402

QUESTION = "what is in the image?"
TARGET_TIME_RATIO = 1.00  # mmspec per-token time / HF per-token time must be <= this
TARGET_BATCH_RATIO = 1.15  # one draft step with --batch rows / with 1 row must be <= this


# --------------------------------------------------------------------------- setup


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: smaller models, fewer tokens and repeats")
    p.add_argument("--gamma", type=int, default=5, help="draft tokens per block (constant)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--hidden", type=int, default=320, help="target hidden size")
    p.add_argument("--layers", type=int, default=6, help="target layers")
    p.add_argument("--draft-scale", type=float, default=0.05,
                   help="relative weight noise of the perturbed-copy drafts (controls acceptance)")
    p.add_argument("--small-hidden", type=int, default=64, help="hidden size of the small random draft")
    p.add_argument("--small-layers", type=int, default=2)
    p.add_argument("--drafts", default="blind,small,image",
                   help="comma list of draft kinds to compare: blind, small, image")
    p.add_argument("--repeats", type=int, default=7, help="timed runs per engine and draft (median)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads for everything")
    p.add_argument("--step-prompt-len", type=int, default=128, help="S: prompt tokens in the KV cache of the draft-step test")
    p.add_argument("--batch", type=int, default=4, help="batch rows of the draft-step test (against 1 row)")
    p.add_argument("--step-repeats", type=int, default=60, help="timed single steps per batch size (median)")
    p.add_argument("--profile", action="store_true",
                   help="also cProfile one mmspec run and one HF run (blind pair) and print where the time goes")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.quick:
        args.hidden, args.layers = min(args.hidden, 128), min(args.layers, 2)
        args.max_new_tokens = min(args.max_new_tokens, 32)
        args.repeats = min(args.repeats, 2)
        args.step_prompt_len = min(args.step_prompt_len, 64)
        args.step_repeats = min(args.step_repeats, 15)
    return args


def machine_lines(threads: int) -> list[str]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        load = "%.2f %.2f %.2f" % os.getloadavg()
    except OSError:
        load = "n/a"
    return [
        f"platform      {platform.platform()}  (python {platform.python_version()})",
        f"cpu           {cpu}  x {os.cpu_count()} logical cores",
        f"torch         {torch.__version__}   transformers {transformers.__version__}",
        f"threads       torch.set_num_threads({threads}) -> get_num_threads() = {torch.get_num_threads()}",
        f"load average  {load} (at start)",
    ]


def blind_projector(model) -> None:
    """Make ``model``'s output independent of the pixels: every image feature becomes exactly
    the embedding of the ``<image>`` token (what a forward without pixels embeds there)."""
    projector = model.model.multi_modal_projector
    embedding = model.get_input_embeddings().weight[tiny.IMAGE_TOKEN_ID]
    with torch.no_grad():
        projector.linear_2.weight.zero_()
        projector.linear_2.bias.copy_(embedding)


def build_models(root: Path, args) -> dict[str, tuple[LoadedModel, LoadedModel]]:
    """``{kind: (target, draft)}`` loaded through mmspec's loader (float32, cpu)."""
    tokenizer = tiny.train_tokenizer()
    processor = tiny.make_processor(tokenizer)
    vocab = len(tokenizer)
    target = tiny.make_model(vocab, seed=args.seed, hidden=args.hidden, layers=args.layers)
    blind_target = tiny.perturbed_copy(target, 0.0, seed=args.seed)  # an exact copy ...
    blind_projector(blind_target)  # ... whose output does not depend on the pixels
    paths = {}
    kinds = [k.strip() for k in args.drafts.split(",") if k.strip()]
    for kind in kinds:
        if kind == "blind":
            draft = tiny.perturbed_copy(blind_target, args.draft_scale, seed=args.seed + 1)
        elif kind == "small":
            draft = tiny.make_model(vocab, seed=args.seed + 7, hidden=args.small_hidden, layers=args.small_layers)
        elif kind == "image":
            draft = tiny.perturbed_copy(target, args.draft_scale, seed=args.seed + 1)
        else:
            raise SystemExit(f"unknown draft kind {kind!r}; use blind, small, image")
        if kind != "image":
            blind_projector(draft)  # after the noise, so it stays exact
            paths.setdefault("blind_target", tiny.save(blind_target, processor, root / "blind_target"))
        else:
            paths.setdefault("target", tiny.save(target, processor, root / "target"))
        paths[kind] = tiny.save(draft, processor, root / kind)
    spec = lambda path: ModelSpec(model=path, dtype="float32", device="cpu")  # noqa: E731
    targets = {name: load_model(spec(paths[name]), "target") for name in ("target", "blind_target") if name in paths}
    pairs = {}
    for kind in kinds:
        d = load_model(spec(paths[kind]), "draft")
        pairs[kind] = (targets["target" if kind == "image" else "blind_target"], d)
    return pairs


# --------------------------------------------------------------------------- hooks


class ForwardMeter:
    """Counts forward calls of a model and the wall time spent inside them (public hooks only)."""

    def __init__(self, model):
        self.calls = 0
        self.inside_s = 0.0
        self._t0 = 0.0
        self._handles = [model.register_forward_pre_hook(self._pre), model.register_forward_hook(self._post)]

    def _pre(self, module, args):
        self._t0 = time.perf_counter()

    def _post(self, module, args, output):
        self.inside_s += time.perf_counter() - self._t0
        self.calls += 1

    def remove(self):
        for h in self._handles:
            h.remove()


# --------------------------------------------------------------------------- the two engines


@dataclass
class RunResult:
    ids: list[int]
    wall_s: float
    blocks: int | None = None  # mmspec: from generation.stats
    target_calls: int | None = None  # from the hook (check runs only)
    draft_calls: int | None = None
    inside_s: float | None = None  # time inside target + draft forwards (check runs only)

    @property
    def per_token_ms(self) -> float:
        return 1e3 * self.wall_s / max(len(self.ids), 1)


def run_mmspec(target, draft, images, args, meters=None) -> RunResult:
    # a fresh decoder per run: a reused one keeps its KV cache across generate() calls (see report)
    decoder = SpeculativeDecoder(target, build_drafter("m", target, draft), gamma=args.gamma,
                                 max_new_tokens=args.max_new_tokens)
    t0 = time.perf_counter()
    generation = decoder.generate(images, [QUESTION])
    wall = time.perf_counter() - t0
    return RunResult(ids=list(generation.turns[0].token_ids), wall_s=wall, blocks=generation.stats.blocks)


def run_hf(target, draft, images, args) -> RunResult:
    """HF assisted generation as mmspec bench runs it (``mmspec_cli.bench.hf_assisted``): γ set on the
    assistant's own generation_config for the call; processor, generate and text decoding timed."""
    text = render_prompt(target.processor, [QUESTION], [], len(images))  # the same prompt text mmspec renders
    result = assisted_generate(target, draft, images, text, args.gamma, args.max_new_tokens)
    return RunResult(ids=result.token_ids, wall_s=result.wall_s)


def checked_run(fn, target, draft, *a) -> RunResult:
    """One run with forward meters on both models (the warm-up run doubles as the check run)."""
    mt, md = ForwardMeter(target.model), ForwardMeter(draft.model)
    try:
        result = fn(target, draft, *a)
    finally:
        mt.remove()
        md.remove()
    result.target_calls, result.draft_calls, result.inside_s = mt.calls, md.calls, mt.inside_s + md.inside_s
    return result


@dataclass
class Comparison:
    kind: str
    same_ids: bool
    n_tokens: int
    mm_blocks: int
    mm_hook_calls: int
    hf_calls: int
    mm_draft_calls: int
    hf_draft_calls: int
    mm_ms: list[float] = field(default_factory=list)
    hf_ms: list[float] = field(default_factory=list)
    mm_outside_ms: float = 0.0
    hf_outside_ms: float = 0.0

    @property
    def mm_tau(self) -> float:
        return self.n_tokens / self.mm_blocks

    @property
    def hf_tau(self) -> float:
        return self.n_tokens / self.hf_calls

    @property
    def same_tau(self) -> bool:
        return self.mm_blocks == self.hf_calls

    @property
    def ratio(self) -> float:
        return statistics.median(self.mm_ms) / statistics.median(self.hf_ms)


def compare(kind, target, draft, images, args) -> Comparison:
    # warm-up + check runs (hooks on), then timed runs (no hooks), interleaved
    mm = checked_run(run_mmspec, target, draft, images, args)
    hf = checked_run(run_hf, target, draft, images, args)
    n = len(hf.ids)
    c = Comparison(kind=kind, same_ids=mm.ids == hf.ids, n_tokens=n, mm_blocks=mm.blocks,
                   mm_hook_calls=mm.target_calls, hf_calls=hf.target_calls,
                   mm_draft_calls=mm.draft_calls, hf_draft_calls=hf.draft_calls,
                   mm_outside_ms=1e3 * (mm.wall_s - mm.inside_s) / max(len(mm.ids), 1),
                   hf_outside_ms=1e3 * (hf.wall_s - hf.inside_s) / max(n, 1))
    if not c.same_ids:
        first = next((i for i, (a, b) in enumerate(zip(mm.ids, hf.ids)) if a != b), min(len(mm.ids), n))
        print(f"  [{kind}] OUTPUTS DIFFER at token {first}: mmspec {mm.ids[first:first + 8]} vs HF {hf.ids[first:first + 8]}")
    for r in range(args.repeats):
        order = (run_mmspec, run_hf) if r % 2 == 0 else (run_hf, run_mmspec)
        for fn in order:
            res = fn(target, draft, images, args)
            (c.mm_ms if fn is run_mmspec else c.hf_ms).append(res.per_token_ms)
    return c


# --------------------------------------------------------------------------- one draft step, B rows vs 1


def step_prompt(model: LoadedModel, length: int, image) -> tuple[list[int], torch.Tensor]:
    """The real 1-image prompt, extended with corpus text to ``length`` tokens."""
    text = render_prompt(model.processor, [QUESTION], [], 1)
    batch = model.processor(images=[image], text=text, return_tensors="pt")
    ids = batch["input_ids"][0].tolist()
    filler = model.tokenizer(" ".join(tiny.CORPUS), add_special_tokens=False)["input_ids"]
    while len(ids) < length:
        ids.extend(filler[: length - len(ids)])
    return ids[:max(length, len(batch["input_ids"][0]))], batch["pixel_values"]


@torch.inference_mode()
def draft_step_times(model: LoadedModel, image, args) -> tuple[float, float, int]:
    """Median time (s) of one single-token forward with a cache holding S prompt tokens: 1 row and B rows."""
    ids, pixels = step_prompt(model, args.step_prompt_len, image)
    states = {}
    for rows in (1, args.batch):
        cache = DynamicCache(config=model.model.config)
        out = model.model(input_ids=torch.tensor([ids] * rows), pixel_values=pixels.repeat(rows, 1, 1, 1).to(model.model.dtype),
                          **with_cache(cache), use_cache=True, logits_to_keep=1)
        next_token = out.logits[:, -1].argmax(-1, keepdim=True)  # (rows, 1)
        states[rows] = (cache, next_token, cache.get_seq_length())
    times = {1: [], args.batch: []}
    warmup = 5
    for i in range(warmup + args.step_repeats):
        for rows in ((1, args.batch) if i % 2 == 0 else (args.batch, 1)):
            cache, token, length = states[rows]
            t0 = time.perf_counter()
            model.model(input_ids=token, **with_cache(cache), use_cache=True, logits_to_keep=1)
            dt = time.perf_counter() - t0
            cache.crop(length - cache.get_seq_length())  # back to S tokens (negative count; not timed)
            if i >= warmup:
                times[rows].append(dt)
    return statistics.median(times[1]), statistics.median(times[args.batch]), len(ids)


# --------------------------------------------------------------------------- decoder reuse check


def reuse_check(target, draft, args) -> tuple[bool, list[int], list[int]]:
    """Reuse one decoder for a second image with the same question; compare with HF on that image."""
    imgs = tiny.images(2)
    decoder = SpeculativeDecoder(target, build_drafter("m", target, draft), gamma=args.gamma,
                                 max_new_tokens=min(args.max_new_tokens, 24))
    decoder.generate([imgs[0]], [QUESTION])
    second = decoder.generate([imgs[1]], [QUESTION]).turns[0].token_ids
    text = render_prompt(target.processor, [QUESTION], [], 1)
    inputs = target.processor(images=[imgs[1]], text=text, return_tensors="pt")
    ref = target.model.generate(**inputs, do_sample=False, max_new_tokens=min(args.max_new_tokens, 24))
    ref_ids = ref[0, inputs["input_ids"].shape[1]:].tolist()
    return list(second) == ref_ids, list(second), ref_ids


# --------------------------------------------------------------------------- profile


def profile_runs(target, draft, images, args) -> None:
    """cProfile one run of each engine. For mmspec, also split the time outside the model
    forwards into the engine's own lines and what they call directly."""
    for name, fn in (("mmspec", run_mmspec), ("HF", run_hf)):
        prof = cProfile.Profile()
        prof.enable()
        res = fn(target, draft, images, args)
        prof.disable()
        stats = pstats.Stats(prof)
        total = stats.total_tt
        # LlavaForConditionalGeneration.forward: the llava-file forward with the largest cumulative time
        forward = max(entry[3] for key, entry in stats.stats.items()
                      if key[2] == "forward" and key[0].endswith("llava/modeling_llava.py"))
        print(f"\n--- cProfile of one {name} run ({len(res.ids)} tokens, {1e3 * total:.0f} ms profiled; "
              f"{100 * forward / total:.1f}% inside LlavaForConditionalGeneration.forward, "
              f"{1e3 * (total - forward) / len(res.ids):.2f} ms/token outside) ---")
        rows = [(ct, tt, nc, f"{_short(path)}:{line}({func})")
                for (path, line, func), (cc, nc, tt, ct, callers) in stats.stats.items()]
        print("  engine functions by cumulative time:")
        mine = "mmspec_cli" if name == "mmspec" else "transformers/generation/"
        for ct, tt, nc, where in sorted((r for r in rows if mine in r[3]), reverse=True)[:14]:
            print(f"    {100 * ct / total:5.1f}% cum  {100 * tt / total:5.1f}% own  {nc:6d} calls  {where}")
        if name == "mmspec":
            print("  time spent by mmspec_cli code itself or in calls it makes directly, model forwards excluded:")
            direct: dict[str, float] = {}
            for (path, line, func), (cc, nc, tt, ct, callers) in stats.stats.items():
                if "mmspec_cli" in path:
                    direct[f"{_short(path)}:{line}({func}) own"] = tt
                    continue
                if func in ("_wrapped_call_impl", "_call_impl", "decorate_context"):
                    continue  # the model forward, and torch's inference_mode decorator where one is still used
                for (cpath, _, _), cstats in callers.items():
                    if "mmspec_cli" in cpath:
                        key = f"{_short(path)}:{line}({func})"
                        direct[key] = direct.get(key, 0.0) + cstats[3]
            overhead = sum(direct.values())
            for key, t in sorted(direct.items(), key=lambda kv: kv[1], reverse=True)[:14]:
                print(f"    {100 * t / total:5.2f}%  {1e3 * t / len(res.ids):6.3f} ms/token  {key}")
            print(f"    (all entries: {100 * overhead / total:.1f}% of the run, {1e3 * overhead / len(res.ids):.3f} "
                  f"ms/token; the rest of the time outside the model forwards is nn.Module call dispatch and "
                  f"the inference_mode wrapper)")


def _short(path: str) -> str:
    for marker in ("site-packages/", "mmspec_cli/", "benchmarks/"):
        if marker in path:
            return (marker if marker != "site-packages/" else "") + path.split(marker, 1)[1]
    return path


# --------------------------------------------------------------------------- main


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    print("== mmspec engine vs Hugging Face assisted generation ==")
    for line in machine_lines(args.threads):
        print(line)
    print(f"setup         target hidden {args.hidden} x {args.layers} layers, float32 cpu; γ={args.gamma}; "
          f"max_new_tokens={args.max_new_tokens}; greedy; 1 image; repeats={args.repeats}; draft noise {args.draft_scale}")
    images = tiny.images(1)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="mmspec-bench-") as tmp:
        pairs = build_models(Path(tmp), args)
        target = next(iter(pairs.values()))[0]
        print(f"target        {args.hidden} hidden x {args.layers} layers, "
              f"{sum(p.numel() for p in target.model.parameters()) / 1e6:.2f}M params, vocab {target.vocab_size}")
        for kind, (_, d) in pairs.items():
            n_params = sum(p.numel() for p in d.model.parameters())
            print(f"draft {kind:6s}  {d.model.config.text_config.hidden_size} hidden x "
                  f"{d.model.config.text_config.num_hidden_layers} layers, {n_params / 1e6:.2f}M params"
                  + ("  (image-using target and draft)" if kind == "image" else "  (pixel-independent target and draft)"))

        comparisons = []
        for kind, (target, d) in pairs.items():
            t0 = time.perf_counter()
            c = compare(kind, target, d, images, args)
            comparisons.append(c)
            print(f"\n[{kind}] {c.n_tokens} tokens; identical ids: {c.same_ids}; ({time.perf_counter() - t0:.0f}s)")
            print(f"  block efficiency  mmspec {c.mm_tau:.3f} ({c.n_tokens}/{c.mm_blocks} blocks; hook saw "
                  f"{c.mm_hook_calls} target calls)   HF {c.hf_tau:.3f} ({c.n_tokens}/{c.hf_calls} target calls)")
            print(f"  draft forwards    mmspec {c.mm_draft_calls}   HF {c.hf_draft_calls}")
            print(f"  ms/token runs     mmspec {['%.2f' % x for x in c.mm_ms]}")
            print(f"                    HF     {['%.2f' % x for x in c.hf_ms]}")
            print(f"  ms/token median   mmspec {statistics.median(c.mm_ms):.2f}   HF {statistics.median(c.hf_ms):.2f}"
                  f"   ratio mmspec/HF {c.ratio:.3f}")
            print(f"  ms/token outside model forwards (check run)   mmspec {c.mm_outside_ms:.2f}   HF {c.hf_outside_ms:.2f}")

        steps = {}
        for kind, (_, d) in pairs.items():
            if kind == "image" and "blind" in pairs:
                continue  # same architecture and size as the blind draft
            one, many, s = draft_step_times(d, images[0], args)
            steps[kind] = (one, many, s)
            print(f"\n[draft step, {kind} draft] S={s} cached tokens: 1 row {1e3 * one:.3f} ms, "
                  f"{args.batch} rows {1e3 * many:.3f} ms, ratio {many / one:.3f}")

        reuse_ok = None
        if "image" in pairs:  # needs a target whose answer depends on the image
            reuse_ok, got, ref = reuse_check(*pairs["image"], args)
            print(f"\n[decoder reuse] 2nd image through the same SpeculativeDecoder matches HF greedy: {reuse_ok}")
            if not reuse_ok:
                print(f"  mmspec {got[:10]}...\n  HF     {ref[:10]}...")

        if args.profile:
            kind = "blind" if "blind" in pairs else next(iter(pairs))
            profile_runs(*pairs[kind], images, args)

    verdict = lambda ok: "PASS" if ok else "FAIL"  # noqa: E731
    print("\n================ SUMMARY ================")
    for line in machine_lines(args.threads)[:4]:
        print(line)
    print(f"γ={args.gamma}, max_new_tokens={args.max_new_tokens}, target {args.hidden}x{args.layers}, "
          f"median of {args.repeats} interleaved runs; total {time.perf_counter() - started:.0f}s")
    print(f"{'draft':7s} {'same ids':9s} {'τ mmspec':>9s} {'τ HF':>7s} {'ms/tok mm':>10s} {'ms/tok HF':>10s} "
          f"{'mm/HF':>6s}  verdicts")
    for c in comparisons:
        judged = c.kind != "image"
        parts = [f"ids {verdict(c.same_ids)}"]
        if judged:
            parts += [f"τ equal {verdict(c.same_tau)}", f"time ≤{TARGET_TIME_RATIO:.2f} {verdict(c.ratio <= TARGET_TIME_RATIO)}"]
        else:
            parts += ["τ/time not judged: HF's assistant gets no image"]
        print(f"{c.kind:7s} {str(c.same_ids):9s} {c.mm_tau:9.3f} {c.hf_tau:7.3f} {statistics.median(c.mm_ms):10.2f} "
              f"{statistics.median(c.hf_ms):10.2f} {c.ratio:6.3f}  {'; '.join(parts)}")
    for c in comparisons:
        print(f"{c.kind:7s} time outside model forwards: mmspec {c.mm_outside_ms:.2f} ms/token, HF {c.hf_outside_ms:.2f} "
              f"ms/token; target calls mmspec {c.mm_blocks} HF {c.hf_calls}; draft forwards mmspec "
              f"{c.mm_draft_calls} HF {c.hf_draft_calls}")
    for kind, (one, many, s) in steps.items():
        ratio = many / one
        print(f"draft step {kind:6s} S={s}: {args.batch} rows / 1 row = {ratio:.3f} "
              f"({1e3 * many:.3f} / {1e3 * one:.3f} ms)  ≤{TARGET_BATCH_RATIO:.2f} {verdict(ratio <= TARGET_BATCH_RATIO)}")
    if reuse_ok is not None:
        print(f"decoder reuse with a new image gives the new image's answer: {verdict(reuse_ok)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
