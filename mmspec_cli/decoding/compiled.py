"""Short decoding steps compiled with ``torch.compile`` over a static KV state (``decoding.compile``, ``--compile``).

**What is compiled.** The steps a decoding loop repeats, each over its owner's static state
(:class:`~mmspec_cli.decoding.kv_state.StaticKV`): the target's one-token step and its verification of
a chain or a tree, and its ``ar`` step (:func:`compiled_forward`, also a draft model's step for ``m``,
``t`` and the batched member rows of ensembles); a draft head's layer (``eagle``, ``vispec``); ssd's
early exit over the target's first layers (:func:`shared_step`). A forward with pixels (a prompt with
images) and a step longer than the largest padded size run eager over the same state; a text-only
prompt of up to 64 tokens is one more padded step.

**One graph per size.** A compiled graph has fixed shapes, so a step of ``n`` positions is padded to
the next of :data:`PADDED_SIZES`. The padding continues the positions, and a prepared mask gets rows
that see what the last real row sees and themselves (:func:`pad_mask`). Its keys and values land after
the real ones and the state's pointer is put back after the real ones
(:meth:`~mmspec_cli.decoding.kv_state.StaticKV.wrote`), so they are hidden, then overwritten. Chains
and trees are separate graphs (a tree passes its mask), and so is each state size. Each graph is a
function of its own compiled without dynamo's guards (:class:`CompiledGraphs`): :class:`CompiledStep`
picks the graph by shape itself, and a call skips the guard checks, which cost about a third of the demo
target's compiled step. A greedy chain is one graph too (:func:`compiled_chain`: the one chain loop over a drafter kind's draft step).

**One per model and process.** A model (or head) has one compiled step and one static state per
purpose in a process (:func:`shared_step`, :func:`~mmspec_cli.decoding.kv_state.static_pool`), so every
decoder of a process (``bench`` and ``compare`` build many) reuses the graphs. Every owner holds its state as a
:class:`~mmspec_cli.decoding.kv_state.HeldState`: one that finds the state used by another since feeds its prompt
again at its next turn (in the middle of a turn that is an error: :data:`~mmspec_cli.decoding.kv_state.LOST_STATE`).

**Backends.** On CPU, inductor with its C++ wrapper (the Python wrapper gains little for small
models: ``docs/BENCHMARKS.md``); on CUDA, CUDA graphs (what ``mode="reduce-overhead"`` sets, as options:
:func:`compile_options`; run on an H100, docs/BENCHMARKS.md). A CPU graph is traced with grouped-query
attention in place of repeated key/value heads (:func:`grouped_query_attention`). Inductor keeps what it
compiled on disk (:func:`inductor_cache_dir`), so a second process compiles faster. :data:`LOG` counts
compile time apart: ``TurnClock`` leaves it out of a turn.

**Failures.** :func:`compile_blocker` says why a model can't be compiled before anything runs (no
C++ compiler, a device other than CPU or CUDA, a quantized model, a decoder whose cache layers
are not plain static ones). A failure while compiling falls back to eager for that step, with
one line on stderr; the output is unchanged, since the eager forward computes the same tokens.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import types
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from transformers.cache_utils import Cache, StaticLayer

from mmspec_cli.decoding.chain import chain_loop, greedy_choice
from mmspec_cli.decoding.kv_state import MAX_STEP, StaticKV
from mmspec_cli.models.parts import text_decoder, with_cache

#: Language models whose compiled step (embeddings, decoder, LM head, as their ``forward`` runs them without
#: pixels) is the model's own forward; others (a final logit soft-cap, say) would need their own step. The Qwen-VL
#: text decoders take M-RoPE's (3, B, n) positions, which a padded step continues on every axis.
COMPILED_DECODERS = ("llama", "mistral", "qwen2", "qwen2_vl_text", "qwen2_5_vl_text", "qwen3_vl_text")

#: dynamo's filter that drops every guard of a graph (torch 2.8 and later; an older torch keeps its guards, which
#: costs time a call, not correctness).
SKIP_GUARDS = getattr(torch.compiler, "skip_all_guards_unsafe", None)

#: The query lengths a step is padded to; a longer step runs eager. Every length up to 6 is its own size
#: (γ + 1 for γ ≤ 5, the default's verification, and the shorter blocks near max_new_tokens); a size is
#: compiled the first time a step needs it.
PADDED_SIZES = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, MAX_STEP)


#: What ``mode="reduce-overhead"`` sets (CUDA graphs), as options: ``torch.compile`` takes a mode or options, not both.
CUDA_GRAPHS = {"triton.cudagraphs": True}


def compile_options(device: torch.device) -> dict[str, Any]:
    """``torch.compile``'s inductor options for a step on ``device``: no guards (where torch has the filter), and
    the C++ wrapper on CPU or CUDA graphs on CUDA. Options only: ``torch.compile`` refuses a ``mode`` given with
    ``options`` (a first CUDA run found every step falling back to eager for it)."""
    options: dict[str, Any] = {"guard_filter_fn": SKIP_GUARDS} if SKIP_GUARDS is not None else {}
    return {**options, **(CUDA_GRAPHS if device.type == "cuda" else {"cpp_wrapper": True})}


def padded_size(n: int) -> int | None:
    """The compiled size a step of ``n`` tokens is padded to; None when it is longer than the largest."""
    return next((size for size in PADDED_SIZES if size >= n), None)


def inductor_cache_dir() -> str:
    """Where inductor keeps compiled code on disk (``TORCHINDUCTOR_CACHE_DIR`` moves it)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


