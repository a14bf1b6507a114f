"""Draft-length schedules: how many tokens γ the drafter proposes in each block.

- ``constant``: γ every block (the default; TABED, IbED).
- ``heuristic``: transformers' assisted-generation rule (``num_assistant_tokens_schedule=
  "heuristic"``): +2 after a block whose draft was accepted in full, −1 otherwise. Here it
  starts each turn at the profile's γ and stays within [1, γ_max] with γ_max = the profile's
  γ, so under ``heuristic`` ``decoding.gamma`` is the most a block drafts (``fastvlm`` grows
  beyond it). (transformers has no upper bound and keeps the length across calls.)
- ``fastvlm``: FastVLM Eq. (5), a draft length that grows with the context length,
      d(t) = d(0) + ⌊10 · σ(0.01 · (t − ⌊N/2⌋))⌋,
  where t is the current context length (prompt plus generated tokens: FastVLM counts the
  t-th generation step as having t − 1 context tokens), N the model's maximum sequence
  length (the target's ``max_position_embeddings``), and d(0) = the profile's γ (the paper
  sets d(0) = 5, so d ∈ {5, …, 15}). d is in [d(0), d(0) + 10]. For LLaVA-1.5 (N = 4096) the
  sigmoid is below 0.1 while t < ~1830, so short answers draft d(0) (+0) tokens per block.
- ``cost``: the γ that maximises the expected tokens per millisecond of a block,
      E[τ(γ)] / (T_draft(γ) + T_verify(S, γ + 1) + O),
  from the step costs ``mmspec profile-latency`` measured on this machine (:class:`StepCosts`; the verification of
  γ + 1 tokens as measured, not priced as one step, and under ``--compile`` a chain drafted in one graph as
  measured, not priced as γ steps) and the acceptance α seen so far in the turn
  (:class:`AcceptanceEstimate`: E[τ(γ)] from the blocks seen, a Kaplan–Meier estimate per drafted depth, which
  keeps how acceptance comes in runs). O is what
  the turn's blocks took beyond that price, on average (:class:`BlockOverhead`): the engine's own work around the
  forwards, and how far the isolated step timings of ``profile-latency`` are from the steps inside a block; a
  block's fixed cost favours longer drafts, which no step cost holds. The first :data:`OPENING_BLOCKS` blocks of a
  turn draft the profile's γ: one or two blocks' acceptance is too little to choose from (measured:
  docs/BENCHMARKS.md, issue 31), and blocks of γ tell of every depth up to γ, which later choices read. γ is in
  [1, γ_max] with γ_max = the largest token count whose verification was measured, minus one (so verifying
  γ_max + 1 tokens is a measured cost, never an extrapolated one; the default grid 1, 3, 5, 7 gives γ_max = 6,
  ``profile-latency --gammas 1,3,5,7,9`` allows 8). Without step costs it is ``constant``.

The schedule functions are pure; :class:`GammaSchedule` holds a turn's state. The engine
still cuts the scheduled length so that ``max_new_tokens`` is exact.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from mmspec_cli.choices import SCHEDULES
from mmspec_cli.errors import InputError


def heuristic_next(gamma: int, drafted: int, accepted: int, gamma_max: int) -> int:
    """transformers' heuristic: γ + 2 after a full accept, else γ − 1; clamped to [1, γ_max].

    A block that drafted nothing (γ cut to 0 at ``max_new_tokens``) leaves γ as it is.
    """
    if drafted == 0:
        return gamma
    step = 2 if accepted == drafted else -1
    return max(1, min(gamma_max, gamma + step))


def sigmoid(x: float) -> float:
    """1 / (1 + e^−x), without overflow for large |x|."""
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    z = math.exp(x)
    return z / (1.0 + z)


def fastvlm_length(d0: int, t: int, n: int) -> int:
    """FastVLM Eq. (5): d(t) = d0 + ⌊10 · σ(0.01 · (t − ⌊N/2⌋))⌋ for context length t, max length N."""
    return d0 + math.floor(10 * sigmoid(0.01 * (t - n // 2)))


def expected_tokens(alpha: float, gamma: int) -> float:
    """E[τ(γ)], the expected tokens a block of γ drafted tokens yields when each is accepted with probability α
    independently (Leviathan et al. 2023, Eq. (1); MMSpec/TABED's block efficiency):
    (1 − α^{γ+1}) / (1 − α), and γ + 1 at α = 1 (every draft accepted, plus the target's own token)."""
    if alpha >= 1.0:
        return gamma + 1.0
    alpha = max(alpha, 0.0)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def interpolate(points: Sequence[tuple[int, float]], x: float) -> float:
    """Piecewise-linear value at ``x`` through measured ``points`` (x, y), sorted by x; outside the measured range
    the nearest end's value, held flat (never extrapolated)."""
    if x <= points[0][0]:
        return points[0][1]
    x0, y0 = points[0]
    for x1, y1 in points[1:]:  # a measured grid has a handful of points: a scan is fastest
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        x0, y0 = x1, y1
    return y0


def nondecreasing(points: Sequence[tuple[int, float]]) -> list[tuple[int, float]]:
    """The least-squares nondecreasing fit of measured ``points`` (x, y), sorted by x: the pool-adjacent-violators
    algorithm (Ayer et al. 1955), each run of points that falls replaced by its mean. A forward over more tokens, or a
    longer chain, never costs less; a timing's noise that says so would make a longer draft look free."""
    pools: list[list[float]] = []  # [sum, count] per pool
    for _, y in points:
        pools.append([y, 1])
        while len(pools) > 1 and pools[-2][0] / pools[-2][1] > pools[-1][0] / pools[-1][1]:
            total, count = pools.pop()
            pools[-1][0] += total
            pools[-1][1] += count
    values = [total / count for total, count in pools for _ in range(int(count))]
    return [(x, y) for (x, _), y in zip(points, values)]


def blend(table: Sequence[tuple[int, Sequence[float]]], x: float) -> list[float]:
    """The vector at ``x`` interpolated linearly, entry by entry, between the measured vectors of ``table`` (x,
    values), sorted by x; outside the measured range the nearest end's, held flat (:func:`interpolate`'s rule)."""
    if x <= table[0][0]:
        return list(table[0][1])
    x0, y0 = table[0]
    for x1, y1 in table[1:]:
        if x <= x1:
            w = (x - x0) / (x1 - x0)
            return [a + (b - a) * w for a, b in zip(y0, y1)]
        x0, y0 = x1, y1
    return list(y0)


@dataclass(frozen=True)
class StepCosts:
    """What ``profile-latency`` measured on this machine for one drafter, in ms.

    ``verify_ms``: (S, n) -> one target forward verifying n tokens after S cached ones, T_p(1, S, n) (TABED App. G);
    ``draft_ms``: S -> ONE draft step after S cached tokens (the draft model's T_q(B, S, 1) at the drafter's batch
    rows, a head's T_h(S), ssd's T_s(S)); empty for a drafter that runs no model (``oracle``, ``pld``): drafting
    costs 0 then;
    ``chain_ms``: (S, γ) -> a greedy chain of γ tokens in ONE compiled graph after S (``--compile``'s chains:
    T_chain(B, S, γ), a head's T_hc(S, γ)); empty when chains run step by step (eager, ssd);
    ``chain_leads``: whether such a chain feeds the block's catch-up itself (a draft model's: its lead,
    :func:`~mmspec_cli.decoding.chain.draft_chain`), so that a block of γ ≥ 2 drafts with the chain alone; else
    (a head's, whose catch-up feeds the target's features) with the catch-up step and then the chain.

    How a context length S between the measured ones is priced: every curve (T_verify over n, T_chain over γ) is
    first read at each measured S (each n's or γ's own timings interpolated linearly in S where that S was not
    measured for it) and made nondecreasing there (:func:`nondecreasing`); a context between two measured S gets
    the linear blend of their curves (:func:`blend`), which is nondecreasing too. So a block's prices over every
    γ (:meth:`prices`) are one blend of vectors computed once, and agree with :meth:`drafting` + :meth:`verify`.
    """

    verify_ms: Mapping[tuple[int, int], float]
    draft_ms: Mapping[int, float] = field(default_factory=dict)
    chain_ms: Mapping[tuple[int, int], float] = field(default_factory=dict)
    chain_leads: bool = False

    def __post_init__(self) -> None:
        if not self.verify_ms:
            raise ValueError("StepCosts needs at least one measured verification")
        grid = sorted({s for s, _ in self.verify_ms} | set(self.draft_ms) | {s for s, _ in self.chain_ms})
        counts = sorted({n for _, n in self.verify_ms})
        by_count = [sorted((s, ms) for (s, m), ms in self.verify_ms.items() if m == n) for n in counts]
        gammas = sorted({g for _, g in self.chain_ms})
        by_gamma = [sorted((s, ms) for (s, m), ms in self.chain_ms.items() if m == g) for g in gammas]
        steps = sorted(self.draft_ms.items())
        verify = [(s, [y for _, y in nondecreasing([(n, interpolate(p, s)) for n, p in zip(counts, by_count)])])
                  for s in grid]
        chain = [(s, [y for _, y in nondecreasing([(g, interpolate(p, s)) for g, p in zip(gammas, by_gamma)])])
                 for s in grid] if gammas else []
        step = [(s, [interpolate(steps, s) if steps else 0.0]) for s in grid]
        for name, value in (("_counts", counts), ("_gammas", gammas), ("_verify", verify), ("_chain", chain),
                            ("_step", step)):  # computed once: a block's γ is chosen in microseconds
            object.__setattr__(self, name, value)
        top = self.gamma_max
        object.__setattr__(self, "_prices", [
            (s, [self._drafting(steps_at[0], chain_at, gamma) + interpolate(list(zip(counts, verify_at)), gamma + 1)
                 for gamma in range(top + 1)])
            for (s, verify_at), (_, steps_at), (_, chain_at) in zip(verify, step, chain or [(s, []) for s in grid])])

    @property
    def gamma_max(self) -> int:
        """The longest draft whose verification (γ + 1 tokens) was measured: the largest n − 1 (at least 1)."""
        return max(1, self._counts[-1] - 1)

    def verify_curve(self, seq: int) -> list[tuple[int, float]]:
        """(n, T_verify(S, n)) at each measured n, nondecreasing in n (the class's rule for S between measured)."""
        return list(zip(self._counts, blend(self._verify, seq)))

    def verify(self, seq: int, tokens: int) -> float:
        """T_verify(S, n): :meth:`verify_curve` interpolated linearly in n; outside the measured n, the nearest
        measured value (:func:`interpolate`)."""
        return interpolate(self.verify_curve(seq), tokens)

    def draft(self, seq: int) -> float:
        """One draft step after ``seq`` tokens, interpolated linearly in S; 0 when no model drafts."""
        return blend(self._step, seq)[0]

    def _drafting(self, step: float, chain: Sequence[float], gamma: int) -> float:
        """T_draft for a catch-up ``step`` and a chain curve ``chain`` (values at :attr:`_gammas`; empty: none). A
        chain of γ = 1 is drafted step by step: its catch-up alone."""
        if gamma <= 0:
            return 0.0
        if not chain:
            return gamma * step
        if gamma == 1:
            return step
        return (0.0 if self.chain_leads else step) + interpolate(list(zip(self._gammas, chain)), gamma)

    def drafting(self, seq: int, gamma: int) -> float:
        """T_draft(S, γ), a block's drafting: with a compiled chain measured, that chain of γ tokens (one graph:
        :attr:`chain_ms`, nondecreasing in γ and interpolated in it as :meth:`verify`), after the catch-up step unless
        the chain feeds it (:attr:`chain_leads`); else γ steps called one by one, γ · T_step(S). A chain of γ = 1 is
        its catch-up alone; a block cut to γ = 0 drafts nothing."""
        return self._drafting(self.draft(seq), blend(self._chain, seq) if self._chain else [], gamma)

    def prices(self, seq: int) -> list[float]:
        """[T_draft(S, γ) + T_verify(S, γ + 1) for γ = 0 .. :attr:`gamma_max`] (:func:`block_ms` at each γ), as one
        blend of the vectors computed at the measured S."""
        return blend(self._prices, seq)


def block_ms(costs: StepCosts, seq: int, gamma: int) -> float:
    """The cost of one block at context length S: its drafting and one verification of γ + 1 tokens,
    T_draft(S, γ) + T_verify(S, γ + 1) (TABED Eq. (1)'s denominator with both priced as measured instead of as
    γ + 1 steps: γ · T_step(S) + T_p(1, S, γ + 1) when the draft steps are called one by one, the catch-up step plus
    one compiled chain when ``--compile`` drafts the chain in one graph, :meth:`StepCosts.drafting`). Every
    draft step is priced at S: over a block the context grows by at most γ tokens, far less than the measured grid's
    spacing."""
    return costs.drafting(seq, gamma) + costs.verify(seq, gamma + 1)


def block_prices(costs: StepCosts, seq: int, gamma_max: int | None = None) -> list[float]:
    """[:func:`block_ms` (S, γ) for γ = 0 .. γ_max] (``gamma_max``: by default ``costs.gamma_max``): what a block's
    choice of γ and its update price. Up to ``costs.gamma_max`` one blend of the vectors computed at the measured S
    (:meth:`StepCosts.prices`); past it each γ is priced alone (its verification held at the longest measured)."""
    top = costs.gamma_max if gamma_max is None else max(1, gamma_max)
    if top <= costs.gamma_max:
        return costs.prices(seq)[:top + 1]
    return [block_ms(costs, seq, gamma) for gamma in range(top + 1)]


def fastest_length(prices: Sequence[float], expected: Callable[[int], float], overhead_ms: float = 0.0) -> int:
    """The γ in [1, len(prices) − 1] maximising E[τ(γ)] / (prices[γ] + O): expected tokens per ms of a block priced
    ``prices[γ]`` (:func:`block_prices`) plus ``overhead_ms`` (O, :class:`BlockOverhead`). Each γ's price is kept
    above 1% of its own when O is negative (so an O that outweighs every price leaves the choice O = 0 makes, not
    the longest draft); ties go to the shorter draft."""
    best, best_rate = 1, -1.0
    for gamma in range(1, len(prices)):
        rate = expected(gamma) / max(prices[gamma] + overhead_ms, 0.01 * prices[gamma])
        if rate > best_rate * (1 + 1e-12):
            best, best_rate = gamma, rate
    return best


def best_gamma(costs: StepCosts, seq: int, alpha: float, gamma_max: int | None = None,
               expected: Callable[[int], float] | None = None, overhead_ms: float = 0.0) -> int:
    """The γ in [1, γ_max] maximising the expected tokens per ms of a block,
    E[τ(γ)] / (T_draft(γ) + T_verify(γ + 1) + O) (:func:`fastest_length` over :func:`block_prices`; O: a block's
    cost beyond its forwards' price, :class:`BlockOverhead`). E[τ(γ)] is ``expected(γ)`` when given (the turn's
    observed acceptance: :meth:`AcceptanceEstimate.expected`), else :func:`expected_tokens` at ``alpha``.
    ``gamma_max``: by default ``costs.gamma_max``."""
    tokens = expected if expected is not None else (lambda gamma: expected_tokens(alpha, gamma))
    return fastest_length(block_prices(costs, seq, gamma_max), tokens, overhead_ms)


@dataclass
class AcceptanceEstimate:
    """What a turn's blocks so far say of acceptance: the per-token α̂ of a geometric model, and E[τ(γ)] from the
    blocks themselves (:meth:`expected`).

    α̂ = accepted tokens / (accepted tokens + blocks that had a rejection), the maximum-likelihood estimate of the
    i.i.d. acceptance of :func:`expected_tokens`: each drafted token is accepted with probability α until the first
    rejection, so a block that accepted k of d contributes k successes and, when k < d, one failure; a block accepted
    in full is censored (no failure seen). None before any block drafted a token.

    Per depth j (the j-th drafted token) it also counts the blocks that reached it (``reached[j]``: drafted ≥ j and
    accepted the j − 1 before it) and those rejected there (``stopped[j]``), for :meth:`expected`.
    """

    accepted: int = 0
    rejections: int = 0
    blocks: int = 0  # blocks that drafted
    reached: list[int] = field(default_factory=list)  # [j − 1]: blocks that drafted the j-th token and accepted j − 1
    stopped: list[int] = field(default_factory=list)  # [j − 1]: blocks whose j-th token was the first rejected

    def add(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        self.accepted += accepted
        self.rejections += accepted < drafted
        self.blocks += 1
        depth = min(drafted, accepted + 1)  # the deepest token the block tells about
        if len(self.reached) < depth:
            self.reached += [0] * (depth - len(self.reached))
            self.stopped += [0] * (depth - len(self.stopped))
        for j in range(depth):
            self.reached[j] += 1
        if accepted < drafted:
            self.stopped[accepted] += 1

    @property
    def alpha(self) -> float | None:
        seen = self.accepted + self.rejections
        return self.accepted / seen if seen else None

    def survival(self, gamma: int) -> list[float]:
        """S(j) for j = 1 .. γ, the chance a block accepts its first j drafts: the Kaplan–Meier estimate (Kaplan &
        Meier 1958), S(j) = Π_{i ≤ j} (1 − stopped_i / reached_i), in which a block accepted in full is censored at
        its length; past the deepest token any block reached, the geometric tail S(j) = S(J) · α̂^{j − J}."""
        alpha = self.alpha or 0.0
        out, alive = [], 1.0
        for j in range(gamma):
            if j < len(self.reached) and self.reached[j]:
                alive *= 1.0 - self.stopped[j] / self.reached[j]
            else:
                alive *= alpha
            out.append(alive)
        return out

    def expected(self, gamma: int) -> float:
        """E[τ(γ)] = 1 + Σ_{j ≤ γ} S(j) (:meth:`survival`): the target's own token and each draft kept with the chance
        the blocks seen give it. At every depth the blocks that drafted that deep speak for themselves, so it keeps
        how acceptance comes in runs (whole phrases the draft knows, then none), which the i.i.d. model of
        :func:`expected_tokens` prices as if every position were alike and so favours short drafts; a block that
        drafted d and kept them all says nothing of depth d + 1, where the blocks that drafted deeper answer (the
        geometric model only past the deepest). When every block drafted γ or more this is 1 + the mean of
        min(accepted, γ). Before any block: 1. Its cost does not grow with the turn: counts per depth."""
        return self.expected_curve(gamma)[-1] if gamma >= 1 else 1.0

    def expected_curve(self, top: int) -> list[float]:
        """[E[τ(1)], ..., E[τ(top)]] (:meth:`expected`), in one pass over the depths."""
        if not self.blocks:
            return [1.0] * top
        out, total = [], 1.0
        for alive in self.survival(top):
            total += alive
            out.append(total)
        return out


@dataclass
class BlockOverhead:
    """O of the cost schedule: the mean, over a turn's blocks after its first (which also fed the prompt), of a
    block's measured time minus its price (:func:`block_ms` at the γ it drafted). 0 before such a block."""

    total_ms: float = 0.0
    blocks: int = 0

    def add(self, measured_ms: float, priced_ms: float) -> None:
        self.total_ms += measured_ms - priced_ms
        self.blocks += 1

    @property
    def ms(self) -> float:
        return self.total_ms / self.blocks if self.blocks else 0.0


#: Blocks at the start of a turn that draft the profile's γ under ``cost`` before it chooses from their acceptance.
OPENING_BLOCKS = 3


def check_schedule(name: str) -> str:
    if name not in SCHEDULES:
        raise InputError(f"unknown gamma schedule '{name}'; use one of {', '.join(SCHEDULES)}")
    return name


@dataclass
class GammaSchedule:
    """A turn's draft length under schedule ``name``; ``gamma`` is γ (d(0) for fastvlm, γ_max for heuristic, the
    first OPENING_BLOCKS blocks' for cost). ``costs``: what ``cost`` chooses from (None: ``cost`` is ``constant``)."""

    name: str
    gamma: int
    max_length: int = 4096  # N of FastVLM Eq. (5): the target's maximum sequence length
    costs: StepCosts | None = None

    def __post_init__(self) -> None:
        check_schedule(self.name)
        self.current = self.gamma
        self.acceptance = AcceptanceEstimate()
        self.overhead = BlockOverhead()
        self.blocks = 0  # blocks seen this turn
        self._priced_at: int | None = None  # the context and the costs of :attr:`_priced`
        self._priced_by: StepCosts | None = None
        self._priced: list[float] = []

    def length(self, context: int) -> int:
        """γ for the next block, with ``context`` tokens (prompt + generated) before it."""
        if self.name == "fastvlm":
            return fastvlm_length(self.gamma, context, self.max_length)
        if self.name == "cost" and self.costs is not None and self.acceptance.blocks >= OPENING_BLOCKS:
            curve = self.acceptance.expected_curve(self.costs.gamma_max)  # once a block, not once per γ tried
            return fastest_length(self._prices(context), lambda gamma: curve[gamma - 1], self.overhead.ms)
        return self.current

    def update(self, drafted: int, accepted: int, measured_ms: float | None = None, context: int = 0) -> None:
        """Learn from the block just verified (``heuristic`` its next γ, ``cost`` the acceptance and, from the block's
        ``measured_ms`` after ``context`` tokens, its overhead)."""
        if self.name == "heuristic":
            self.current = heuristic_next(self.current, drafted, accepted, self.gamma)
        self.acceptance.add(drafted, accepted)
        self.blocks += 1
        if self.name == "cost" and self.costs is not None and measured_ms is not None and self.blocks > 1:
            prices = self._prices(context)
            self.overhead.add(measured_ms, prices[drafted] if drafted < len(prices)
                              else block_ms(self.costs, context, drafted))

    def _prices(self, context: int) -> list[float]:
        """:meth:`StepCosts.prices` at ``context``, kept for the update of the block it chose γ for (same context and
        costs)."""
        if self._priced_at != context or self._priced_by is not self.costs:
            self._priced_at, self._priced_by, self._priced = context, self.costs, self.costs.prices(context)
        return self._priced
