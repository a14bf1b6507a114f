"""Turning logits into the distribution a token is drawn from, and drawing it.

The same transform (temperature, then top-k, then top-p, the order transformers uses) is
applied to the target's and the draft's logits. The speculative rule then compares two
distributions that were shaped alike, which is what the verification rule asks for (TABED §3; docs/ARCHITECTURE.md).
All functions here are pure except :meth:`TokenPicker.choose`, which consumes randomness
from an explicit ``torch.Generator``.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How next tokens are chosen. ``temperature == 0`` means greedy (argmax)."""

    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def working_dtype(logits: torch.Tensor) -> torch.dtype:
    # half-precision softmax loses the small probabilities the residual rule depends on
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


#: Below this many logits ``torch.argmax`` is the quicker (see :func:`argmax_ids`).
ARGMAX_MAX_INDICES_FROM = 16384


def argmax_ids(logits: torch.Tensor) -> torch.Tensor:
    """The argmax over the last axis, (...,) ids: on a tie the first maximum, as ``torch.argmax`` and transformers'
    greedy search pick it (and a NaN counts as the maximum in both). From :data:`ARGMAX_MAX_INDICES_FROM` logits on
    (all rows together), computed as ``torch.max``'s indices, which this CPU build reduces vectorised: 2.5-4.8x
    faster than ``torch.argmax`` over a real vocabulary (6 rows of 152,064 bfloat16 logits: 0.62 ms against 2.93).
    Below it, where the demo family's logits lie, the values tensor ``torch.max`` also allocates costs about what
    the vectorised loop saves, or more (one row of 1,200 after a forward: 19 µs against 15;
    ``benchmarks/bench_host_maths.py``, docs/BENCHMARKS.md). Inside a compiled graph inductor writes its own
    reduction, so graphs keep ``argmax``."""
    if logits.numel() < ARGMAX_MAX_INDICES_FROM:
        return logits.argmax(dim=-1)
    return logits.max(dim=-1).indices


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """softmax(logits / T) restricted to the top-k and then the top-p nucleus, renormalised.

    logits: (..., V). Returns probabilities of the same shape. Requires ``temperature > 0``.
    The top-k keep every token tied with the k-th; the top-p nucleus is every token whose strictly likelier tokens
    hold less than ``top_p`` of the mass (:func:`nucleus_floor`): the smallest set of most likely tokens whose mass
    reaches ``top_p``, with the tokens tied at its edge kept together.
    """
    if params.greedy:
        raise ValueError("probabilities() needs temperature > 0; greedy decoding uses argmax")
    # ``scaled`` and ``probs`` are this function's own tensors: masked and renormalised in place (over a real
    # vocabulary each row copy costs as much as the op that makes it)
    scaled = logits.to(working_dtype(logits)) / params.temperature  # (..., V)
    if params.top_k is not None and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[..., -1:]  # (..., 1)
        scaled.masked_fill_(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p is not None and params.top_p < 1.0:
        probs.masked_fill_(probs < nucleus_floor(probs, params.top_p), 0.0)
        probs.div_(probs.sum(dim=-1, keepdim=True))
    return probs


#: How many of a row's likeliest probabilities :func:`nucleus_floor` reads in order before it sorts the whole row.
NUCLEUS_LOOK = 256

#: From this many ids a row, on the CPU, :func:`nucleus_floor` sorts only the probabilities above (1 − top_p) / V.
NUCLEUS_CUT_FROM = 16384


def nucleus_floor(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """(..., 1): the smallest probability the top-p nucleus keeps in each row of ``probs`` (..., V). A token is kept
    when the tokens strictly likelier than it hold less than ``top_p`` of the mass, so the likeliest token always
    stays and tokens of equal probability are kept or dropped together.

    It reads the rows' likeliest :data:`NUCLEUS_LOOK` probabilities in order (``topk``), and sorts the whole rows
    only when a row's nucleus may reach past them: a trained model's nucleus is mostly far smaller than a real
    vocabulary of 150,000, whose sort takes about 25x that look. On this CPU, ``probabilities`` of a peaked row of
    152,064 takes 0.8 ms against 9.4 with a sort; a flat row (a nucleus of thousands) 5-10% more than with the sort
    alone (``benchmarks/bench_host_maths.py``, docs/BENCHMARKS.md). On the CPU a row of :data:`NUCLEUS_CUT_FROM`
    ids or more goes through :func:`cut_nucleus_floor` first, where ``topk`` itself is slow."""
    if probs.device.type == "cpu" and probs.shape[-1] >= NUCLEUS_CUT_FROM:
        floor = cut_nucleus_floor(probs, top_p)
        if floor is not None:
            return floor
    floor, inside = _nucleus_edge(torch.topk(probs, min(NUCLEUS_LOOK, probs.shape[-1]), dim=-1).values, top_p)
    if bool(inside.all()):
        return floor
    # a row whose nucleus may reach past the look: from its whole row, sorted; each row's floor is its own either way
    return torch.where(inside, floor, _nucleus_edge(torch.sort(probs, dim=-1, descending=True).values, top_p)[0])


def cut_nucleus_floor(probs: torch.Tensor, top_p: float) -> torch.Tensor | None:
    """:func:`nucleus_floor` from each row's probabilities above c = (1 − top_p) / V alone, sorted: None when a row's
    do not settle it (then the caller reads the rows whole).

    The ids at or below c hold at most V · c = 1 − top_p of the mass, so those above it hold at least top_p: the
    nucleus lies among them, and they are a row's likeliest, so sorted they are the prefix of the whole row's sort,
    and the floor read from them is the same number. Checked on the cumulative mass as computed: a row is settled
    when the mass of all its ids above c reaches top_p by more than its rounding (the first id below them then has
    top_p before it in the whole row's sort too); a row within rounding of it, or with no id above c (a softmax row
    with a NaN is NaN throughout), is not. On this CPU ``topk`` of 256 over 152,064 ids
    takes 0.5 ms a row; a peaked row's few thousand ids above c are found and sorted in 0.55-0.75 of it, a flat row's
    tens of thousands in a quarter of a whole sort (``benchmarks/bench_host_maths.py``)."""
    vocab = probs.shape[-1]
    if not probs.numel():
        return None
    cut = (1.0 - top_p) / vocab
    floors = []
    for row in probs.reshape(-1, vocab):
        values = torch.sort(row[row > cut], descending=True).values
        if not len(values):
            return None
        mass = torch.cumsum(values, dim=-1)
        total = float(mass[-1])
        # the whole row's sort reads the next id's mass before it as (total + v) − v: a few roundings of total
        if not total - 4 * torch.finfo(values.dtype).eps * total >= top_p:
            return None
        floors.append(_nucleus_edge(values, top_p, mass)[0])  # (1,)
    return torch.stack(floors).reshape(*probs.shape[:-1], 1)


def _nucleus_edge(values: torch.Tensor, top_p: float,
                  mass: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """From each row's likeliest probabilities in order (..., L): the nucleus's smallest kept probability (..., 1),
    and whether the nucleus's edge lies among them (..., 1). ``mass``: their cumulative sum, where the caller has it."""
    before = (torch.cumsum(values, dim=-1) if mass is None else mass) - values  # the mass of the entries before each
    # the entries with less than top_p before them: the likeliest always, and the nucleus's edge is the last; a token
    # tied with it has no more mass strictly above it, and every less likely one has at least top_p
    count = (before < top_p).sum(dim=-1, keepdim=True).clamp_min(1)  # 1 also for a row of NaNs (no nucleus)
    return values.gather(-1, count - 1), count < values.shape[-1]


def penalize_repeats(logits: torch.Tensor, context: torch.Tensor, rows: Sequence[int], ids: Sequence[int],
                     penalty: float) -> torch.Tensor:
    """The repetition penalty of CTRL (Keskar et al. 2019, §4.1), as transformers' ``RepetitionPenaltyLogitsProcessor``
    applies it before any other transform: the logit of a token the sequence already holds is divided by ``penalty``
    when positive and multiplied by it when negative. Greedy and sampled choices both read the penalised logits.

    ``logits`` (n, V), the rows of a chain or a tree; ``context`` (U,) the distinct ids the verified sequence holds,
    which every row holds; ``rows``, ``ids`` the (row, id) pairs a row's branch adds beyond them, each once
    (:func:`branch_repeats`). Returns a copy in float32 at least (:func:`working_dtype`), as ``generate`` casts logits
    before its processors: a bfloat16 quotient ties where it would not. Only the penalised entries are read and
    written: O(n·U) instead of O(n·V), what makes the penalty cheap over a real vocabulary (a Qwen2.5-VL target's
    152,064 logits a row)."""
    out = logits.to(working_dtype(logits), copy=True)
    if len(context):
        held = out[:, context]  # (n, U)
        out[:, context] = torch.where(held < 0, held * penalty, held / penalty)
    if len(rows):
        at = (torch.tensor(rows, device=out.device), torch.tensor(ids, device=out.device))
        held = out[at]
        out[at] = torch.where(held < 0, held * penalty, held / penalty)
    return out


def branch_repeats(tokens: Sequence[int], parents: Sequence[int],
                   context: Container[int]) -> tuple[list[int], list[int]]:
    """The (row, id) pairs the tokens of each row's branch add to the ``context`` every row holds: row 0 holds the
    context alone (the verified sequence); row i holds its parent's and its own token (``parents[i]`` < i; a chain:
    i − 1). Row i's logits predict what follows it, so its own token counts. Each pair once, none of the context."""
    rows: list[int] = []
    ids: list[int] = []
    added: list[tuple[int, ...]] = [()]  # per row: the ids its branch adds
    for i in range(1, len(tokens)):
        parent = added[parents[i]]
        token = tokens[i]
        mine = parent if token in context or token in parent else (*parent, token)
        added.append(mine)
        rows += [i] * len(mine)
        ids += mine
    return rows, ids


#: From this many ids a row, :func:`draw_ids` inverts the row's cumulative distribution instead of calling
#: ``torch.multinomial``. Below it (the demo family's 1,200 ids, the recorded draws of the verification rules) a
#: seed draws what it always drew.
INVERSE_CDF_FROM = 16384


def draw_ids(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One id from each row of ``probs``, one row (V,) or rows (N, V), each a distribution up to its sum, drawn on the
    CPU in float64 with ``generator`` (a CPU generator, so from the same distributions a seed draws the same tokens
    on any device): () or (N,).

    Rows of :data:`INVERSE_CDF_FROM` ids or more are drawn by inverse transform sampling: one uniform u per row,
    and the first id whose cumulative mass exceeds u times the row's total (:func:`invert_cumulative`).
    ``torch.multinomial`` draws an exponential for every id of a row instead (the exponential race): on this CPU,
    one row of 152,064 takes 2.9 ms that way and 0.28 ms this way (``benchmarks/bench_host_maths.py``). Both draw
    each id with its probability; a seed picks other ids at that size than ``multinomial`` did.

    As ``torch.multinomial`` does, it refuses (RuntimeError) a row with a negative entry or whose total is zero,
    infinite or NaN, and probabilities of more than two dimensions."""
    if probs.dim() > 2:
        raise RuntimeError(f"draw_ids takes one row (V,) or rows (N, V), not {probs.dim()} dimensions")
    rows = probs.detach().to("cpu", torch.float64)
    if rows.shape[-1] < INVERSE_CDF_FROM:
        return torch.multinomial(rows, 1, generator=generator).squeeze(-1)
    cumulative = rows.cumsum(dim=-1)
    total = cumulative[..., -1:]
    if not bool(((total > 0) & (total < float("inf"))).all()) or bool(rows.min() < 0):  # a reduction: no mask
        raise RuntimeError("a distribution to draw from has a negative entry, or a total that is zero, infinite or "
                           "NaN")
    uniforms = torch.rand(total.shape, generator=generator, dtype=torch.float64)
    return invert_cumulative(rows, cumulative, uniforms)


def invert_cumulative(rows: torch.Tensor, cumulative: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The inverse transform (...,): in each row, the first id whose cumulative mass ``cumulative`` (..., V) exceeds
    ``uniforms`` (..., 1), u in [0, 1), times the row's total. An id of zero probability adds no mass, so it is never
    the first to exceed anything. Where u · total rounds up to the total, the row's last id of positive probability
    (``rows`` (..., V), the probabilities)."""
    total = cumulative[..., -1:]
    ids = torch.searchsorted(cumulative, uniforms * total, right=True).squeeze(-1)  # (...,)
    past = ids >= rows.shape[-1]
    if bool(past.any()):
        last = rows.shape[-1] - 1 - (rows.flip(-1) > 0).to(torch.uint8).argmax(dim=-1)  # (...,)
        ids = torch.where(past, last, ids)
    return ids


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Draw one token id from a 1-D distribution, using ``generator`` (a CPU generator): :func:`draw_ids`."""
    return int(draw_ids(probs, generator))


class TokenPicker:
    """Chooses a token from logits: argmax when greedy, else a draw from :func:`probabilities`.

    Holds the run's random generator, so a seeded run is reproducible on any device.
    """

    def __init__(self, params: SamplingParams, seed: int | None = None):
        self.params = params
        self.generator = torch.Generator(device="cpu")
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    @property
    def greedy(self) -> bool:
        return self.params.greedy

    def distribution(self, logits: torch.Tensor) -> torch.Tensor:
        return probabilities(logits, self.params)

    def choose(self, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """logits: (V,). Returns (token id, the distribution it was drawn from or None if greedy)."""
        if self.greedy:
            return int(argmax_ids(logits)), None
        probs = self.distribution(logits)
        return sample(probs, self.generator), probs

    def choose_from(self, probs: torch.Tensor) -> int:
        """Draw from an already shaped distribution (e.g. a residual or a mixture)."""
        return sample(probs, self.generator)


def draw_without_replacement(probs: torch.Tensor, k: int, generator: torch.Generator) -> list[int]:
    """Up to ``k`` distinct ids drawn one after another from ``probs`` (V,), each from what is left,
    renormalised; fewer when the support is smaller. The order is the draw order."""
    remaining = probs.detach().to("cpu", torch.float64, copy=True)  # its own: written below
    out: list[int] = []
    while len(out) < k and remaining.sum() > 0:
        token = int(draw_ids(remaining / remaining.sum(), generator))
        out.append(token)
        remaining[token] = 0.0
    return out