def compile_blocker(model: Any) -> str | None:
    """Why ``model``'s forward can't be compiled here, or None."""
    device = getattr(model, "device", torch.device("cpu"))
    if device.type not in ("cpu", "cuda"):
        return f"compiling supports CPU and CUDA, not {device.type}"
    if getattr(model, "is_quantized", False) or getattr(model.config, "quantization_config", None):
        return "a quantized (bitsandbytes) model is not compiled"
    kind = getattr(model.config.get_text_config(), "model_type", None)
    if kind not in COMPILED_DECODERS:
        return (f"its language model is {kind}, and only {', '.join(COMPILED_DECODERS)} are checked to compile to "
                f"the same tokens")
    if not StaticKV.supports(model.config):
        return "its decoder has sliding-window cache layers, which a static KV state does not roll back"
    if device.type == "cpu":
        try:
            from torch._inductor.cpp_builder import get_cpp_compiler

            get_cpp_compiler()
        except Exception:  # inductor raises its own InvalidCxxCompiler, or fails to run the one named in CXX
            return "no C++ compiler was found (inductor needs g++ or clang++ on PATH, or CXX set to one)"
    return None


@dataclass
class CompileLog:
    """What compiling cost in this process: seconds per model role, and the sizes compiled."""

    seconds: dict[str, float] = field(default_factory=dict)
    sizes: dict[str, set] = field(default_factory=dict)
    compiles: int = 0  # graphs compiled: each new shape of each compiled step

    def clear(self) -> None:
        """Forget what was compiled so far (a command reports what it compiled itself)."""
        self.seconds, self.sizes = {}, {}

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())

    def spent(self, role: str, seconds: float) -> None:
        """``seconds`` that went to compiling for ``role`` (a failed attempt too): not decoding time."""
        self.seconds[role] = self.seconds.get(role, 0.0) + seconds
        self.sizes.setdefault(role, set())

    def add(self, role: str, size: tuple, seconds: float) -> None:
        """A graph of ``size`` compiled for ``role`` in ``seconds``."""
        self.compiles += 1
        self.spent(role, seconds)
        self.sizes[role].add(size)

    def summary(self) -> str | None:
        """One line on what was compiled and where inductor keeps it; None when nothing was."""
        if not self.seconds:
            return None
        parts = [f"the {role}'s steps ({len(self.sizes[role])} shape{'s' * (len(self.sizes[role]) != 1)}) in "
                 f"{s:.1f} s" for role, s in self.seconds.items()]
        return (f"compiled {' and '.join(parts)}, not counted in the times above; inductor keeps the code in "
                f"{inductor_cache_dir()}, so a second process compiles faster")


