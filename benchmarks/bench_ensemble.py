"""In-batch ensemble drafting (IbED / TABED) on CPU: what the extra rows and the weight update cost.

One run builds tiny LLaVA models (``tests.tiny`` pieces, with a bigger image than
``tiny``'s 28 px so that an image is a realistic-ish run of placeholder tokens), saves them,
loads them through ``mmspec_cli.models.loading.load_model`` (float32, cpu) and measures, side by
side, for two drafts of one target (a TABED-like small draft, at most 1/10 of the target,
and a large one, a perturbed copy of the target):

1. **one draft step, 4 members vs 1**: ``BatchedRows.logits(shared)`` feeding one new token
   to 4 rows (views m, t, c, p of ``mmspec_cli.drafters.views``; c captioned by a
   ``Captioner`` built on the draft itself) against 1 row (m), and 2 rows (m, t: the
   default ``tabed``) and the plain ``m`` path (``CachedModel``, what drafter ``m`` runs),
   each after the real 1-image prompt plus ``--generated`` generated tokens. Every call
   feeds ``base + [x]`` with x alternating between two tokens, so each call is a lazy
   rollback of one token (``Cache.crop``) plus a one-token forward, as inside a block.
   Median of ``--step-repeats`` calls each, the variants interleaved in rotating order.
   Target: 4 rows / 1 row ≤ 1.15 (TABED Remark 3: under 5% on a GPU), judged on the
   TABED-like draft.
2. **TABED weight update per block vs one draft step**: end to end, the engine's
   ``BlockVerified.update_s`` (``EnsembleDrafter.observe``) of each block against that
   block's ``draft_s / len(draft)`` (one step of the same drafter: the batched forward, the
   member softmaxes and the mixture), for ``tabed`` (m, t; grid policy, 11 candidates),
   ``tabed:mtcp`` with grid (286 candidates) and with softmax (4 one-hot candidates);
   median of the per-block ratios, and the ratio of the sums. Plus a microbenchmark of
   ``WeightPolicy.observe`` + ``weights()`` alone for a full block (n = γ verified
   positions) at the tiny vocabulary and at LLaVA-1.5's 32064. Target: ≤ 5%.
3. **end to end, ``tabed`` vs ``m``**: per-token wall time (median of ``--repeats`` runs,
   interleaved, alternating who goes first, a fresh ``SpeculativeDecoder`` per run), block
   efficiency τ of each, and token ids identical to each other and to the target's own
   greedy ``generate`` (lossless).

The small draft is random (64 hidden x 2 layers): it is accepted about never (τ ≈ 1), so
each block verifies one position. The large draft (a perturbed copy of the target) is
accepted in long runs, so blocks verify several positions. Lines marked ``*`` are
diagnostics: prototypes of suggested engine changes defined in this script
(``PreparedMaskRows``, ``VectorisedPolicy``), never what the engine runs and never judged;
``--no-diagnostics`` skips them. The machine line (with ``os.getloadavg()``) is printed at
the start and in the summary: timings on a shared machine move with its load.

Run ``python benchmarks/bench_ensemble.py`` (about 2-3 minutes on 2 CPU cores; ``--profile``
adds cProfile breakdowns of the update) or ``--quick`` for a 15 s smoke run. It always
exits 0: it is a measurement; verdicts are printed.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the repository root: the tests' model builders
from bench_engine_vs_hf import _short, machine_lines  # noqa: E402  (house helpers, shared not copied)

from tests import tiny  # noqa: E402
from mmspec_cli.drafters.captioner import Captioner  # noqa: E402
from mmspec_cli.drafters import build_drafter  # noqa: E402
from mmspec_cli.drafters.rows import BatchedRows  # noqa: E402
from mmspec_cli.models.parts import with_cache  # noqa: E402
from mmspec_cli.drafters.views import caption_row, multimodal_row, pooled_row, text_only_row  # noqa: E402
from mmspec_cli.decoding.engine import SpeculativeDecoder  # noqa: E402
from mmspec_cli.drafters.weights import KL_FLOOR, WeightPolicy  # noqa: E402
from mmspec_cli.models.profiles import EnsembleSpec  # noqa: E402
from mmspec_cli.models.loading import LoadedModel, load_model  # noqa: E402
from mmspec_cli.models.profiles import ModelSpec  # noqa: E402
from mmspec_cli.models.prompts import process, render_prompt  # noqa: E402
from mmspec_cli.decoding.kv import CachedModel  # noqa: E402

QUESTION = "what is in the image?"
TARGET_ROWS_RATIO = 1.15  # one draft step with 4 rows / with 1 row must be <= this
TARGET_UPDATE_RATIO = 0.05  # TABED weight update per block / one draft step must be <= this
LLAVA_VOCAB = 32064  # llava-hf/llava-1.5-7b-hf text vocabulary, for the policy microbenchmark


# --------------------------------------------------------------------------- setup


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: smaller target, fewer tokens and repeats")
    p.add_argument("--gamma", type=int, default=5, help="draft tokens per block (constant)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--hidden", type=int, default=320, help="target hidden size")
    p.add_argument("--layers", type=int, default=6, help="target layers")
    p.add_argument("--small-hidden", type=int, default=64, help="hidden size of the small (TABED-like) draft")
    p.add_argument("--small-layers", type=int, default=2)
    p.add_argument("--draft-scale", type=float, default=0.05,
                   help="relative weight noise of the large draft (a perturbed copy of the target)")
    p.add_argument("--image-size", type=int, default=112,
                   help="image side in pixels (patch 14): 112 -> 8x8 = 64 image tokens, 56 -> 16, 336 -> 576")
    p.add_argument("--pool", type=int, default=2, help="pooling kernel of the p member")
    p.add_argument("--caption-tokens", type=int, default=16, help="max_new_tokens of the captioner (c member)")
    p.add_argument("--generated", type=int, default=32, help="generated tokens after the prompt in the draft-step test")
    p.add_argument("--step-repeats", type=int, default=150, help="timed single steps per variant (median)")
    p.add_argument("--update-repeats", type=int, default=200, help="timed policy updates per case (median)")
    p.add_argument("--repeats", type=int, default=7, help="timed end-to-end runs per drafter and draft (median)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads for everything")
    p.add_argument("--no-diagnostics", dest="diagnostics", action="store_false",
                   help="skip the diagnostic prototypes of suggested engine changes (marked * in the output; they run unless this is given)")
    p.add_argument("--profile", action="store_true",
                   help="also cProfile one tabed and one tabed:mtcp run (grid, small draft) and print where the update time goes")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.quick:
        args.hidden, args.layers = min(args.hidden, 128), min(args.layers, 2)
        args.max_new_tokens = min(args.max_new_tokens, 24)
        args.repeats = min(args.repeats, 1)
        args.step_repeats = min(args.step_repeats, 15)
        args.update_repeats = min(args.update_repeats, 20)
        args.caption_tokens = min(args.caption_tokens, 6)
    return args


def params(model) -> float:
    return sum(p.numel() for p in model.parameters()) / 1e6


def text_params(model) -> float:
    return sum(p.numel() for p in model.model.language_model.parameters()) / 1e6 + \
        model.get_output_embeddings().weight.numel() / 1e6


def build_models(root: Path, args) -> tuple[LoadedModel, dict[str, LoadedModel]]:
    """Target and ``{"small": ..., "large": ...}`` drafts, loaded through mmspec's loader (float32, cpu)."""
    tokenizer = tiny.train_tokenizer()
    processor = tiny.make_processor(tokenizer, image_size=args.image_size)
    vocab = len(tokenizer)
    target = tiny.make_model(vocab, args.seed, args.hidden, args.layers, image_size=args.image_size)
    drafts = {
        "small": tiny.make_model(vocab, args.seed + 7, args.small_hidden, args.small_layers, image_size=args.image_size),
        "large": tiny.perturbed_copy(target, args.draft_scale, seed=args.seed + 1),
    }
    spec = lambda path: ModelSpec(model=path, dtype="float32", device="cpu")  # noqa: E731
    loaded_target = load_model(spec(tiny.save(target, processor, root / "target")), "target")
    loaded = {k: load_model(spec(tiny.save(d, processor, root / k)), "draft") for k, d in drafts.items()}
    return loaded_target, loaded


