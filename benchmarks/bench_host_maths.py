"""The maths a block runs on the host between forwards, timed side by side against earlier formulations.

1. **The greedy choice** over real vocabularies: ``torch.argmax`` (what transformers' greedy search calls) against
   :func:`~mmspec_cli.decoding.sampling.argmax_ids` (``torch.max``'s indices, the same ids), for 1 row (a draft
   step's pick) and γ + 1 = 6 rows (a block's verification), at the demo family's vocabulary (1,200), LLaVA-1.5's
   (32,064) and Qwen2-VL's (152,064), in float32, bfloat16 and float16.
2. **TABED's evidence** (:func:`~mmspec_cli.drafters.weights.candidate_errors`, KL): the formulation before issue 31's
   seventh session (``xlogy`` for Σ p log p, a batched matrix product for Σ p log q_w) against today's, on the demo
   profile's shapes (n = 5 verified positions, 11 grid candidates of 2 members) and on LLaVA-1.5's vocabulary.
3. **The repetition penalty** over a block's 6 rows (a Qwen2.5-VL target's 1.05): before, an (n, V) mask of the
   tokens each row holds and the penalty computed over every logit; now
   :func:`~mmspec_cli.decoding.sampling.penalize_repeats` at the ids the rows hold (600 distinct ids in the context).
4. **The top-p nucleus** (0.9): before, a sort of each whole row; now
   :func:`~mmspec_cli.decoding.sampling.probabilities` reading the likeliest 256 first (:func:`nucleus_floor`), on
   a peaked row (logits of standard deviation 8: a nucleus of a few tokens) and a flat one (3: thousands).
5. **A sampled draw** from a top-p distribution (T = 1, 0.9) of 1 row (a draft's pick) and 6 rows: before,
   ``torch.multinomial`` on the CPU in float64; now :func:`~mmspec_cli.decoding.sampling.draw_ids` (the inverse
   transform from 16,384 ids a row; multinomial below, so the demo's row is the same call twice).
6. **The chain rule of one block** (:func:`~mmspec_cli.decoding.verify.verify_sampling`, γ = 5, top-p 0.9 rows):
   before, every row of p and q copied to the host in float64 first; now only the drafted tokens' probabilities
   and the one row the block draws from (the same verdicts, checked on 20 seeds).
7. **The top-p nucleus's floor** (0.9) over a real vocabulary on the CPU: the likeliest 256 read first (``topk``,
   the seventh session's) against :func:`~mmspec_cli.decoding.sampling.cut_nucleus_floor`, which sorts only the
   probabilities above (1 − top_p) / V (the same floors, checked).

Each pair is timed interleaved, call by call, in two conditions: **warm** (the same call repeated) and **cold** (a
16 MB buffer streamed through the caches before each call, as a model's forward does between a block's host
steps). It prints medians with the quartiles and the new/old ratio of the medians, and the machine. One thread
(``--threads``). Exits 0 whatever it measures.

    python benchmarks/bench_host_maths.py [--calls 300] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VOCABULARIES = (("demo", 1200), ("LLaVA-1.5", 32064), ("Qwen2-VL", 152064))


def options(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300, help="timed calls of each function per condition")
    parser.add_argument("--threads", type=int, default=1)
    return parser.parse_args(argv)


def side_by_side(old, new, calls: int, cold: bool, flush) -> tuple[list[float], list[float]]:
    """µs per call of ``old`` and ``new``, alternating which goes first, with ``flush`` before each call when cold."""
    times: tuple[list[float], list[float]] = ([], [])
    for k in range(calls + 5):
        order = ((0, old), (1, new)) if k % 2 == 0 else ((1, new), (0, old))
        for which, fn in order:
            if cold:
                flush()
            start = time.perf_counter()
            fn()
            if k >= 5:  # the first calls warm up allocator and dispatch
                times[which].append(1e6 * (time.perf_counter() - start))
    return times


def print_row(cells: str, old, new, calls: int, cold: bool, flush) -> None:
    """One table row: ``cells``, then ``old`` and ``new`` timed side by side (:func:`side_by_side`) and their ratio."""
    old_us, new_us = side_by_side(old, new, calls, cold, flush)
    ratio = statistics.median(new_us) / statistics.median(old_us)
    print(f"| {cells} | {summary(old_us)} | {summary(new_us)} | {ratio:.2f} |", flush=True)


def summary(values: list[float]) -> str:
    q1, median, q3 = statistics.quantiles(values, n=4)
    return f"{median:8.1f} ({q1:.1f}-{q3:.1f})"


def old_kl_errors(p, mixed):
    """The KL errors as written before: Σ p log p by ``xlogy``, Σ p log q_w as one batched matrix product."""
    import torch

    from mmspec_cli.drafters.weights import KL_FLOOR

    target = p.to(mixed)[:, None, :]
    entropy = torch.xlogy(target, target).sum(-1)
    cross = torch.matmul(mixed.clamp_min(KL_FLOOR).log_(), p.to(mixed)[:, :, None]).squeeze(-1)
    return entropy - cross


def old_penalized(logits, context_ids, tokens, parents, penalty):
    """The repetition penalty as written before: an (n, V) mask of the tokens each row holds, every logit penalised."""
    import torch

    seen = torch.zeros(logits.shape[-1], dtype=torch.bool)
    seen[context_ids] = True
    rows = seen.unsqueeze(0).repeat(len(tokens), 1)
    for i in range(1, len(tokens)):
        rows[i] = rows[parents[i]]
        rows[i, tokens[i]] = True
    logits = logits.float()
    return torch.where(rows, torch.where(logits < 0, logits * penalty, logits / penalty), logits)


def old_chain_rule(draft_tokens, draft_probs, target_probs, generator):
    """The chain rule of one block as written before (``verify_sampling`` over ``verify_sampling_batch`` with one row):
    every row of p and q copied to the host in float64 first. (accepted, next token)."""
    import torch

    from mmspec_cli.decoding.verify import draw_rows, residual_distribution

    draft_tokens, draft_probs, target_probs = draft_tokens[None], draft_probs[None], target_probs[None]
    n, gamma = draft_tokens.shape
    p = target_probs.detach().to("cpu", torch.float64)
    q = draft_probs.detach().to("cpu", torch.float64) if gamma else p[:, :0]
    tokens = draft_tokens.to("cpu")[..., None]
    p_draft = p[:, :gamma].gather(-1, tokens).squeeze(-1)
    q_draft = q.gather(-1, tokens).squeeze(-1)
    uniforms = torch.rand(n, gamma, generator=generator, dtype=torch.float64)
    accept = uniforms * q_draft < p_draft
    accepted = accept.long().cumprod(dim=-1).sum(dim=-1)
    blocks = torch.arange(n)
    fallback = p[blocks, accepted]
    rejected = accepted < gamma
    if bool(rejected.any()):
        at = accepted[rejected]
        fallback[rejected] = residual_distribution(p[blocks[rejected], at], q[blocks[rejected], at])
    return int(accepted[0]), int(draw_rows(fallback, generator)[0])


def old_look_floor(probs, top_p):
    """The top-p nucleus's floor as read before the cut (issue 31's seventh session): the likeliest 256 first
    (``topk``), the whole row sorted where the nucleus may reach past them."""
    import torch

    from mmspec_cli.decoding.sampling import _nucleus_edge

    floor, inside = _nucleus_edge(torch.topk(probs, min(256, probs.shape[-1]), dim=-1).values, top_p)
    if bool(inside.all()):
        return floor
    return torch.where(inside, floor, _nucleus_edge(torch.sort(probs, dim=-1, descending=True).values, top_p)[0])


def old_top_p(logits, top_p):
    """softmax, then the top-p nucleus as written before: a sort of each whole row."""
    import torch

    probs = torch.softmax(logits.float(), dim=-1)
    sorted_p, order = torch.sort(probs, dim=-1, descending=True)
    mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
    drop = torch.zeros_like(mass_before >= top_p).scatter(-1, order, mass_before >= top_p)
    probs = probs.masked_fill(drop, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def main() -> None:
    args = options()
    import torch

    from bench_demo_suites import machine
    from mmspec_cli.decoding.sampling import (SamplingParams, argmax_ids, branch_repeats, cut_nucleus_floor, draw_ids,
                                              penalize_repeats, probabilities)
    from mmspec_cli.decoding.verify import verify_sampling
    from mmspec_cli.drafters.weights import candidate_errors, candidate_mixtures, simplex_grid

    torch.set_num_threads(args.threads)
    buffer = torch.ones(4_000_000)  # 16 MB: more than this machine's caches

    def flush() -> None:
        buffer.mul_(1.0)

    print(f"machine: {machine()}")
    print(f"{args.calls} calls per function and condition, interleaved; µs per call, median (quartiles)\n")
    print("## 1. The greedy choice: torch.argmax against argmax_ids (torch.max's indices)\n")
    print("| vocabulary | dtype | rows | condition | torch.argmax | argmax_ids | new/old |")
    print("|---|---|---|---|---|---|---|")
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for name, vocab in VOCABULARIES:
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                for rows in (1, 6):
                    logits = torch.randn(rows, vocab, generator=generator).to(dtype)
                    assert torch.equal(argmax_ids(logits), logits.argmax(dim=-1))
                    calls = args.calls if vocab < 100_000 else max(30, args.calls // 5)
                    for cold in (False, True):
                        print_row(f"{name} {vocab} | {str(dtype).removeprefix('torch.')} | {rows} | "
                                  f"{'cold' if cold else 'warm'}", lambda: logits.argmax(dim=-1).tolist(),
                                  lambda: argmax_ids(logits).tolist(), calls, cold, flush)

        print("\n## 2. TABED's evidence: the KL errors of 11 candidate mixtures at n = 5 positions (float32)\n")
        print("| vocabulary | condition | before | candidate_errors | new/old |")
        print("|---|---|---|---|---|")
        for name, vocab in VOCABULARIES[:2]:
            q = torch.softmax(torch.randn(5, 2, vocab, generator=generator), dim=-1)
            p = torch.softmax(torch.randn(5, vocab, generator=generator), dim=-1)
            mixed = candidate_mixtures(q, simplex_grid(2, 10).to(q))
            torch.testing.assert_close(candidate_errors(p, mixed, "kl"), old_kl_errors(p, mixed.clone()),
                                       rtol=1e-5, atol=0)
            for cold in (False, True):
                print_row(f"{name} {vocab} | {'cold' if cold else 'warm'}", lambda: old_kl_errors(p, mixed),
                          lambda: candidate_errors(p, mixed, "kl"), args.calls, cold, flush)
        print("\n## 3. The repetition penalty over 6 rows (a chain of 5 drafts), 600 context ids\n")
        print("| vocabulary | dtype | condition | an (n, V) mask | penalize_repeats | new/old |")
        print("|---|---|---|---|---|---|")
        for name, vocab in VOCABULARIES:
            logits = torch.randn(6, vocab, generator=generator).to(torch.bfloat16)
            context = torch.randperm(vocab, generator=generator)[:600]
            tokens, parents = [0, 11, 12, 13, 14, 15], [-1, 0, 1, 2, 3, 4]
            seen = dict.fromkeys(context.tolist())

            def now():
                rows, ids = branch_repeats(tokens, parents, seen)
                return penalize_repeats(logits, context, rows, ids, 1.05)

            assert torch.equal(now(), old_penalized(logits, context, tokens, parents, 1.05))
            for cold in (False, True):
                print_row(f"{name} {vocab} | bfloat16 | {'cold' if cold else 'warm'}",
                          lambda: old_penalized(logits, context, tokens, parents, 1.05), now, max(30, args.calls // 5),
                          cold, flush)

        print("\n## 4. The top-p nucleus (0.9), float32 logits\n")
        print("| vocabulary | rows | logits | nucleus (tokens, first row) | a sort of each row | probabilities "
              "| new/old |")
        print("|---|---|---|---|---|---|---|")
        params = SamplingParams(temperature=1.0, top_p=0.9)
        for name, vocab in VOCABULARIES[1:]:
            for spread, label in ((8.0, "peaked"), (3.0, "flat")):
                for rows in (1, 6):
                    logits = torch.randn(rows, vocab, generator=generator) * spread
                    torch.testing.assert_close(probabilities(logits, params), old_top_p(logits, 0.9), rtol=0, atol=0)
                    size = int((probabilities(logits[:1], params) > 0).sum())
                    print_row(f"{name} {vocab} | {rows} | {label} | {size}", lambda: old_top_p(logits, 0.9),
                              lambda: probabilities(logits, params), max(10, args.calls // 20), False, flush)

        print("\n## 5. A sampled draw from a top-p distribution (T = 1, 0.9): torch.multinomial against draw_ids\n")
        print("| vocabulary | rows | condition | torch.multinomial | draw_ids | new/old |")
        print("|---|---|---|---|---|---|")
        for name, vocab in VOCABULARIES:
            for rows in (1, 6):
                probs = probabilities(torch.randn(rows, vocab, generator=generator) * 3, params)
                old_draws, new_draws = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
                for cold in (False, True):
                    print_row(f"{name} {vocab} | {rows} | {'cold' if cold else 'warm'}",
                              lambda: torch.multinomial(probs.to(torch.float64), 1, generator=old_draws).tolist(),
                              lambda: draw_ids(probs, new_draws).tolist(), max(30, args.calls // 5), cold, flush)

        print("\n## 6. The chain rule of one block (γ = 5, top-p 0.9 rows): every row to float64 first, against "
              "verify_sampling\n")
        print("| vocabulary | condition | every row copied | verify_sampling | new/old |")
        print("|---|---|---|---|---|")
        for name, vocab in VOCABULARIES:
            target = probabilities(torch.randn(6, vocab, generator=generator) * 3, params)
            draft = probabilities(torch.randn(5, vocab, generator=generator) * 3, params)
            tokens = torch.stack([draw_ids(row, generator) for row in draft])
            for seed in range(20):
                verdict = verify_sampling(tokens, draft, target, torch.Generator().manual_seed(seed))
                assert (verdict.accepted, verdict.next_token) == old_chain_rule(
                    tokens, draft, target, torch.Generator().manual_seed(seed))
            old_draws, new_draws = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
            for cold in (False, True):
                print_row(f"{name} {vocab} | {'cold' if cold else 'warm'}",
                          lambda: old_chain_rule(tokens, draft, target, old_draws),
                          lambda: verify_sampling(tokens, draft, target, new_draws), max(30, args.calls // 5), cold,
                          flush)

        print("\n## 7. The top-p nucleus's floor (0.9): the first look of 256 against the cut at (1 − top_p) / V\n")
        print("| vocabulary | rows | logits | ids above the cut (first row) | first look | cut_nucleus_floor "
              "| new/old |")
        print("|---|---|---|---|---|---|---|")
        for name, vocab in VOCABULARIES[1:]:
            for spread, label in ((8.0, "peaked"), (3.0, "flat")):
                for rows in (1, 6):
                    probs = torch.softmax(torch.randn(rows, vocab, generator=generator) * spread, dim=-1)
                    assert torch.equal(cut_nucleus_floor(probs, 0.9), old_look_floor(probs, 0.9))
                    above = int((probs[0] > 0.1 / vocab).sum())
                    print_row(f"{name} {vocab} | {rows} | {label} | {above}", lambda: old_look_floor(probs, 0.9),
                              lambda: cut_nucleus_floor(probs, 0.9), max(10, args.calls // 20), False, flush)
    print(f"\nmachine at the end: {machine()}")


if __name__ == "__main__":
    main()