LOG = CompileLog()


#: transformers' own switch (``integrations/sdpa_attention.py``, transformers 5.23 and later) that makes its SDPA
#: attention pass ``enable_gqa`` instead of repeating the key/value heads (``repeat_kv``) when a mask is given.
FORCE_GQA = "TRANSFORMERS_SDPA_FORCE_GQA"


@dataclass
class _SwitchHolders:
    """How many first calls hold :data:`FORCE_GQA` on now, and its value before the first of them."""

    count: int = 0
    before: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


_GQA = _SwitchHolders()


@contextmanager
def grouped_query_attention() -> Iterator[None]:
    """While inside: transformers' SDPA attention attends each key/value head for its group of query heads
    (``enable_gqa``) rather than copying the keys and values once per query head first.

    A step over a static state always has a mask (the state's unused slots), and with a mask transformers repeats
    the heads: in a compiled step that is a copy of each layer's whole cache, every step. On CPU the flash kernel
    takes ``enable_gqa`` with a mask; on the demo target it made the compiled one-token step take 0.78-0.82 of the
    time and a six-token one 0.90-0.93 on a quiet machine, with logits equal to the last bit
    (``benchmarks/bench_gqa.py``, docs/BENCHMARKS.md). :class:`CompiledGraphs` turns it on for a CPU graph's first
    call, whose trace bakes it into the graph (no guard re-reads it), and puts the environment back after; the
    switch is the process's, so a forward that another thread runs during that call sees it too (the same numbers
    on CPU). Not for CUDA graphs: there SDPA with both a mask and ``enable_gqa`` leaves the fused kernels for the
    math one (transformers checks for that), and no GPU run has measured it. A transformers older than 5.23 does
    not read the switch, and the graphs repeat the heads as before.
    """
    with _GQA.lock:  # threads tracing at once: the first saves the value, the last puts it back
        if not _GQA.count:
            _GQA.before = os.environ.get(FORCE_GQA)
        _GQA.count += 1
        os.environ[FORCE_GQA] = "1"
    try:
        yield
    finally:
        with _GQA.lock:
            _GQA.count -= 1
            if not _GQA.count:
                if _GQA.before is None:
                    os.environ.pop(FORCE_GQA, None)
                else:
                    os.environ[FORCE_GQA] = _GQA.before


def trace_key(args: tuple, switches: tuple = ()) -> tuple:
    """What a trace of a graph called with ``args`` specialises on, as one hashable key: for a tensor its shape,
    strides, dtype and device (so the positions' rank, a batch, a padded size, a state's capacity); for a cache its
    class and each layer's class and buffers; for a number, a string, a dtype or None its value (a chain's length,
    a vocabulary cut: the trace unrolls or bakes them); tuples and lists element by element; ``switches``: the
    switches the trace runs under (:func:`grouped_query_attention`). Two calls with the same key run the same
    graph correctly; a call whose key differs gets a graph of its own. Anything else is refused (TypeError), so a
    new kind of argument can't slip past the key."""
    return tuple(_traced_as(arg) for arg in args) + (switches,)


#: The keys of caches whose every layer is a static one with its buffers allocated: those buffers never change
#: shape, dtype or device again, so the key is computed once per cache (a cache is an argument of every step).
_FIXED_CACHE_KEYS: "weakref.WeakKeyDictionary[Cache, tuple]" = weakref.WeakKeyDictionary()


def _traced_as(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.stride(), value.dtype, value.device)
    if isinstance(value, Cache):
        key = _FIXED_CACHE_KEYS.get(value)
        if key is None:
            layers = value.layers
            key = ("cache", type(value), tuple((type(layer), getattr(layer, "is_initialized", None),
                                                _traced_as(getattr(layer, "keys", None)),
                                                _traced_as(getattr(layer, "values", None))) for layer in layers))
            if all(type(layer) is StaticLayer and layer.is_initialized for layer in layers):
                _FIXED_CACHE_KEYS[value] = key
        return key
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(_traced_as(item) for item in value))
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        return (type(value), value)
    raise TypeError(f"trace_key: no key for an argument of type {type(value).__name__}")