# --------------------------------------------------------------------------- 1. one draft step


VARIANTS = ("m (CachedModel)", "1 row m", "2 rows m,t", "4 rows m,t,c,p")
DIAG_ROWS = "4 rows, 4-D mask *"  # diagnostic, not the engine: see PreparedMaskRows


class PreparedMaskRows(BatchedRows):
    """DIAGNOSTIC, not what the engine runs: a prototype of a suggested ``BatchedRows`` change.

    For a one-token step it passes the attention mask already in 4-D, (B, 1, 1, L) bool (what
    transformers' sdpa mask would be: True = attend), instead of the 2-D padding mask, so that
    transformers returns it as is (``masking_utils._preprocess_mask_arguments``) rather than
    building the 4-D mask in ~20 small ops every step. Same logits (checked in the run).
    """

    def _forward(self, fresh: int, **inputs) -> torch.Tensor:
        if fresh != 1:
            return super()._forward(fresh, **inputs)
        positions = self.mask.sum(1, keepdim=True) - 1  # (B, 1): each row's own position
        out = self.model(attention_mask=self.mask[:, None, None, :].bool(), position_ids=positions,
                         **with_cache(self.cache), use_cache=True, logits_to_keep=1, **inputs)
        return out.logits[:, -1]


@dataclass
class StepResult:
    medians: dict[str, float]  # variant -> median seconds
    head_lengths: dict[str, list[int]]  # variant -> each row's head length
    cached: int  # positions in the cache before the step (longest row)
    diag_diff: float | None = None  # max |logits difference| of the diagnostic variant vs the engine's 4 rows

    def ratio(self, variant: str, base: str = "1 row m") -> float:
        return self.medians[variant] / self.medians[base]


