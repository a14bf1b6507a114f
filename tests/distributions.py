"""What the sampling tests share: the chi-square test, small random next-token models with exact
joint distributions (for the verification rules' pure functions, run on 10^5 blocks at once), and
the tiny target's exact distribution of its first two sampled tokens (for the engine-level tests)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from mmspec_cli.decoding.sampling import SamplingParams, probabilities
from mmspec_cli.models.prompts import process, render_prompt
from tests import tiny
from tests.helpers import QUESTION, uncached_forward

#: The engine-level tests sample with top-k 4: at most 16 outcomes for the first two tokens.
PARAMS = SamplingParams(temperature=1.0, top_k=4)
#: Seeded runs per engine-level distribution test: each test's docstring says what it catches at this size.
ENGINE_RUNS = 300


def chi_square_p_value(counts: Counter, expected: dict, n: int) -> float:
    """Pearson's test of observed ``counts`` {outcome: count} against ``expected`` {outcome: probability};
    outcomes with expected count < 5 are pooled into one cell, and an observed outcome that ``expected``
    gives no probability (one the target can never emit) joins that cell, or gives 0 if there is none."""
    stat, pooled_obs, pooled_exp, cells = 0.0, 0.0, 0.0, 0
    for outcome, p in expected.items():
        e = p * n
        if e < 5:
            pooled_obs, pooled_exp = pooled_obs + counts.get(outcome, 0), pooled_exp + e
        else:
            stat += (counts.get(outcome, 0) - e) ** 2 / e
            cells += 1
    stray = sum(c for o, c in counts.items() if o not in expected)  # impossible outcomes observed
    pooled_obs += stray
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        cells += 1
    elif stray:
        return 0.0
    dof = torch.tensor((cells - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, torch.tensor(stat / 2, dtype=torch.float64)))


def sequence_counts(sequences: torch.Tensor) -> Counter:
    """{tuple of tokens: count} of the rows of ``sequences`` (N, L)."""
    base, length = int(sequences.max()) + 1, sequences.shape[1]
    codes = (sequences * base ** torch.arange(length - 1, -1, -1)).sum(dim=1)  # each row as a number in base V
    counts = torch.bincount(codes)
    found = counts.nonzero().flatten()
    digits = found[:, None] // base ** torch.arange(length - 1, -1, -1) % base  # back to rows
    return Counter({tuple(row): int(c) for row, c in zip(digits.tolist(), counts[found].tolist())})


def random_rows(shape: Sequence[int], vocab: int, generator: torch.Generator, zero: int | None = None) -> torch.Tensor:
    """Random distributions over ``vocab`` tokens, (*shape, V), uneven (squared uniforms); token ``zero`` gets none."""
    p = torch.rand(*shape, vocab, generator=generator, dtype=torch.float64) ** 2
    if zero is not None:
        p[..., zero] = 0.0
    return p / p.sum(dim=-1, keepdim=True)


class ToyModel:
    """A next-token model over ``vocab`` tokens for prefixes of up to ``length − 1`` tokens, as tables:
    ``tables[k]`` (V,)*k + (V,) is the distribution after each prefix of k tokens. ``zero``: a token it never gives."""

    def __init__(self, vocab: int, length: int, seed: int, zero: int | None = None):
        g = torch.Generator().manual_seed(seed)
        self.vocab, self.length = vocab, length
        self.tables = [random_rows((vocab,) * k, vocab, g, zero) for k in range(length)]

    def probs(self, prefixes: torch.Tensor) -> torch.Tensor:
        """The distribution after each prefix: prefixes (N, k) -> (N, V)."""
        table = self.tables[prefixes.shape[1]]
        return table.expand(len(prefixes), -1) if prefixes.shape[1] == 0 else table[tuple(prefixes.T)]

    def sample(self, prefixes: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """One token after each prefix (N, k): (N,)."""
        return torch.multinomial(self.probs(prefixes), 1, generator=generator).squeeze(-1)

    def draft(self, n: int, gamma: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """n chains of γ tokens drawn from this model: the tokens (n, γ) and the distribution each was drawn
        from (n, γ, V)."""
        tokens = torch.zeros(n, 0, dtype=torch.long)
        dists = []
        for _ in range(gamma):
            dists.append(self.probs(tokens))
            tokens = torch.cat([tokens, torch.multinomial(dists[-1], 1, generator=generator)], dim=1)
        return tokens, torch.stack(dists, dim=1) if dists else torch.zeros(n, 0, self.vocab, dtype=torch.float64)

    def along(self, tokens: torch.Tensor) -> torch.Tensor:
        """The distribution after every prefix of each row of tokens (n, γ), the empty one included: (n, γ + 1, V)."""
        return torch.stack([self.probs(tokens[:, :t]) for t in range(tokens.shape[1] + 1)], dim=1)

    def complete(self, emitted: torch.Tensor, lengths: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Each row of ``emitted`` (N, length) keeps its first ``lengths`` tokens; the rest are drawn from this model.

        This is what later blocks would add if they keep the distribution, so a block's rule is lossless exactly
        when the completed rows follow :meth:`joint`."""
        out = emitted.clone()
        for t in range(self.length):
            rows = (lengths <= t).nonzero().flatten()
            if len(rows):
                out[rows, t] = self.sample(out[rows, :t], generator)
        return out

    def finish(self, drafted: torch.Tensor, accepted: torch.Tensor, next_token: torch.Tensor,
               generator: torch.Generator) -> torch.Tensor:
        """What N blocks emitted (row r: its first ``accepted[r]`` ``drafted`` tokens, then ``next_token[r]``),
        each completed to ``length`` tokens by :meth:`complete`: (N, length)."""
        n = len(drafted)
        emitted = torch.zeros(n, self.length, dtype=torch.long)
        emitted[:, : drafted.shape[1]] = drafted
        emitted[torch.arange(n), accepted] = next_token
        return self.complete(emitted, accepted + 1, generator)

    def p_value(self, sequences: torch.Tensor) -> float:
        """The chi-square test of ``sequences`` (N, length) against :meth:`joint`."""
        return chi_square_p_value(sequence_counts(sequences), self.joint(), len(sequences))

    def joint(self) -> dict[tuple[int, ...], float]:
        """{sequence of ``length`` tokens: its probability}, for every sequence the model can give."""
        joint = {(): 1.0}
        for k in range(self.length):
            joint = {seq + (x,): p * float(self.tables[k][seq][x])
                     for seq, p in joint.items() for x in range(self.vocab) if self.tables[k][seq][x] > 0}
        return joint