class CompiledGraphs:
    """``fn`` compiled once per key: a graph per step shape, or per length of a greedy chain.

    Each key gets a code object of its own, compiled with no guards at all (``skip_all_guards_unsafe``):
    dynamo's guards on a decoder, its parameters and a cache object cost about 0.5 ms a call on the demo
    target, a third of its whole compiled step (docs/BENCHMARKS.md). That is sound because the caller picks
    the graph by a key that holds everything a trace specialises on that can differ between its calls (for a
    step: the padded size, a mask or none, the state's capacity, batch, layers and cache class, the inputs'
    dtype and rank, the positions' rank); everything else a graph reads (keys, values, write pointers,
    positions, weights) is a tensor, read afresh at every call.

    A failure while compiling or running a graph turns every later call into None (the caller runs eager),
    with one line on stderr; ``partner`` (a model's step, for its greedy chain) shares it both ways, so a
    model whose graphs can't be built is named once and runs eager.
    """

    def __init__(self, fn: Callable, role: str, device: torch.device, partner: "CompiledGraphs | None" = None):
        self.role = role
        self._failure: list[str | None] = partner._failure if partner is not None else [None]
        self._eager = fn
        self.device = device
        self._graphs: dict[tuple, Callable] = {}
        self._traced: set[tuple] = set()  # keys whose first call compiled their graph (counted in LOG)
        # whether graphs are traced under grouped_query_attention: on CPU, where graphs have no guards (a guard on
        # the switch would retrace each graph without it at its next call); benchmarks/bench_gqa.py turns it off
        self.grouped_query = device.type == "cpu" and SKIP_GUARDS is not None

    @property
    def failed(self) -> str | None:
        """Why compiling failed (every later call runs eager), or None."""
        return self._failure[0]

    @property
    def traced(self) -> frozenset:
        """The keys whose graphs have been compiled and run."""
        return frozenset(self._traced)

    def _graph(self, key: tuple) -> Callable:
        graph = self._graphs.get(key)
        if graph is None:
            eager = self._eager
            code = eager.__code__.replace(co_name=f"{eager.__name__}_{len(self._graphs)}")
            fn = types.FunctionType(code, eager.__globals__, code.co_name, eager.__defaults__, eager.__closure__)
            graph = torch.compile(fn, dynamic=False, options=compile_options(self.device))
            self._graphs[key] = graph
        return graph

    def __call__(self, *args: Any) -> tuple[torch.Tensor, ...] | None:
        """The graph traced for calls like this one (:func:`trace_key`) run on ``args``, or None when compiling failed
        (now or before)."""
        if self.failed:
            return None
        key = trace_key(args, (self.grouped_query,))
        start = time.perf_counter()
        tracing = key not in self._traced
        try:  # only a trace reads the switch: later calls skip it
            with grouped_query_attention() if tracing and self.grouped_query else nullcontext():
                outputs = self._graph(key)(*args)
        except Exception as exc:  # inductor, dynamo or the C++ toolchain: decoding goes on eager
            LOG.spent(self.role, time.perf_counter() - start)
            self._failure[0] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
            print(f"warning: compiling the {self.role}'s forward failed ({self.failed}); it runs eager from now on",
                  file=sys.stderr)
            return None
        if tracing:
            self._traced.add(key)
            LOG.add(self.role, key, time.perf_counter() - start)
        return outputs


