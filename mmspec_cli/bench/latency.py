"""Latency of target verification and draft steps (TABED App. G), and the ratio c of Eq. (1).

- T_p(1, S, γ): one target forward verifying γ tokens after a cached prefix of S tokens;
- T_q(B, S, 1): one draft forward of one token for each of B batch rows after S tokens;
- T_h(S): one step of a draft head (``eagle``, ``vispec``) after S cached entries: its decoder
  layer on one token plus the target's LM head, which the head shares;
- T_s(S): one step of ``ssd`` after S cached tokens: the target's first ``ssd.layer`` decoder
  layers on one token over the target's own cache, then its final norm and LM head (through the
  profile's imitation network for ``ssd``, and without it for ``ssd:plain``), timed through the
  drafter's own code (``drafters/ssd.early_exit_logits``). ``ssd`` never runs the draft model,
  so the draft model's T_q says nothing about it.
- with ``--compile``, T_chain(B, S, γ) and a head's T_hc(S, γ): a greedy chain of γ tokens as ``--compile`` drafts it,
  in ONE compiled graph. The draft model's (or a batch of B member rows', through the drafters' own ``run_chain``)
  feeds its catch-up first, the one verified token a block after a rejection lacks (its *lead*), then γ − 1 of the
  chosen tokens: a block's whole drafting. A head's (as its drafter calls it, at text positions and without ViSpec's
  image feature, as T_h is) feeds γ − 1, after the catch-up step T_h that feeds the target's features. That is what
  ``--gamma-schedule cost`` prices (:class:`~mmspec_cli.decoding.schedules.StepCosts`). Timed at each γ = n − 1 ≥ 2
  of the grid's n, right after the step at the same S (S ascending: a static state only grows).
Each is timed after a warm-up as the median of repeats, with CUDA events on a GPU or a
synchronized clock on CPU; the sizes measured over one state (the target's verification of each n at an S, the
chains of each γ) side by side, a repeat of each in turn (:meth:`Timer.medians_ms`). Each model's steps are timed
apart from the other's: timed beside the target's, the demo draft's step read a c far above what a chain's steps
cost, probably with its weights out of the caches after each target forward (docs/BENCHMARKS.md). The latency ratio used in Eq. (1) is
c = T_q(B, S, 1) / T_p(1, S, γ): γ draft steps plus one verification make a block; a head's
ratio is T_h(S) / T_p(1, S, γ), ssd's T_s(S) / T_p(1, S, γ).
Results are cached as JSON per device (on a CPU: with its thread count) and model pair, so
``bench`` can report Eq. (1); with ``--compile`` every step is timed as a compiled decoding loop runs it
(compiled over its static state) and cached apart, for ``bench``'s records made with ``--compile``.
The cache key holds a fingerprint of the weights each name stands for (:func:`weights_fingerprint`),
so a retrained model, a new release of a shipped one or a new hub revision is profiled afresh
instead of inheriting the old ratio. The ssd entry also says the
layer it was timed at and its imitation network's name and fingerprint (:attr:`LatencyResult.ssd`),
which ``bench`` compares with its records' before using it.
``--gamma-schedule cost`` chooses each block's γ from the cached grid (:func:`step_costs`, :func:`run_step_costs`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import re
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from mmspec_cli.choices import SSD_PLAIN, tree_kind
from mmspec_cli.decoding.kv_state import DynamicKV
from mmspec_cli.decoding.schedules import StepCosts
from mmspec_cli.models.parts import with_cache
from mmspec_cli.models.positions import TEXT_POSITIONS

REMARK_TOLERANCE = 0.05  # TABED App. G: |ΔT/T| < 5%
#: TABED App. G's prefix lengths S, the grid timed when ``--seq`` is not given and the models' context holds them.
STANDARD_SEQS = (512, 1024, 2048, 3072)


@dataclass(frozen=True)
class LatencyResult:
    device: str
    target: str
    draft: str
    target_ms: dict[str, float] = field(default_factory=dict)  # "S,γ" -> ms of T_p(1, S, γ)
    draft_ms: dict[str, float] = field(default_factory=dict)  # "B,S" -> ms of T_q(B, S, 1)
    target_revision: str | None = None  # the profiles' hub revisions, part of the cache key
    draft_revision: str | None = None
    head_ms: dict[str, dict[str, float]] = field(default_factory=dict)  # head kind -> "S" -> ms of T_h(S)
    ssd_ms: dict[str, dict[str, float]] = field(default_factory=dict)  # "ssd", "ssd:plain" -> "S" -> ms of T_s(S)
    ssd: dict[str, Any] | None = None  # what ssd_ms timed: {"layer", "imitation" (name or None), "imitation_weights"}
    compiled: bool = False  # timed as ``--compile`` runs them: each step compiled over its static state
    draft_chain_ms: dict[str, float] = field(default_factory=dict)  # "B,S,γ" -> ms of T_chain(B, S, γ) (compiled)
    head_chain_ms: dict[str, dict[str, float]] = field(default_factory=dict)  # head kind -> "S,γ" -> ms (compiled)
    # whether draft_chain_ms feed their catch-up's token first, as the draft model's chains now do (a cache written
    # before they did holds chains after a separate catch-up step, and is priced so: StepCosts.chain_leads)
    draft_chains_lead: bool = False

    def t_p(self, seq: int, gamma: int) -> float:
        return self.target_ms[f"{seq},{gamma}"]

    def t_q(self, batch: int, seq: int) -> float:
        return self.draft_ms[f"{batch},{seq}"]

    @property
    def seqs(self) -> list[int]:
        return sorted({int(k.split(",")[0]) for k in self.target_ms})

    @property
    def gammas(self) -> list[int]:
        return sorted({int(k.split(",")[1]) for k in self.target_ms})

    @property
    def batches(self) -> list[int]:
        return sorted({int(k.split(",")[0]) for k in self.draft_ms})

    def ratio(self, batch: int = 1, seq: int | None = None, gamma: int | None = None, head: str | None = None,
              ssd: str | None = None) -> float:
        """c = T_q(B, S, 1) / T_p(1, S, γ) at the measured grid point nearest to (B, S, γ);
        with ``head`` (a kind): T_h(S) / T_p(1, S, γ); with ``ssd`` (``ssd`` or ``ssd:plain``): T_s(S) / T_p(1, S, γ)."""
        s = _nearest(self.seqs, seq if seq is not None else self.seqs[0])
        g = _nearest(self.gammas, gamma if gamma is not None else self.gammas[0])
        if head is not None:
            return self.head_ms[head][str(s)] / self.t_p(s, g)
        if ssd is not None:
            return self.ssd_ms[ssd][str(s)] / self.t_p(s, g)
        b = _nearest(self.batches, batch)
        return self.t_q(b, s) / self.t_p(s, g)

    def times_ssd(self, name: str, layer: int | None, imitation: str | None) -> bool:
        """Whether ``ssd_ms`` holds drafter ``name``'s step as a run at ``layer`` with ``imitation`` (the imitation
        network's name, or None) drafts: the same layer and, for ``ssd``, the same imitation network, whose weights
        have not changed since (``ssd:plain`` never uses it)."""
        timed = self.ssd or {}
        if name not in self.ssd_ms or layer is None or timed.get("layer") != layer:
            return False
        if name != "ssd":  # ssd:plain: the layer alone
            return True
        if imitation is None:
            return timed.get("imitation") is None
        return timed.get("imitation") == imitation and timed.get("imitation_weights") == weights_fingerprint(imitation)


def _nearest(values: Sequence[int], x: int) -> int:
    return min(values, key=lambda v: (abs(v - x), v))


def device_name(device: torch.device | str, threads: int | None = None) -> str:
    """The cache's name for ``device``: a GPU's model, or the CPU with its cores and the thread count torch uses
    (``threads``, by default this process's: ``bench --summarize`` passes the count its records were made with)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu-{platform.machine()}-{os.cpu_count()}cores-{threads or torch.get_num_threads()}threads"


def default_seqs(context: int | None, largest_gamma: int) -> list[int]:
    """The prefix lengths S to time when none are given: those of :data:`STANDARD_SEQS` for which S + γ fits in
    ``context`` positions (the models' fewest; None: unknown, so all), and, when the largest does not fit, the
    longest S that does (``context`` − γ), so the grid still reaches the end of the context: 512, 1024, 2041 for a
    2048-position model and γ up to 7. One line when not even S = 1 fits (γ too large for the context)."""
    if context is None:
        return list(STANDARD_SEQS)
    longest = context - largest_gamma
    if longest < 1:
        from mmspec_cli.errors import InputError

        raise InputError(f"--gammas: γ = {largest_gamma} leaves no room for a prefix in the models' "
                         f"{context} positions; pass γ values below {context}")
    fitting = [s for s in STANDARD_SEQS if s <= longest]
    return fitting if len(fitting) == len(STANDARD_SEQS) or longest in fitting else [*fitting, longest]


class Timer:
    """Median wall time of a callable: CUDA events on a GPU, a synchronized clock on CPU."""

    def __init__(self, device: torch.device, warmup: int = 2, repeat: int = 10):
        self.device, self.warmup, self.repeat = torch.device(device), warmup, repeat

    def median_ms(self, run: Callable[[], None], reset: Callable[[], None] = lambda: None) -> float:
        return self.medians_ms({None: run}, reset)[None]

    def medians_ms(self, runs: Mapping[Any, Callable[[], None]],
                   reset: Callable[[], None] = lambda: None) -> dict[Any, float]:
        """The median time of each of ``runs`` (``reset`` before every call), timed side by side: each is warmed up,
        then every repeat times each once, in turn, the order reversed every other round. A machine that slows down
        or speeds up during the timing (another job, its clock) then reaches them alike, so their ratios, which the
        schedules and Eq. (1) read (T_p(1, S, γ + 1) / T_p(1, S, 1)), hold better than timed one after the other."""
        for run in runs.values():
            for _ in range(self.warmup):
                reset()
                self._time(run)
        samples: dict[Any, list[float]] = {key: [] for key in runs}
        keys = list(runs)
        for round_ in range(self.repeat):
            for key in keys if round_ % 2 == 0 else keys[::-1]:
                reset()
                samples[key].append(self._time(runs[key]))
        return {key: statistics.median(times) for key, times in samples.items()}

    def _time(self, run: Callable[[], None]) -> float:
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            torch.cuda.synchronize(self.device)
            return start.elapsed_time(end)
        begin = time.perf_counter()
        run()
        return (time.perf_counter() - begin) * 1000.0


def random_ids(model, batch: int, seq: int, new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random prefix (B, S) and the ``new_tokens`` fed after it (B, n), the same for every ``seq`` in a process."""
    vocab = model.get_output_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(seq)
    prefix = torch.randint(5, vocab, (batch, seq), generator=generator).to(model.device)
    return prefix, torch.randint(5, vocab, (batch, new_tokens), generator=generator).to(model.device)


def fill(model, state, prefix: torch.Tensor) -> None:
    """Feed ``prefix`` (B, S) into ``state`` through the whole model, eager (a static state's first write is)."""
    batch, seq = prefix.shape
    model(input_ids=prefix, **with_cache(state.cache), use_cache=True, logits_to_keep=1,
          position_ids=TEXT_POSITIONS.chain(0, seq, model.device).expand(batch, -1))
    state.wrote(seq)


@torch.inference_mode()
def step_latencies_ms(model, batch: int, seq: int, counts: Sequence[int], timer: Timer) -> dict[int, float]:
    """The median time of one forward of n tokens per row after a cached prefix of ``seq``, for each n of ``counts``,
    over one prefix fed once, timed side by side (:meth:`Timer.medians_ms`)."""
    prefix, steps = random_ids(model, batch, seq, max(counts))
    state = DynamicKV(config=model.config)
    fill(model, state, prefix)

    def forward(n: int) -> Callable[[], Any]:
        positions = TEXT_POSITIONS.chain(seq, n, model.device).expand(batch, -1)
        return lambda: model(input_ids=steps[:, :n], **with_cache(state.cache), use_cache=True, logits_to_keep=n,
                             position_ids=positions)

    return timer.medians_ms({n: forward(n) for n in counts}, reset=lambda: state.rollback(seq))


@torch.inference_mode()
def head_step_latency_ms(head, lm_head, seq: int, timer: Timer) -> float:
    """Median time of one draft-head step (its layer on one new entry after ``seq`` cached ones, then the
    target's LM head): what each drafted token of ``eagle``/``vispec``/``eagle3`` costs."""
    from mmspec_cli.models.head import causal_mask

    weight = head.fc.weight
    generator = torch.Generator().manual_seed(seq)
    hidden = head.input_width
    prefix = torch.randn(1, seq, hidden, generator=generator).to(weight.device, weight.dtype)
    entry = torch.randn(1, 1, hidden, generator=generator).to(weight.device, weight.dtype)
    state = DynamicKV(config=head.config)
    head.body(prefix, torch.arange(seq, device=weight.device)[None], causal_mask(seq, 0, weight.dtype, weight.device),
              state.cache)
    state.wrote(seq)
    position = torch.tensor([[seq]], device=weight.device)
    # no mask: one entry over a dynamic cache sees every key, as a drafter's eager chain step runs it
    return timer.median_ms(run=lambda: lm_head(head.body(entry, position, None, state.cache)),
                           reset=lambda: state.rollback(seq))


@torch.inference_mode()
def ssd_step_latency_ms(model, layer: int, seq: int, timer: Timer, imitation: torch.nn.Module | None = None) -> float:
    """Median time of one ``ssd`` draft step after ``seq`` cached tokens: the target's first ``layer`` decoder layers
    on one token over the target's own cache (as verification left it), then ``imitation`` if given, the final norm
    and the LM head, through the drafter's own code."""
    from mmspec_cli.drafters.ssd import early_exit_decoder, early_exit_logits

    prefix, step = random_ids(model, 1, seq, 1)
    state = DynamicKV(config=model.config)
    fill(model, state, prefix)  # the target's own cache
    decoder, head = early_exit_decoder(model, layer, imitation), model.get_output_embeddings()
    view = state.view(layer)  # the first `layer` layers of the target's cache, as ssd drafts in it
    return timer.median_ms(run=lambda: early_exit_logits(decoder, head, view, step), reset=lambda: view.rollback(seq))


class CompiledFailed(Exception):
    """A step could not be compiled, so ``--compile`` has nothing to time (its message says why)."""


def _compiled(step, run: Callable[[], Any]) -> Callable[[], None]:
    """``run`` (a call of the compiled ``step``) that raises :class:`CompiledFailed` when the step ran eager instead."""

    def timed() -> None:
        if run() is None:
            why = step.failed or "longer than the largest compiled size"
            raise CompiledFailed(f"compiling the {step.role}'s step failed ({why})")

    return timed


def _static_state(module, purpose: str, needed: int):
    """The static state of ``module`` for ``purpose``, claimed as every owner claims one (``kv_state.HeldState``), with
    room for ``needed`` positions, then emptied. The holder is not kept: the next owner to claim the pool finds it
    used by another and feeds what it needs again."""
    from mmspec_cli.decoding.kv_state import HeldState, static_pool

    return HeldState(module.config, static_pool(module, purpose), "timed").restart(needed)


@torch.inference_mode()
def compiled_step_latencies_ms(model, batch: int, seq: int, counts: Sequence[int], timer: Timer,
                               role: str) -> dict[int, float]:
    """:func:`step_latencies_ms` as ``--compile`` runs the step: the model's compiled forward
    (``compiled.compiled_forward``) over its static state; a batch of B > 1 rows under the additive padding
    mask batched rows pass (all of a row's prefix visible)."""
    from mmspec_cli.decoding.compiled import compiled_forward
    from mmspec_cli.drafters.rows import additive_step_mask
    from mmspec_cli.models.families import family_of

    prefix, steps = random_ids(model, batch, seq, max(counts))
    state = _static_state(model, "cached" if batch == 1 else f"rows{batch}", seq + max(counts))
    fill(model, state, prefix)
    compiled = compiled_forward(model, role)
    # one row of plain positions passes none, as a cached model does (its graph reads them from the state)
    implied = batch == 1 and family_of(model).positions().follows_cache

    def forward(n: int) -> Callable[[], None]:
        positions = None if implied else TEXT_POSITIONS.chain(seq, n, model.device).expand(batch, -1).contiguous()
        mask = None
        if batch > 1:
            visible = torch.ones(batch, seq + n, dtype=torch.long, device=model.device)
            mask = state.fit_mask(additive_step_mask(visible, n, model.dtype))
        step = steps[:, :n].contiguous()
        return _compiled(compiled, lambda: compiled(state, step, positions, mask))

    return timer.medians_ms({n: forward(n) for n in counts}, reset=lambda: state.rollback(seq))


@torch.inference_mode()
def compiled_head_step_latency_ms(head, lm_head, seq: int, timer: Timer) -> float:
    """:func:`head_step_latency_ms` as ``--compile`` runs it: the head's compiled layer step over its static state,
    then the target's LM head."""
    from mmspec_cli.drafters.head import compiled_head_step
    from mmspec_cli.models.head import causal_mask

    weight = head.fc.weight
    generator = torch.Generator().manual_seed(seq)
    hidden = head.input_width
    prefix = torch.randn(1, seq, hidden, generator=generator).to(weight.device, weight.dtype)
    entry = torch.randn(1, 1, hidden, generator=generator).to(weight.device, weight.dtype)
    state = _static_state(head, "head", seq + 1)
    head.body(prefix, torch.arange(seq, device=weight.device)[None],  # first write: eager
              state.fit_mask(causal_mask(seq, 0, weight.dtype, weight.device)), state.cache)
    state.wrote(seq)
    position = torch.tensor([[seq]], device=weight.device)
    step = compiled_head_step(head, weight.device)

    def run():  # no mask: the graph makes it from the write pointer, as a drafter's catch-up and chain steps run it
        out = step(state, entry, position, None)
        return None if out is None else lm_head(out[0])

    return timer.median_ms(run=_compiled(step, run), reset=lambda: state.rollback(seq))


@torch.inference_mode()
def compiled_ssd_step_latency_ms(model, layer: int, seq: int, timer: Timer,
                                 imitation: torch.nn.Module | None = None) -> float:
    """:func:`ssd_step_latency_ms` as ``--compile`` runs it: the compiled early exit over a view of the target's
    static state."""
    from mmspec_cli.drafters.ssd import compiled_early_exit, early_exit_decoder

    prefix, ids = random_ids(model, 1, seq, 1)
    state = _static_state(model, "cached", seq + 1)
    fill(model, state, prefix)
    view = state.view(layer)
    step = compiled_early_exit(model, layer, imitation, early_exit_decoder(model, layer, imitation),
                               model.get_output_embeddings())
    positions = TEXT_POSITIONS.chain(seq, 1, model.device)
    return timer.median_ms(run=_compiled(step, lambda: step(view, ids, positions, None)),
                           reset=lambda: view.rollback(seq))


def chain_lengths(gammas: Sequence[int]) -> list[int]:
    """The chain lengths γ timed for a grid of verified token counts n: each n − 1 of at least 2 (a block of γ = 1
    drafts with its catch-up alone)."""
    return sorted({n - 1 for n in gammas if n - 1 >= 2})


@torch.inference_mode()
def compiled_chain_latency_ms(model, batch: int, seq: int, lengths: Sequence[int],
                              timer: Timer) -> dict[int, float]:
    """T_chain(B, S, γ) for each γ of ``lengths``: a greedy chain of γ tokens as ``--compile`` drafts it after ``seq``
    held tokens (fed once for all of them), ONE graph feeding one verified token first (the lead a block after a
    rejection feeds: its catch-up) and then γ − 1 of the chosen: one row through ``CachedModel.run_chain``
    (``single.model_step``, as ``m`` and ``t`` draft), B > 1 member rows through ``BatchedRows.run_chain`` (their
    mixture, as ensembles draft)."""
    from mmspec_cli.decoding.compiled import compiled_chain
    from mmspec_cli.decoding.kv import CachedModel
    from mmspec_cli.drafters.rows import BatchedRows, Row
    from mmspec_cli.drafters.single import model_step

    if not lengths:
        return {}
    prefix, _ = random_ids(model, batch, seq, 1)
    lead = [int(prefix[0, -1])]  # any id: the chain feeds it after the held tokens
    if batch == 1:
        cached = CachedModel(model, role="draft", image_token_id=None, kv="compiled")
        cached.reserve(seq + max(lengths) + 1)
        vocab = cached.logits(prefix[0].tolist(), 1).shape[-1]
        graphs = compiled_chain(model, "greedy chain", cached.compiled, lambda: model_step(model))
        return timer.medians_ms({g: _compiled(graphs, lambda g=g: cached.run_chain(graphs, None, lead, g, vocab))
                                 for g in lengths}, reset=lambda: cached.rollback(seq))
    rows = BatchedRows(model, None, kv="compiled")
    rows.begin([Row(ids=ids) for ids in prefix.tolist()])
    rows.reserve(max(lengths) + 1)
    vocab = rows.logits([]).shape[-1]
    weights = torch.full((batch,), 1.0 / batch, dtype=torch.float64)
    return timer.medians_ms({g: _compiled(rows.chain, lambda g=g: rows.run_chain(None, lead, g, weights, vocab))
                             for g in lengths}, reset=lambda: rows.rollback(0))


@torch.inference_mode()
def compiled_head_chain_latency_ms(head, lm_head, seq: int, lengths: Sequence[int],
                                   timer: Timer) -> dict[int, float]:
    """T_hc(S, γ) for each γ of ``lengths``: a head's greedy chain of γ tokens as ``--compile`` drafts it after ``seq``
    entries (written once for all of them), ONE graph of ``head.chain_step`` feeding γ − 1 of them: the drafter's own
    graph (:func:`~mmspec_cli.drafters.head.head_chain`), which makes its first proposal (the LM head over the last
    entry's output) itself, so that the graph compiled here is the one decoding runs. That LM head call is priced in
    T_h(S) (:func:`compiled_head_step_latency_ms`) and a block's drafting as T_h(S) + T_hc(S, γ)
    (:meth:`~mmspec_cli.decoding.schedules.StepCosts.drafting`), so T_hc is the graph's time less the same LM head
    call timed alone: each call is priced once."""
    from mmspec_cli.drafters.head import chain_params, compiled_head_step, head_chain, head_logits
    from mmspec_cli.models.head import causal_mask

    if not lengths:
        return {}
    weight = head.fc.weight
    generator = torch.Generator().manual_seed(seq)
    prefix = torch.randn(1, seq, head.input_width, generator=generator).to(weight.device, weight.dtype)
    state = _static_state(head, "head", seq + max(lengths))
    out = head.body(prefix, torch.arange(seq, device=weight.device)[None],  # first write: eager
                    state.fit_mask(causal_mask(seq, 0, weight.dtype, weight.device)), state.cache)
    state.wrote(seq)
    h = out[0, -1]
    propose = head_logits(head, lm_head)
    first_ms = timer.median_ms(run=lambda: propose(h))  # the first proposal, which T_h(S) prices
    chain = head_chain(head, compiled_head_step(head, weight.device))

    def run(steps: int):
        positions = torch.arange(seq, seq + steps - 1, device=weight.device)[None]
        out = chain(None, None, h[None], positions, steps, *chain_params(head, lm_head, None), state.cache)
        if out is not None:
            state.wrote(steps - 1)  # the graph moved the write pointers itself
        return out

    chains = timer.medians_ms({g: _compiled(chain, lambda g=g: run(g)) for g in lengths},
                              reset=lambda: state.rollback(seq))
    return {g: max(0.0, ms - first_ms) for g, ms in chains.items()}


@dataclass(frozen=True)
class SsdTiming:
    """What to time for ``ssd``: the profile's ``ssd.layer`` and its imitation network (loaded, and its name)."""

    layer: int
    imitation: torch.nn.Module | None = None
    imitation_name: str | None = None


def measure(target, draft, target_name: str, draft_name: str, batches: Sequence[int], seqs: Sequence[int],
            gammas: Sequence[int], timer: Timer, target_revision: str | None = None,
            draft_revision: str | None = None, heads: dict | None = None, ssd: SsdTiming | None = None,
            compiled: bool = False) -> LatencyResult:
    """The grid of T_p(1, S, γ), T_q(B, S, 1) (when there is a ``draft``), T_h(S) of each of ``heads``
    (kind -> loaded head) and T_s(S) of ``ssd`` (with and without its imitation network; when it has none, the
    one measurement is ``ssd``'s and ``ssd:plain``'s alike); ``target``/``draft`` are the loaded models.
    ``compiled``: each step as ``--compile`` runs it (compiled over a static state; a step's first call, which
    compiles it, is in the timer's warm-up); raises :class:`CompiledFailed` when a step can't be compiled."""
    if compiled:
        steps = lambda model, b, s, ns, role: compiled_step_latencies_ms(model, b, s, ns, timer, role)  # noqa: E731
        head_step, ssd_step = compiled_head_step_latency_ms, compiled_ssd_step_latency_ms
    else:
        steps = lambda model, b, s, ns, role: step_latencies_ms(model, b, s, ns, timer)  # noqa: E731
        head_step, ssd_step = head_step_latency_ms, ssd_step_latency_ms
    # S ascending, and a chain right after the step at its S: a static state only grows, so a step or chain timed
    # after a longer S would run over that S's larger state (attention over its whole capacity)
    seqs = sorted(seqs)
    lengths = chain_lengths(gammas) if compiled else []  # --compile drafts a greedy chain in one graph
    # the verification sizes of each S side by side (Timer.medians_ms): their ratios are what schedules read
    target_ms = {f"{s},{g}": ms for s in seqs for g, ms in steps(target, 1, s, gammas, "target").items()}
    draft_ms, draft_chain_ms = {}, {}
    for b in batches if draft else ():
        for s in seqs:
            draft_ms[f"{b},{s}"] = steps(draft, b, s, [1], "draft")[1]
            draft_chain_ms.update({f"{b},{s},{g}": ms
                                   for g, ms in compiled_chain_latency_ms(draft, b, s, lengths, timer).items()})
    lm_head = target.get_output_embeddings()
    from mmspec_cli.drafters.head import head_logits

    head_ms, head_chain_ms = {}, {}
    for kind, head in (heads or {}).items():
        head_ms[kind], chains = {}, {}
        for s in seqs:
            head_ms[kind][str(s)] = head_step(head, head_logits(head, lm_head), s, timer)
            chains.update({f"{s},{g}": ms
                           for g, ms in compiled_head_chain_latency_ms(head, lm_head, s, lengths, timer).items()})
        if chains:
            head_chain_ms[kind] = chains
    ssd_ms, ssd_setting = {}, None
    if ssd is not None:
        from mmspec_cli.choices import SSD_PLAIN

        ssd_ms[SSD_PLAIN] = {str(s): ssd_step(target, ssd.layer, s, timer) for s in seqs}
        ssd_ms["ssd"] = ssd_ms[SSD_PLAIN] if ssd.imitation is None else {
            str(s): ssd_step(target, ssd.layer, s, timer, ssd.imitation) for s in seqs}
        named = ssd.imitation_name if ssd.imitation is not None else None
        ssd_setting = {"layer": ssd.layer, "imitation": named,
                       "imitation_weights": weights_fingerprint(named) if named else None}
    return LatencyResult(device_name(target.device), target_name, draft_name, target_ms, draft_ms,
                         target_revision, draft_revision, head_ms, ssd_ms, ssd_setting, compiled, draft_chain_ms,
                         head_chain_ms, draft_chains_lead=True)


@dataclass(frozen=True)
class RemarkCheck:
    remark: int
    statement: str
    worst: float  # the largest |ΔT/T| seen
    holds: bool


def _spread(times: Sequence[float]) -> float:
    """Largest |ΔT/T| against the smallest value of a group."""
    if not times:
        return 0.0
    low = min(times)
    return (max(times) - low) / low if low > 0 else 0.0


def check_remarks(result: LatencyResult, tolerance: float = REMARK_TOLERANCE) -> list[RemarkCheck]:
    """TABED Remarks 1-3 on this hardware, each as the worst |ΔT/T| over its groups."""
    r1 = max((_spread([result.t_p(s, g) for g in result.gammas]) for s in result.seqs), default=0.0)
    r2 = max((_spread([result.t_q(b, s) for s in result.seqs]) for b in result.batches), default=0.0)
    r3 = max((_spread([result.t_q(b, s) for b in result.batches]) for s in result.seqs), default=0.0)
    statements = {
        1: "target: T_p(1, S, γ) does not depend on γ",
        2: "draft: T_q(B, S, 1) does not depend on S",
        3: "draft: T_q(B, S, 1) does not depend on B",
    }
    checked = ((1, r1), (2, r2), (3, r3)) if result.draft_ms else ((1, r1),)  # no draft model: no draft remarks
    return [RemarkCheck(i, statements[i], worst, worst < tolerance) for i, worst in checked]


def cache_dir() -> Path:
    base = os.environ.get("MMSPEC_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "mmspec")
    return Path(base).expanduser() / "latency"


WEIGHT_FILES = ("config.json", "*.safetensors", "*.bin")


def weights_fingerprint(model: str, revision: str | None = None) -> str:
    """What ``model`` (a profile's model name, at ``revision``) stands for on this machine, as a short string.

    A local folder (``mmspec:NAME`` included): the names, sizes and modification times of its
    config and weight files, so retraining or reinstalling changes it. A hub id: the commit of
    its snapshot at ``revision`` in the local Hugging Face cache, else the revision as given.
    '' when none of these is known; then the names alone key the cache, as they did before
    fingerprints (an old cache file of the same names is then read).
    """
    from mmspec_cli.errors import ModelLoadError
    from mmspec_cli.models.loading import model_location

    try:
        location = Path(model_location(model))
    except ModelLoadError:
        return ""
    if location.is_dir():
        files = sorted({p for pattern in WEIGHT_FILES for p in location.glob(pattern) if p.is_file()})
        stats = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
        return hashlib.sha1(repr(stats).encode()).hexdigest()[:12] if stats else ""
    pinned = f"revision {revision}" if revision else ""
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(model, "config.json", revision=revision)
    except (ValueError, OSError):  # not a valid repo id (HFValidationError is a ValueError), or no cache
        return pinned
    return Path(cached).parent.name if isinstance(cached, str) else pinned


def cache_path(device: str, target: str, draft: str, target_revision: str | None = None,
               draft_revision: str | None = None, compiled: bool = False) -> Path:
    slug = "__".join(re.sub(r"[^A-Za-z0-9._-]+", "-", part).strip("-") for part in (device, target, draft))
    prints = [weights_fingerprint(target, target_revision), weights_fingerprint(draft, draft_revision)]
    if any(prints):
        slug += "__" + hashlib.sha1("|".join(prints).encode()).hexdigest()[:10]
    return cache_dir() / f"{slug}{'__compiled' if compiled else ''}.json"


def save(result: LatencyResult) -> Path:
    path = cache_path(result.device, result.target, result.draft, result.target_revision, result.draft_revision,
                      result.compiled)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(result), indent=2))
    return path


class DamagedCache(Exception):
    """A latency cache file that can't be read as ``profile-latency`` wrote it (cut, emptied, edited, unreadable):
    ``str()`` says where and why, in words a note can quote."""

    def __init__(self, path: Path, why: str):
        super().__init__(f"the latency cache {path} can't be read ({why})")
        self.path = path


def load(device: str, target: str, draft: str, target_revision: str | None = None,
         draft_revision: str | None = None, compiled: bool = False) -> LatencyResult | None:
    """The cached result for this device and model pair (at these revisions, with these weights), or None;
    ``compiled``: the one timed with ``--compile``. A file that is there but is not what ``profile-latency`` writes
    raises :class:`DamagedCache` (callers say so in one line and go on without it; ``profile-latency`` writes it
    anew)."""
    path = cache_path(device, target, draft, target_revision, draft_revision, compiled)
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_bytes())
    except OSError as exc:
        raise DamagedCache(path, exc.strerror or type(exc).__name__) from None
    except (ValueError, RecursionError) as exc:  # JSON's and a bad encoding's errors are ValueErrors
        raise DamagedCache(path, f"not JSON: {type(exc).__name__}" if not str(exc) else
                           f"not JSON: {str(exc).splitlines()[0][:80]}") from None
    why = cache_fault(data)
    if why:
        raise DamagedCache(path, why)
    return LatencyResult(**{key: value for key, value in data.items() if key in CACHE_FIELDS})  # a newer release's
    # keys are left out


def _milliseconds(value: Any) -> bool:
    """A timing: a finite number of milliseconds above 0 (a ratio divides by it)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _timings(value: Any, parts: int) -> bool:
    """``{"S,γ": ms, ...}`` with ``parts`` integers in each key."""
    return isinstance(value, dict) and all(
        isinstance(key, str) and len(key.split(",")) == parts and all(k.strip().isdigit() for k in key.split(","))
        and _milliseconds(ms) for key, ms in value.items())


def _named_timings(value: Any, parts: int) -> bool:
    return isinstance(value, dict) and all(isinstance(name, str) and _timings(t, parts) for name, t in value.items())


#: What each field of a cached :class:`LatencyResult` holds: name -> (check, required). Every field of the class has
#: one (tests/test_latency.py checks); the verification grid is required, as every ratio divides by it.
CACHE_FIELDS = {
    "device": (lambda v: isinstance(v, str), True), "target": (lambda v: isinstance(v, str), True),
    "draft": (lambda v: isinstance(v, str), True),
    "target_ms": (lambda v: _timings(v, 2) and bool(v), True), "draft_ms": (lambda v: _timings(v, 2), False),
    "target_revision": (lambda v: v is None or isinstance(v, str), False),
    "draft_revision": (lambda v: v is None or isinstance(v, str), False),
    "head_ms": (lambda v: _named_timings(v, 1), False), "ssd_ms": (lambda v: _named_timings(v, 1), False),
    "ssd": (lambda v: v is None or isinstance(v, dict), False), "compiled": (lambda v: isinstance(v, bool), False),
    "draft_chain_ms": (lambda v: _timings(v, 3), False), "head_chain_ms": (lambda v: _named_timings(v, 2), False),
    "draft_chains_lead": (lambda v: isinstance(v, bool), False),
}


def cache_fault(data: Any) -> str | None:
    """What is wrong with ``data`` as a cached latency result, in words; None when nothing is."""
    if not isinstance(data, dict):
        return f"a JSON {type(data).__name__}, not an object"
    for name, (check, required) in CACHE_FIELDS.items():
        if name not in data:
            if required:
                return f"no {name!r}"
        elif not check(data[name]):
            return f"{name!r} is not what profile-latency writes"
    return None


# --------------------------------------------------------------------------- step costs for --gamma-schedule cost

#: The draft name of a profile that has only draft heads (cache key); ``cli/profile_latency.py`` saves under it.
NO_DRAFT = "none"


@dataclass(frozen=True)
class OwnStep:
    """A drafter's own draft step as a cached result holds it (:func:`own_step`)."""

    per_seq: dict[int, float]  # S -> ms of one step
    chains: dict[tuple[int, int], float]  # (S, γ) -> ms of a compiled greedy chain of γ tokens (--compile)
    ratio: dict[str, Any]  # the keywords of LatencyResult.ratio that price this step
    shown: str  # how a summary names it
    leads: bool  # whether its chains feed their catch-up's token first (StepCosts.chain_leads)


def own_step(result: LatencyResult, plan: Any, rows: int | None = None, ssd_layer: int | None = None,
             imitation: str | None = None) -> OwnStep | None:
    """THE pricing switch: the draft step drafter ``plan`` (a :class:`~mmspec_cli.drafters.registry.DrafterPlan`)
    declares, as ``result`` timed it, or None when it was not timed: a head's T_h(S) of its kind, ssd's T_s(S) when
    timed at ``ssd_layer`` with ``imitation`` (:meth:`LatencyResult.times_ssd`; ``ssd:plain`` never uses one), the
    draft model's T_q(B, S, 1) at ``rows`` batch rows (default: the plan's members; no other B stands in for it).
    A plan that drafts with no network (``ar``, ``oracle``, ``pld``) has no step: None. A step this function does
    not know is an error, never priced as another's. ``bench``'s Eq. (1), ``profile-latency``'s and
    ``--gamma-schedule cost`` all look a drafter's step up here."""
    from mmspec_cli.drafters.registry import DRAFT_MODEL, EARLY_EXIT, HEAD

    name = plan.name
    if plan.step is None:
        return None
    if plan.step == HEAD:
        per_seq, chains = result.head_ms.get(name, {}), result.head_chain_ms.get(name, {})
        ratio, shown, leads = {"head": name}, f"{name} head step T_h", False  # a head's catch-up is its own T_h
    elif plan.step == EARLY_EXIT:  # its compiled chain calls its compiled step γ times: no chain graph
        per_seq = result.ssd_ms.get(name, {}) if result.times_ssd(name, ssd_layer, imitation) else {}
        chains, ratio, leads = {}, {"ssd": name}, False
        through = " + imitation network" if name == "ssd" and imitation else ""
        layers = f"{ssd_layer} layer" if ssd_layer == 1 else f"{ssd_layer} layers"
        shown = f"ssd's own step T_s: the target's first {layers}{through}"
    elif plan.step == DRAFT_MODEL:
        batch = str(rows or len(plan.members))
        per_seq = {s: ms for key, ms in result.draft_ms.items() for b, s in [key.split(",")] if b == batch}
        chains = {key.split(",", 1)[1]: ms for key, ms in result.draft_chain_ms.items() if key.split(",")[0] == batch}
        ratio, shown, leads = {"batch": int(batch)}, f"draft model step T_q, B={batch}", result.draft_chains_lead
    else:
        raise ValueError(f"drafter '{name}' drafts with a {plan.step!r} step, which bench/latency.own_step does not "
                         f"price; add it there")
    if not per_seq:
        return None
    return OwnStep({int(s): ms for s, ms in per_seq.items()},
                   {(int(s), int(g)): ms for key, ms in chains.items() for s, g in [key.split(",")]}, ratio, shown,
                   leads)


def step_costs(result: LatencyResult, drafter: str, default_members: Sequence[str] = ("m", "t"),
               ssd_layer: int | None = None, imitation: str | None = None, greedy: bool = True) -> StepCosts | None:
    """What ``--gamma-schedule cost`` prices ``drafter``'s blocks with, from a cached ``result``; None when the
    result lacks ``drafter``'s draft step (:func:`own_step`) or ``drafter`` is ``ar``, which drafts nothing.

    The verification is ``result``'s T_p(1, S, n) grid; one draft step is the step :func:`own_step` finds (the draft
    model's T_q(B, S, 1) at the drafter's B rows: 1 for ``m``, ``t``; 2 for ``mt``; the profile's members for
    ``tabed``; a head's T_h(S); ssd's T_s(S) at ``ssd_layer`` with ``imitation``), and nothing for ``oracle`` and
    ``pld``, which run no model to draft. A ``greedy`` run of a ``--compile`` result also gets the chains it drafts
    in one graph (the draft model's T_chain at its rows, a head's T_hc); a sampled chain is drafted step by step."""
    if drafter == "ar":
        return None
    verify = {(int(s), int(n)): ms for key, ms in result.target_ms.items() for s, n in [key.split(",")]}
    if not verify:
        return None
    from mmspec_cli.drafters.registry import parse_drafter

    plan = parse_drafter(drafter, tuple(default_members))
    if not plan.model_drafts:
        return StepCosts(verify)
    step = own_step(result, plan, ssd_layer=ssd_layer, imitation=imitation)
    if step is None:
        return None
    return StepCosts(verify, step.per_seq, step.chains if greedy else {}, step.leads)


def profile_argument(profile) -> str:
    """How ``--profile`` names ``profile`` in a command a note gives: its built-in name, else its file."""
    from mmspec_cli.models.profiles import builtin_profiles_dir

    return profile.name if Path(profile.source).parent == builtin_profiles_dir() else profile.source


def run_step_costs(profile, drafters: Sequence[str], device: torch.device | str,
                   threads: int | None = None) -> tuple[dict[str, StepCosts], str | None]:
    """The step costs of each of ``drafters`` when ``profile`` drafts under ``--gamma-schedule cost`` (drafter ->
    :class:`StepCosts`), from the latencies ``profile-latency`` cached for this machine (``device`` with this
    process's CPU thread count) and the profile's models, timed as the run runs its steps (``decoding.compile``),
    and one ``note:`` line when some drafter has none, which then drafts the constant γ: the command to run
    (``threads``: the run's ``--threads``, repeated in it). Nothing under another schedule, or for ``ar``.

    The schedule prices chains: with a tree (``decoding.tree`` width or dynamic) it is not used, and the note says so.
    """
    decoding = profile.decoding
    wanted = [name for name in drafters if name != "ar"]
    if decoding.gamma_schedule != "cost" or not wanted:
        return {}, None
    kind = tree_kind(decoding.tree, decoding.tree_width)
    if kind != "chain":
        return {}, (f"note: --gamma-schedule cost prices chains, not a {kind} tree; it uses the constant "
                    f"γ = {decoding.gamma}")
    here = device_name(device)

    def command(names: Sequence[str]) -> str:  # what measures the step costs of ``names`` here
        layer = profile.ssd.layer if {"ssd", SSD_PLAIN} & set(names) else None  # the run's, which may be a flag's
        return (f"mmspec profile-latency --profile {profile_argument(profile)}"
                f"{f' --threads {threads or torch.get_num_threads()}' if str(device).startswith('cpu') or threads else ''}"
                f"{' --compile' if decoding.compile else ''}"
                f"{f' --ssd-layer {layer}' if layer else ''}")

    try:
        result = load(here, profile.target.model, profile.draft.model if profile.draft else NO_DRAFT,
                      profile.target.revision, profile.draft.revision if profile.draft else None, decoding.compile)
    except DamagedCache as exc:  # as if nothing were measured, said as what it is
        return {}, (f"note: {exc}; --gamma-schedule cost uses the constant γ = {decoding.gamma} (run "
                    f"{command(wanted)} to measure the step costs again)")
    costs = {}
    for name in wanted:
        found = result and step_costs(result, name, profile.ensemble.members, profile.ssd.layer,
                                      profile.ssd.imitation, greedy=decoding.temperature == 0)
        if found:
            costs[name] = found
    missing = [name for name in wanted if name not in costs]
    # a compiled greedy chain runs as one graph: a cache from before chains were timed prices it as γ steps (a grid
    # with no n of 3 or more times no chain, and rerunning it would not either)
    unchained = [name for name, found in costs.items() if decoding.compile and decoding.temperature == 0
                 and found.draft_ms and not found.chain_ms and name not in ("ssd", SSD_PLAIN)
                 and chain_lengths(result.gammas)]
    if not missing and not unchained:
        return costs, None
    stale = (f"the step costs cached on this machine ({here}) hold no compiled chains (timed since this release); "
             f"--gamma-schedule cost prices the drafting of {', '.join(unchained)} as γ single steps, which drafts "
             f"shorter than it should")
    if not missing:
        return costs, f"note: {stale} (run {command(missing)} again)"
    which = "" if len(missing) == len(wanted) == 1 else \
        f" and {'drafter' if len(missing) == 1 else 'drafters'} {', '.join(missing)}"
    return costs, (f"note: --gamma-schedule cost has no step costs measured on this machine ({here}) for this "
                   f"profile{which}; {'it uses' if len(missing) == 1 else 'they use'} the constant γ = "
                   f"{decoding.gamma}{f', and {stale}' if unchained else ''} (run {command(missing)} first)")