def generated_tokens(draft: LoadedModel, n: int) -> list[int]:
    """``n`` ordinary text tokens standing in for generated ones (the corpus, repeated)."""
    filler = draft.tokenizer(" ".join(tiny.CORPUS), add_special_tokens=False)["input_ids"]
    return (filler * (n // len(filler) + 1))[:n]


@torch.inference_mode()
def draft_step_times(draft: LoadedModel, captioner: Captioner, images, args) -> StepResult:
    text = render_prompt(draft.processor, [QUESTION], [], len(images))
    gen = generated_tokens(draft, args.generated)
    m, t = multimodal_row(draft), text_only_row(draft)
    c, p = caption_row(draft, captioner), pooled_row(draft, args.pool)
    members = {"1 row m": [m], "2 rows m,t": [m, t], "4 rows m,t,c,p": [m, t, c, p]}
    diagnose = args.diagnostics and draft.model.config._attn_implementation == "sdpa"  # bool 4-D mask = sdpa's
    if diagnose:
        members[DIAG_ROWS] = [m, t, c, p]
    variants = VARIANTS + ((DIAG_ROWS,) if diagnose else ())
    calls, heads = {}, {}
    for variant, views in members.items():
        rows = (PreparedMaskRows if variant == DIAG_ROWS else BatchedRows)(draft.model, draft.image_token_id)
        rows_in = [v(text, images) for v in views]
        base = rows.begin(rows_in) + gen
        rows.logits(base)  # prefill + the generated tokens: the cache now holds every row's head + base
        heads[variant] = [len(r.ids) for r in rows_in]
        calls[variant] = (lambda r, b: (lambda x: r.logits(b + [x])))(rows, base)
    prompt = process(draft.processor, text, images)
    runner = CachedModel(draft.model, role="draft", image_token_id=draft.image_token_id)
    ids = prompt.ids + gen
    runner.logits(ids, 1, prompt.vision)
    calls["m (CachedModel)"] = lambda x: runner.logits(ids + [x], 1, prompt.vision)
    heads["m (CachedModel)"] = [len(prompt.ids)]
    times = {v: [] for v in variants}
    warmup = 5
    x_tokens = gen[:2] if gen[0] != gen[1] else [gen[0], gen[0] + 1]
    diff = None
    if diagnose:
        diff = float((calls["4 rows m,t,c,p"](x_tokens[0]) - calls[DIAG_ROWS](x_tokens[0])).abs().max())
    for i in range(warmup + args.step_repeats):
        order = variants[i % len(variants):] + variants[: i % len(variants)]  # rotate who goes first
        x = x_tokens[i % 2]
        for variant in order:
            t0 = time.perf_counter()
            calls[variant](x)
            dt = time.perf_counter() - t0
            if i >= warmup:
                times[variant].append(dt)
    return StepResult(medians={v: statistics.median(ts) for v, ts in times.items()}, head_lengths=heads,
                      cached=max(heads["4 rows m,t,c,p"]) + len(gen), diag_diff=diff)


# --------------------------------------------------------------------------- end to end (2 and 3)


@dataclass
class Run:
    ids: list[int]
    wall_s: float
    blocks: list  # BlockVerified
    tau: float

    @property
    def per_token_ms(self) -> float:
        return 1e3 * self.wall_s / max(len(self.ids), 1)


def run_engine(target, draft, name, policy, captioner, images, args) -> Run:
    drafter = build_drafter(name, target, draft, ensemble=policy, captioner=captioner, pool_kernel=args.pool,
                            seed=args.seed)
    decoder = SpeculativeDecoder(target, drafter, gamma=args.gamma, max_new_tokens=args.max_new_tokens)
    t0 = time.perf_counter()
    generation = decoder.generate(images, [QUESTION])
    wall = time.perf_counter() - t0
    turn = generation.turns[0]
    return Run(ids=list(turn.token_ids), wall_s=wall, blocks=list(turn.blocks),
               tau=turn.stats.new_tokens / max(turn.stats.blocks, 1))


@dataclass
class UpdateStats:
    """Per block: update_s against draft_s / len(draft) (one draft step of the same drafter)."""

    per_block: list[float] = field(default_factory=list)  # update / step, one per block with a draft
    update_s: float = 0.0
    step_s: float = 0.0  # sum over blocks of draft_s / len(draft)
    blocks: int = 0
    verified: int = 0  # positions the updates saw
    tokens: int = 0  # new tokens of the runs, for τ
    all_blocks: int = 0

    @property
    def tau(self) -> float:
        return self.tokens / max(self.all_blocks, 1)

    def add(self, blocks) -> None:
        self.tokens += sum(len(b.tokens) for b in blocks)
        self.all_blocks += len(blocks)
        for b in blocks:
            if not b.draft:
                continue
            step = b.draft_s / len(b.draft)
            self.per_block.append(b.update_s / step)
            self.update_s += b.update_s
            self.step_s += step
            self.blocks += 1
            self.verified += min(b.accepted + 1, len(b.draft))

    @property
    def median(self) -> float:
        return statistics.median(self.per_block)

    @property
    def of_sums(self) -> float:
        return self.update_s / self.step_s

    @property
    def update_ms(self) -> float:
        return 1e3 * self.update_s / self.blocks

    @property
    def step_ms(self) -> float:
        return 1e3 * self.step_s / self.blocks


def reference_ids(target: LoadedModel, images, args) -> list[int]:
    """The target's own greedy ``generate`` (no drafting): what every lossless run must output."""
    text = render_prompt(target.processor, [QUESTION], [], len(images))
    inputs = target.processor(images=list(images), text=text, return_tensors="pt")
    out = target.model.generate(**inputs, do_sample=False, max_new_tokens=args.max_new_tokens)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


@dataclass
class E2E:
    draft: str
    ref_ok: dict[str, bool]
    same: bool
    tau: dict[str, float]
    ms: dict[str, list[float]]
    split_ms: dict[str, tuple[float, float, float, float]]  # drafter -> draft, verify, update, other ms/token
    updates: UpdateStats  # tabed's, over every run (check + timed)

    def median(self, name: str) -> float:
        return statistics.median(self.ms[name])

    @property
    def ratio(self) -> float:
        return self.median("tabed") / self.median("m")

    @property
    def paired(self) -> float:
        """Median over repeats of tabed / m within the same repeat (the two ran back to back)."""
        return statistics.median(t / m for t, m in zip(self.ms["tabed"], self.ms["m"]))


def split(run: Run) -> tuple[float, float, float, float]:
    n = max(len(run.ids), 1)
    d = sum(b.draft_s for b in run.blocks)
    v = sum(b.verify_s for b in run.blocks)
    u = sum(b.update_s for b in run.blocks)
    return tuple(1e3 * x / n for x in (d, v, u, run.wall_s - d - v - u))


def tabed_vs_m(kind, target, draft, ref, images, args) -> E2E:
    names = ("m", "tabed")
    policy = EnsembleSpec()  # the default: grid, KL, soft labels, all verified positions
    check = {n: run_engine(target, draft, n, policy, None, images, args) for n in names}  # warm-up + check
    updates = UpdateStats()
    updates.add(check["tabed"].blocks)
    ms = {n: [] for n in names}
    splits = {n: [] for n in names}
    for r in range(args.repeats):
        for n in (names if r % 2 == 0 else names[::-1]):
            run = run_engine(target, draft, n, policy, None, images, args)
            ms[n].append(run.per_token_ms)
            splits[n].append(split(run))
            if n == "tabed":
                updates.add(run.blocks)
    split_ms = {n: tuple(statistics.median(s[i] for s in splits[n]) for i in range(4)) for n in names}
    return E2E(draft=kind, ref_ok={n: check[n].ids == ref for n in names}, same=check["m"].ids == check["tabed"].ids,
               tau={n: check[n].tau for n in names}, ms=ms, split_ms=split_ms, updates=updates)


UPDATE_CASES = (  # (label, drafter name, policy)
    ("tabed (m,t) grid, 11 candidates", "tabed", EnsembleSpec(policy="grid")),
    ("tabed:mtcp grid, 286 candidates", "tabed:mtcp", EnsembleSpec(policy="grid")),
    ("tabed:mtcp softmax, 4 candidates", "tabed:mtcp", EnsembleSpec(policy="softmax")),
)


def engine_updates(target, draft, captioner, images, args, runs: int) -> dict[str, UpdateStats]:
    """update_s vs one draft step, end to end, for the tabed:mtcp cases (tabed itself comes from part 3)."""
    out = {}
    for label, name, policy in UPDATE_CASES[1:]:
        stats = UpdateStats()
        run_engine(target, draft, name, policy, captioner, images, args)  # warm-up
        for _ in range(runs):
            stats.add(run_engine(target, draft, name, policy, captioner, images, args).blocks)
        out[label] = stats
    return out


class VectorisedPolicy(WeightPolicy):
    """DIAGNOSTIC, not what the engine runs: a prototype of a suggested ``WeightPolicy.observe``.

    Same evidence up to float32 rounding: the candidate mixtures are built once (one matmul,
    not one einsum for the errors and another for the hits), the KL's cross term is one
    batched product, log and clamp run in place, the hits are computed only when the policy
    reads them (hard labels, adaboost), and with an unbounded window the evidence is summed in
    one op instead of a Python loop over positions.
    """

    def observe(self, p: torch.Tensor, member_q: torch.Tensor, labels: torch.Tensor) -> None:
        if not self.uses_evidence or len(labels) == 0:
            return
        cand = getattr(self, "_cand", None)
        if cand is None or cand.dtype != member_q.dtype:
            cand = self._cand = self.candidates.to(member_q).T.contiguous()  # (m, C)
        mixed = torch.matmul(member_q.transpose(1, 2), cand)  # (n, V, C)
        p = p.to(mixed)
        if self.config.distance == "kl":
            cross = torch.bmm(p[:, None, :], mixed.clamp_min_(KL_FLOOR).log_())[:, 0]  # (n, C)
            errors = torch.xlogy(p, p).sum(-1, keepdim=True) - cross
        else:
            errors = 0.5 * (p[:, :, None] - mixed).abs().sum(1)
        need_hits = self.config.labels == "hard" or self.config.policy == "adaboost"
        ev = self.evidence
        if ev.window is None:
            ev.soft += errors.sum(0).to(torch.float64)
            if need_hits:
                ev.hits += (mixed.argmax(1) == labels[:, None]).sum(0).to(torch.float64)
            ev.count += len(labels)
        else:
            hits = (mixed.argmax(1) == labels[:, None]).to(torch.float64) if need_hits else torch.zeros_like(
                errors, dtype=torch.float64)
            ev.add(errors, hits)


def policy_micro(members: int, policy: EnsembleSpec, vocab: int, n: int, repeats: int, budget_s: float = 3.0,
                 cls: type = WeightPolicy) -> tuple[float, int]:
    """Median seconds of ``WeightPolicy.observe`` (n positions) + ``weights()``, float32 inputs like the
    engine's, and the number of timed calls (``repeats``, fewer when they exceed ``budget_s``; at least 3)."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(4 * torch.randn(n, vocab, generator=g), -1)  # (n, V) float32
    q = torch.softmax(4 * torch.randn(n, members, vocab, generator=g), -1)  # (n, m, V)
    labels = p.argmax(-1)
    wp = cls(members, policy, vocab_size=vocab)
    wp.weights()  # the first block of a turn: equal weights
    wp.observe(p, q, labels)  # warm-up
    wp.weights()
    times: list[float] = []
    while len(times) < repeats and (len(times) < 3 or sum(times) < budget_s):
        t0 = time.perf_counter()
        wp.observe(p, q, labels)
        wp.weights()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), len(times)


# --------------------------------------------------------------------------- profile


UPDATE_FUNCS = {"observe", "weights", "candidate_errors", "candidate_matches", "add", "best_candidate",
                "softmax_weights"}  # mmspec_cli/ensemble.py functions on the per-block update path


def profile_update(target, draft, captioner, images, args) -> None:
    """cProfile one run of tabed (grid) and of tabed:mtcp (grid): where each block's update time goes."""
    for name in ("tabed", "tabed:mtcp"):
        prof = cProfile.Profile()
        prof.enable()
        run = run_engine(target, draft, name, EnsembleSpec(policy="grid"), captioner, images, args)
        prof.disable()
        stats = pstats.Stats(prof)
        total = stats.total_tt
        n_blocks = len(run.blocks)
        print(f"\n--- cProfile of one {name} grid run, small draft ({len(run.ids)} tokens, {n_blocks} blocks, "
              f"{1e3 * total:.0f} ms profiled) ---")
        rows = [(ct, tt, nc, f"{_short(path)}:{line}({func})")
                for (path, line, func), (cc, nc, tt, ct, callers) in stats.stats.items()]
        print("  mmspec_cli functions by cumulative time (ms per block):")
        for ct, tt, nc, where in sorted((r for r in rows if "mmspec_cli" in r[3]), reverse=True)[:14]:
            print(f"    {100 * ct / total:5.1f}%  {1e3 * ct / n_blocks:7.3f} ms/block  {nc:6d} calls  {where}")
        print("  the weight path: calls made directly by EnsembleDrafter.observe and by mmspec_cli/ensemble.py's "
              "observe path (update_s), plus weights() (run at the start of each propose, so inside draft_s); "
              "ms per block, cumulative; calls per block:")
        direct: dict[str, list[float]] = {}
        for (path, line, func), (cc, nc, tt, ct, callers) in stats.stats.items():
            if "mmspec_cli" in path:
                continue
            for (cpath, _, cfunc), cstats in callers.items():
                from_update = cpath.endswith("mmspec_cli/ensemble.py") and cfunc in UPDATE_FUNCS
                from_observe = cpath.endswith("drafters/ensemble.py") and cfunc == "observe"
                if from_update or from_observe:
                    entry = direct.setdefault(f"{func} (from {cfunc})", [0.0, 0])
                    entry[0] += cstats[3]
                    entry[1] += cstats[1]
        for key, (t, calls) in sorted(direct.items(), key=lambda kv: kv[1][0], reverse=True)[:16]:
            print(f"    {1e3 * t / n_blocks:7.3f} ms/block  {calls / n_blocks:5.1f}/block  {key}")
        print(f"    ({sum(c for _, c in direct.values()) / n_blocks:.0f} such calls per block in all)")


# --------------------------------------------------------------------------- main


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    print("== mmspec in-batch ensemble: extra rows and the TABED weight update ==")
    for line in machine_lines(args.threads):
        print(line)
    load_at_start = "%.2f %.2f %.2f" % os.getloadavg()
    image_tokens = (args.image_size // 14) ** 2
    print(f"setup         float32 cpu; γ={args.gamma}; max_new_tokens={args.max_new_tokens}; greedy; 1 image "
          f"{args.image_size}px = {image_tokens} image tokens (p: {(args.image_size // 14 // args.pool) ** 2}); "
          f"repeats={args.repeats}; step repeats={args.step_repeats}")
    images = tiny.images(1)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="mmspec-bench-") as tmp:
        target, drafts = build_models(Path(tmp), args)
        tp = text_params(target.model)
        print(f"target        {args.hidden} hidden x {args.layers} layers, {params(target.model):.2f}M params "
              f"({tp:.2f}M in the language model), vocab {target.vocab_size}")
        for kind, d in drafts.items():
            cfg = d.model.config.text_config
            dp = text_params(d.model)
            print(f"draft {kind:6s}  {cfg.hidden_size} hidden x {cfg.num_hidden_layers} layers, {params(d.model):.2f}M params "
                  f"({dp:.2f}M language model = {100 * dp / tp:.1f}% of the target's)"
                  + ("  random" if kind == "small" else "  perturbed copy of the target")
                  + ("; TABED-like (≤ 1/10 of the target)" if dp <= tp / 10 else ""))
        captioners = {k: Captioner(d, max_new_tokens=args.caption_tokens) for k, d in drafts.items()}
        for k, c in captioners.items():
            print(f"caption       {k} draft captions the image as {c.caption(images[0])!r} ({1e3 * c.seconds:.0f} ms, once)")
        print(f"load average  {'%.2f %.2f %.2f' % os.getloadavg()} (after model building)")

        # 1. draft step
        steps: dict[str, StepResult] = {}
        for kind, d in drafts.items():
            s = draft_step_times(d, captioners[kind], images, args)
            steps[kind] = s
            print(f"\n[1. draft step, {kind} draft] row heads {s.head_lengths['4 rows m,t,c,p']} (m, t, c, p), "
                  f"{args.generated} generated tokens, longest row {s.cached} cached positions")
            for v in s.medians:
                print(f"  {v:18s} {1e3 * s.medians[v]:7.3f} ms   / 1 row m = {s.ratio(v):.3f}")
            if s.diag_diff is not None:
                print(f"  * diagnostic prototype (PreparedMaskRows), not the engine; max |logits diff| vs the engine's "
                      f"4 rows: {s.diag_diff:.2e}")

        # 3. end to end (also the tabed update statistics of part 2)
        ref = reference_ids(target, images, args)
        e2e: dict[str, E2E] = {}
        for kind, d in drafts.items():
            t0 = time.perf_counter()
            e = tabed_vs_m(kind, target, d, ref, images, args)
            e2e[kind] = e
            print(f"\n[3. tabed vs m, {kind} draft] {len(ref)} tokens; ids m == tabed: {e.same}; "
                  f"== target generate: m {e.ref_ok['m']}, tabed {e.ref_ok['tabed']}  ({time.perf_counter() - t0:.0f}s)")
            print(f"  block efficiency  m {e.tau['m']:.3f}   tabed {e.tau['tabed']:.3f}")
            for n in ("m", "tabed"):
                print(f"  ms/token runs {n:5s} {['%.2f' % x for x in e.ms[n]]}  median {e.median(n):.2f}  "
                      f"(draft {e.split_ms[n][0]:.2f}, verify {e.split_ms[n][1]:.2f}, update {e.split_ms[n][2]:.3f}, "
                      f"other {e.split_ms[n][3]:.2f})")
            print(f"  ratio tabed / m   {e.ratio:.3f} (of medians); {e.paired:.3f} (median of per-repeat ratios)")

        # 2. weight update per block vs one draft step
        updates: dict[str, dict[str, UpdateStats]] = {}
        for kind, d in drafts.items():
            updates[kind] = {UPDATE_CASES[0][0]: e2e[kind].updates}
            updates[kind].update(engine_updates(target, d, captioners[kind], images, args, runs=max(1, args.repeats // 2)))
            print(f"\n[2. weight update vs one draft step, end to end, {kind} draft]")
            for label, u in updates[kind].items():
                print(f"  {label:34s} τ {u.tau:.3f}, {u.blocks:4d} blocks ({u.verified / u.blocks:.2f} verified positions/block): "
                      f"update {u.update_ms:.3f} ms/block, draft step {u.step_ms:.3f} ms; update/step median "
                      f"{100 * u.median:.1f}%, of sums {100 * u.of_sums:.1f}%")
        micro = {}
        print(f"\n[2. WeightPolicy.observe + weights() alone, n = γ = {args.gamma} positions, float32]")
        for vocab in (target.vocab_size, LLAVA_VOCAB):
            for label, name, policy in UPDATE_CASES:
                members = 2 if name == "tabed" else 4
                micro[(label, vocab)], calls = policy_micro(members, policy, vocab, args.gamma, args.update_repeats)
                line = f"  V={vocab:5d}  {label:34s} {1e3 * micro[(label, vocab)]:9.3f} ms  (median of {calls})"
                if args.diagnostics:
                    fast, fcalls = policy_micro(members, policy, vocab, args.gamma, args.update_repeats,
                                                cls=VectorisedPolicy)
                    micro[(label, vocab, "*")] = fast
                    line += f"   VectorisedPolicy* {1e3 * fast:9.3f} ms (median of {fcalls})"
                print(line)
        if args.diagnostics:
            print("  * diagnostic prototype of a suggested engine change, not the engine")

        if args.profile:
            profile_update(target, drafts["small"], captioners["small"], images, args)

    verdict = lambda ok: "PASS" if ok else "FAIL"  # noqa: E731
    small_is_tabed_like = text_params(drafts["small"].model) <= tp / 10
    print("\n================ SUMMARY ================")
    for line in machine_lines(args.threads)[:4]:
        print(line)
    print(f"load average  {load_at_start} (at start), {'%.2f %.2f %.2f' % os.getloadavg()} (at end)")
    print(f"γ={args.gamma}, max_new_tokens={args.max_new_tokens}, target {args.hidden}x{args.layers}, "
          f"{image_tokens} image tokens, float32; total {time.perf_counter() - started:.0f}s")
    print("1. one draft step, 4 rows (m,t,c,p) / 1 row (m), BatchedRows.logits, 1 new token:")
    for kind, s in steps.items():
        judged = kind == "small"
        r = s.ratio("4 rows m,t,c,p")
        print(f"   {kind:5s} draft: {1e3 * s.medians['4 rows m,t,c,p']:.3f} / {1e3 * s.medians['1 row m']:.3f} ms = {r:.3f}"
              f"  (2 rows {s.ratio('2 rows m,t'):.3f}; plain m path {1e3 * s.medians['m (CachedModel)']:.3f} ms)  "
              + (f"≤{TARGET_ROWS_RATIO:.2f} {verdict(r <= TARGET_ROWS_RATIO)}"
                 + (f" (4 rows / plain m path {s.medians['4 rows m,t,c,p'] / s.medians['m (CachedModel)']:.3f}"
                    + (f"; 4-D mask* {s.ratio(DIAG_ROWS):.3f}" if DIAG_ROWS in s.medians else "") + ")")
                 + ("" if small_is_tabed_like else " (draft NOT ≤ 1/10 of the target)") if judged
                 else "(reported, not judged: draft as large as the target)"))
    print("2. TABED weight update per block / one draft step of the same drafter (end to end, median of blocks):")
    for kind, cases in updates.items():
        for label, u in cases.items():
            print(f"   {kind:5s} draft, {label:34s} {100 * u.median:6.1f}%  (of sums {100 * u.of_sums:.1f}%; "
                  f"{u.update_ms:.3f} / {u.step_ms:.3f} ms)  ≤{100 * TARGET_UPDATE_RATIO:.0f}% {verdict(u.median <= TARGET_UPDATE_RATIO)}")
    small = steps["small"].medians
    width = {UPDATE_CASES[0][0]: "2 rows m,t", UPDATE_CASES[1][0]: "4 rows m,t,c,p", UPDATE_CASES[2][0]: "4 rows m,t,c,p"}
    print(f"   policy alone (microbenchmark, n = γ = {args.gamma}, V={target.vocab_size}) / one small-draft step of the same "
          f"width (part 1), reported:")
    for label, variant in width.items():
        ratio = micro[(label, target.vocab_size)] / small[variant]
        extra = ""
        if (label, target.vocab_size, "*") in micro:
            extra = f"; VectorisedPolicy* {100 * micro[(label, target.vocab_size, '*')] / small[variant]:.1f}%"
        print(f"   {label:34s} {100 * ratio:6.1f}%  ({1e3 * micro[(label, target.vocab_size)]:.3f} / "
              f"{1e3 * small[variant]:.3f} ms{extra})")
    print("3. end to end, tabed (m,t grid) vs m:")
    for kind, e in e2e.items():
        lossless = e.same and all(e.ref_ok.values())
        print(f"   {kind:5s} draft: τ m {e.tau['m']:.3f}, tabed {e.tau['tabed']:.3f}; ms/token m {e.median('m'):.2f}, "
              f"tabed {e.median('tabed'):.2f}, ratio {e.ratio:.3f} (paired {e.paired:.3f}; reported); identical ids (to each other and to "
              f"target.generate) {verdict(lossless)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