class CompiledStep:
    """``fn(inputs, position_ids, attention_mask, cache)`` -> a tuple of (B, n, ...) tensors, compiled once per
    padded size (and chain or tree, and state): the short steps a decoding loop repeats over a static state.

    ``inputs`` are token ids (B, n) or embeddings (B, n, H); ``attention_mask`` a prepared 4-D mask
    (B, 1, n, capacity) or None for a causal chain.
    """

    def __init__(self, fn: Callable, role: str, device: torch.device):
        self.role = role
        self._eager = fn
        self.graphs = CompiledGraphs(fn, role, device)

    @property
    def failed(self) -> str | None:
        """Why compiling failed (every later step runs eager), or None."""
        return self.graphs.failed

    def __call__(self, state: StaticKV, inputs: torch.Tensor, positions: torch.Tensor | None,
                 mask: torch.Tensor | None) -> tuple[torch.Tensor, ...] | None:
        """The outputs for the ``n`` fed positions (the padding's cut off: an unpadded step's outputs are the graph's
        own, not views of them), or None when this step runs eager (longer than the largest padded size, or
        compiling failed). ``positions`` None: the model reads them from the state's write pointer (a chain of plain
        positions, :attr:`~mmspec_cli.models.positions.Positions.follows_cache`), the padding's included."""
        n = inputs.shape[1]
        size = padded_size(n)
        if self.failed or size is None:
            return None
        pad = size - n
        if pad:
            inputs = torch.cat([inputs, inputs[:, -1:].expand(-1, pad, *inputs.shape[2:])], dim=1)
            if positions is not None:
                steps = torch.arange(1, pad + 1, device=positions.device)
                positions = torch.cat([positions, positions[..., -1:] + steps], dim=-1)  # (B, n) or (3, B, n)
            if mask is not None:
                mask = pad_mask(mask, state.length, pad)
        state.room_for(size)
        # contiguous: a graph runs with the strides it was compiled for (batched rows' positions are slices)
        inputs = inputs.contiguous()
        positions = None if positions is None else positions.contiguous()
        mask = None if mask is None else mask.contiguous()
        if not state.allocated:
            # A static layer allocates its buffers at its first write and marks them static then, but not while dynamo
            # traces: buffers first written inside a graph would make CUDA graphs skip every step ("mutated inputs").
            # So a state's first write (a head's first pair, say) runs eager, the same function.
            outputs = self._eager(inputs, positions, mask, state.cache)
            state.wrote(size, kept=n)
            return tuple(out[:, :n] for out in outputs) if pad else tuple(outputs)
        outputs = self.graphs(inputs, positions, mask, state.cache)
        if outputs is None:
            state.rollback(state.length)  # the pointers back where they were, whatever the failed call wrote
            return None
        state.wrote(size, kept=n)
        if self.graphs.device.type == "cuda":  # a CUDA graph's outputs are overwritten by its next replay
            return tuple(out[:, :n].clone() for out in outputs)
        # a CPU graph allocates its outputs at every call; a view per output costs an op each after a forward
        return tuple(out[:, :n] for out in outputs) if pad else outputs


def pad_mask(mask: torch.Tensor, written_at: int, pad: int) -> torch.Tensor:
    """A prepared mask (B, 1, n, W) grown by ``pad`` rows for padding fed after its ``n`` rows, whose entries are
    written from slot ``written_at + n`` on: each sees what the last real row sees, and itself (a row that sees
    nothing would put NaNs in the cache's later slots)."""
    b, _, n, width = mask.shape
    rows = mask[:, :, -1:, :].expand(b, 1, pad, width).clone()
    own = torch.arange(pad, device=mask.device)
    rows[:, 0, own, written_at + n + own] = 0
    return torch.cat([mask, rows], dim=2)


_STEPS: "weakref.WeakKeyDictionary[Any, dict[str, Any]]" = weakref.WeakKeyDictionary()


def shared_step(owner: Any, name: str, make: Callable[[], Callable], role: str, device: torch.device) -> CompiledStep:
    """The one :class:`CompiledStep` ``name`` of ``owner`` (a draft head, ssd's early exit) in this process, over the
    function ``make()`` builds. That function must hold neither a decoder (every decoder of the process shares it)
    nor ``owner`` itself (the registry's key must stay collectable): only ``owner``'s parts."""
    steps = _STEPS.setdefault(owner, {})
    if name not in steps:
        steps[name] = CompiledStep(make(), role, device)
    return steps[name]