def exact_joint(target, n_images: int = 1, params: SamplingParams = PARAMS, question: str = QUESTION,
                images: list | None = None, repetition_penalty: float = 1.0) -> dict:
    """{(x1, x2): p} for the target's first two sampled tokens, from its own forwards without a cache
    (``images``: default ``tiny.images(n_images)``), under transformers' own repetition penalty when one is given."""
    from transformers import RepetitionPenaltyLogitsProcessor

    images = tiny.images(n_images) if images is None else images
    text = render_prompt(target.processor, [question], [], len(images))
    prompt = process(target.processor, text, images)
    with torch.no_grad():
        def next_probs(ids):
            types = prompt.vision.get("mm_token_type_ids")  # Qwen-VL: one modality per id, text (0) after the prompt
            extra = {} if types is None else {"mm_token_type_ids": torch.nn.functional.pad(types, (0, len(ids) - types.shape[1]))}
            out = uncached_forward(target.model, ids, {**prompt.vision, **extra})
            seen = torch.tensor([ids], device=out.logits.device)
            logits = RepetitionPenaltyLogitsProcessor(repetition_penalty)(seen, out.logits[:, -1])
            return probabilities(logits[0], params)

        p1 = next_probs(prompt.ids)
        return {(a, b): float(p1[a] * p2)
                for a in torch.nonzero(p1).flatten().tolist()
                for b, p2 in enumerate(next_probs(prompt.ids + [a])) if p2 > 0}


def sampled_pairs(decoder, runs: int, n_images: int = 1, question: str = QUESTION,
                  images: list | None = None) -> tuple[Counter, list]:
    """The first two tokens of ``runs`` seeded generations (seeds 0..runs-1, 3 new tokens each), and the turns."""
    images = tiny.images(n_images) if images is None else images
    counts: Counter = Counter()
    turns = []
    for seed in range(runs):
        turn = decoder.generate(images, [question], max_new_tokens=3, seed=seed).turns[0]
        counts[tuple(turn.token_ids[:2])] += 1
        turns.append(turn)
    return counts, turns