def compiled_chain(owner: Any, name: str, step: CompiledStep, make_step: Callable[[], Callable],
                   make_first: Callable[[], Callable] | None = None) -> CompiledGraphs:
    """The one compiled greedy chain ``name`` of ``owner`` (a draft model, a batch of its rows, a head) in this
    process: :func:`~mmspec_cli.decoding.chain.chain_loop`, THE chain loop, over the draft step ``make_step()``
    builds, in ONE graph per chain length. The step is a function of ``owner``'s parts (the rules of
    :func:`shared_step`): ``step(token, carry, position, *params) -> (proposal, carry)`` feeds one chosen token
    (1,) at ``position`` (the chain's positions sliced for it) and returns the next proposal. The graph is called
    ``(first, lead, carry, positions, steps, *params)``: ``first`` the proposal after the held tokens;
    ``lead`` None, or the verified tokens (n,) the state lacks, which the graph feeds first, in one step, and
    proposes from (``first`` is then None: :func:`~mmspec_cli.decoding.chain.draft_chain`'s ``lead``; the step
    then takes (n,) tokens at n positions); ``positions`` those of the tokens it feeds (the lead's first, then the
    ``steps`` − 1 chosen ones'), or None for a step that reads them from its state (a draft model's plain positions,
    batched rows' from their origins); it returns the (steps,) tokens and, when proposals are pairs, what each kept
    (steps, ...). ``make_first`` builds ``first(carry, *params)``, the first proposal from the carry (a head's LM
    head over its last output): called with ``first`` and ``lead`` None, the graph computes it itself (the same key
    for every such call: None is keyed by value); a chain made without it must be given ``first`` or ``lead``, and
    the first ``make_first`` given for ``owner`` and ``name`` is the one kept
    (:func:`~mmspec_cli.drafters.head.head_chain` makes every head's chain). It shares ``step``'s failure: a model
    whose step can't be compiled drafts its chains step by step, eager, and is named once."""

    def make() -> Callable:
        draft_step = make_step()
        first_of = make_first() if make_first is not None else None

        def chain(first, lead, carry, positions, steps, *params):
            def at(start, stop):  # the positions of the tokens fed from ``start`` to ``stop``; None: the cache's
                return None if positions is None else positions[..., start:stop]

            fed = 0  # positions used so far; resolved when traced: None and the lead's shape are the graph's key
            if lead is not None:
                fed = lead.shape[0]
                first, carry = draft_step(lead, carry, at(0, fed), *params)
            elif first is None:
                first = first_of(carry, *params)

            def feed(token, carry, i):
                return draft_step(token, carry, at(fed + i, fed + i + 1), *params)

            tokens, kept = chain_loop(first, carry, feed, steps, greedy_choice)
            if kept[0] is None:
                return (torch.cat(tokens),)
            return torch.cat(tokens), torch.stack(kept)

        return chain

    steps = _STEPS.setdefault(owner, {})
    if name not in steps:
        steps[name] = CompiledGraphs(make(), step.role, step.graphs.device, partner=step.graphs)
    return steps[name]


def compiled_forward(model: Any, role: str, layers: tuple[int, ...] = ()) -> CompiledStep:
    """The one compiled step of ``model``'s forward on text tokens in this process: embed, the language decoder,
    the LM head, as the model's own ``forward`` runs them without pixels. It returns the logits (B, n, V), the
    input embeddings and the features a draft head reads: the last hidden states (B, n, H), or the inputs of
    ``layers`` concatenated (B, n, len(layers)·H): ``hidden_states[k]``, which is layer k's input on text tokens, the
    only ones a compiled step feeds (Qwen3-VL adds DeepStack features to a layer's input at image slots only). A
    forward hook does not run inside a compiled graph. It holds the model's parts, not the model (the registry's key)."""

    def make() -> Callable:
        decoder, embed, lm_head = text_decoder(model), model.get_input_embeddings(), model.get_output_embeddings()

        def forward(input_ids, position_ids, attention_mask, cache):
            embeds = embed(input_ids)
            out = decoder(inputs_embeds=embeds, position_ids=position_ids, attention_mask=attention_mask,
                          **with_cache(cache), use_cache=True, output_hidden_states=bool(layers))
            features = torch.cat([out.hidden_states[k] for k in layers], dim=-1) if layers else out.last_hidden_state
            return lm_head(out.last_hidden_state), embeds, features

        return forward

    return shared_step(model, "forward" + "".join(f",{k}" for k in layers), make, role, model.device)
