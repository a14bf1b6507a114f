"""One KV state: a transformers ``Cache`` and the number of positions it holds.

Every cache owner of the decoding loop holds one: the target's and a draft's
:class:`~mmspec_cli.decoding.kv.CachedModel`, the draft's batched rows, a draft head's cache, and ssd's
view of the target's first layers (:meth:`KVState.view`). Each of them moves its state in the same
four ways, and in no other:

- it feeds tokens, then says how many positions that forward added (:meth:`KVState.wrote`);
- it rolls back to a length (:meth:`KVState.rollback`), the step after verification that drops a
  rejected draft's tail;
- it keeps a token tree's accepted path (:meth:`KVState.keep`): the path's entries are copied to
  follow the prefix, then the state rolls back to the prefix plus the path;
- it starts over (:meth:`KVState.reset`).

Two kinds:

- :class:`DynamicKV` over transformers' ``DynamicCache``: it grows with every forward, and rolling
  back crops it (``Cache.crop``).
- :class:`StaticKV` over transformers' ``StaticCache``: keys and values are preallocated for
  ``capacity`` positions and written at each layer's position pointer (``cumulative_length``).
  Rolling back moves the pointers; the entries after them stay in memory, are hidden by the
  causal mask (a tree's mask hides them explicitly: :meth:`KVState.mask_width`) and are
  overwritten by the next forward. Nothing is ever cropped, so the tensors keep their address and
  a compiled forward (:mod:`.compiled`) reuses its graph. Padding a forward to a compiled size
  writes a few entries past the real ones; :meth:`wrote` puts the pointers back after the real
  ones.

Position ids are not the state's business: :mod:`mmspec_cli.models.positions` computes them from
the state's length, one function per model family.

**Who holds a state.** Every owner holds its state as a :class:`HeldState`: a dynamic state of its own, or
the one static state of a model and purpose in the process (:func:`static_pool`, a :class:`StaticPool`), which
decoders take turns with: claimed at a turn's start, and in a block still the owner's or one line
(:data:`LOST_STATE`), never a silent re-encoding.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import Cache, StaticLayer

from mmspec_cli.decoding.inference import inference
from mmspec_cli.errors import MmspecError

#: The most positions one compiled step feeds (its padding included: ``compiled.PADDED_SIZES``).
MAX_STEP = 64

#: The smallest capacity a static state is allocated with; it doubles when a turn needs more (each growth
#: reallocates it, and a compiled step compiles again for the new size, so growth is kept rare).
MIN_CAPACITY = 512


class KVState:
    """A cache and its length. Subclasses say how a rollback happens."""

    static = False

    def __init__(self, cache: Cache):
        self.cache = cache
        self.length = 0  # positions held (entries of a head's cache: its positions may differ)

    def mask_width(self, fed: int) -> int:
        """The key length a prepared 4-D mask must have for a forward feeding ``fed`` positions."""
        return self.length + fed

    def fit_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """A prepared additive mask (B, 1, n, length + n) widened to :meth:`mask_width` (the extra keys hidden)."""
        width = self.mask_width(mask.shape[2])
        if width == mask.shape[-1]:
            return mask
        hidden = torch.full((*mask.shape[:-1], width - mask.shape[-1]), torch.finfo(mask.dtype).min,
                            dtype=mask.dtype, device=mask.device)
        return torch.cat([mask, hidden], dim=-1)

    def wrote(self, fed: int, kept: int | None = None) -> None:
        """A forward fed ``fed`` positions after :attr:`length`; the first ``kept`` (default all) are real."""
        self.length += fed if kept is None else kept

    def rollback(self, length: int) -> None:
        """Hold only the first ``length`` positions."""
        raise NotImplementedError

    def room_for(self, fed: int) -> None:
        """Make room for ``fed`` more positions before a forward (a dynamic cache grows by itself)."""

    @property
    def allocated(self) -> bool:
        """Whether the cache's buffers exist (a dynamic cache makes them as it grows)."""
        return True

    @inference
    def keep(self, start: int, entries: Sequence[int]) -> None:
        """Hold positions [0, start) followed by ``entries`` (ascending, all >= start): a tree's accepted path."""
        entries = list(entries)
        if entries and entries != list(range(start, start + len(entries))):
            for layer in self.cache.layers:
                index = torch.tensor(entries, device=layer.keys.device)
                layer.keys[..., start:start + len(entries), :] = layer.keys.index_select(-2, index)
                layer.values[..., start:start + len(entries), :] = layer.values.index_select(-2, index)
        self.rollback(start + len(entries))

    def reset(self) -> None:
        self.rollback(0)

    def view(self, layers: int) -> "KVState":
        """A state over the first ``layers`` layer objects of this cache (writes through it land here)."""
        raise NotImplementedError


class DynamicKV(KVState):
    """A ``DynamicCache``: grows with every forward, cropped to roll back."""

    def __init__(self, config=None, cache: Cache | None = None):
        super().__init__(cache if cache is not None else DynamicCache(config=config))
        self.length = self.cache.get_seq_length()
        self.config = config

    def rollback(self, length: int) -> None:
        excess = self.cache.get_seq_length() - length
        if excess > 0:
            self.cache.crop(-excess)  # DynamicCache.crop takes a negative count
        self.length = min(self.length, length)

    def reset(self) -> None:
        if self.config is not None:
            self.cache = DynamicCache(config=self.config)
            self.length = 0
        else:
            self.rollback(0)

    def view(self, layers: int) -> "DynamicKV":
        state = DynamicKV(cache=Cache(layers=list(self.cache.layers[:layers])))
        state.length = self.length
        return state


class StaticKV(KVState):
    """A ``StaticCache`` of ``capacity`` positions, allocated once; rolling back moves the layers' pointers."""

    static = True

    def __init__(self, config, capacity: int, cache: Cache | None = None):
        super().__init__(cache if cache is not None else StaticCache(config=config, max_cache_len=capacity))
        self.config = config
        self.capacity = capacity
        self.parent: StaticKV | None = None  # set on a view: the state whose first layers it looks at
        self._views: dict[int, StaticKV] = {}
        self._pointers: torch.Tensor | None = None  # every layer's write pointer, one (L,) tensor (_share_pointers)

    @property
    def allocated(self) -> bool:
        """Whether every layer has allocated its buffers (at its first write); a compiled graph writes only into
        allocated ones (:class:`~mmspec_cli.decoding.compiled.CompiledStep`)."""
        return all(layer.is_initialized for layer in self.cache.layers)

    @staticmethod
    def supports(config) -> bool:
        """Whether every layer of ``config``'s decoder gets a plain static layer (sliding windows wrap around)."""
        probe = StaticCache(config=config, max_cache_len=1)
        return all(type(layer) is StaticLayer for layer in probe.layers)

    def mask_width(self, fed: int) -> int:
        self.room_for(max(fed, MAX_STEP))  # grown now, if at all: a compiled step's padding must not grow it later
        return self.capacity

    def wrote(self, fed: int, kept: int | None = None) -> None:
        super().wrote(fed, kept)
        if kept is not None and kept != fed:
            self._point(self.length)  # the padding's entries lie after the pointer now

    def rollback(self, length: int) -> None:
        self.length = min(self.length, length)
        self._point(self.length)

    @inference  # the pointers are inference tensors once a forward under inference mode made them
    def _point(self, length: int) -> None:
        pointers = self._pointers if self._pointers is not None else self._share_pointers()
        if pointers is not None:
            pointers.fill_(length)
            return
        for layer in self.cache.layers:
            if layer.is_initialized:
                layer.cumulative_length.fill_(length)

    def _share_pointers(self) -> torch.Tensor | None:
        """On the CPU, once every layer is allocated: make each layer's write pointer (``cumulative_length``, a 0-d
        tensor each layer moves in place) an element of ONE (L,) tensor, so that a rollback moves them all with one
        op instead of one per layer (a block's rollbacks were 8 of its 44 torch calls outside the forwards, for
        ``m`` compiled). The layers still move their own element (each marked as a static address, as the layer
        marked its own); nothing else of transformers changes. Not for a view (its layers are its owner's), nor on
        a GPU, where CUDA graphs replay over each input's address and views of one tensor as their inputs are
        untried (no GPU was lent to measure it): there each layer fills its own."""
        layers = self.cache.layers
        if self.parent is not None or not self.allocated or any(layer.keys.device.type != "cpu" for layer in layers):
            return None
        pointers = torch.stack([layer.cumulative_length for layer in layers])  # (L,)
        for i, layer in enumerate(layers):
            layer.cumulative_length = pointers[i]
            torch._dynamo.mark_static_address(layer.cumulative_length)  # as the layer marked its own
        self._pointers = pointers
        return pointers

    def room_for(self, fed: int) -> None:
        """Make room for ``fed`` more positions: grow (reallocate, copying what is held) when they don't fit."""
        if self.length + fed > self.capacity:  # checked before entering inference mode: a block calls this often
            self._grow(fed)

    @inference
    def _grow(self, fed: int) -> None:
        if self.parent is not None:  # a view grows its owner's state, then looks at the grown layers
            self.parent.room_for(self.length + fed - self.parent.length)
            self.cache = Cache(layers=list(self.parent.cache.layers[:len(self.cache.layers)]))
            self.capacity = self.parent.capacity
            self._point(self.length)
            return
        capacity = static_capacity(self.length + fed)
        grown = StaticCache(config=self.config, max_cache_len=capacity)
        for old, new in zip(self.cache.layers, grown.layers):
            if old.is_initialized:  # all of it: a view may hold entries past this state's length (ssd's drafts)
                new.lazy_initialization(old.keys[:, :, :1], old.values[:, :, :1])
                new.keys[:, :, :self.capacity] = old.keys
                new.values[:, :, :self.capacity] = old.values
        self.cache, self.capacity, self._pointers = grown, capacity, None
        self._point(self.length)

    def view(self, layers: int) -> "StaticKV":
        """The same view object while the cache is the same (a compiled step keeps its graph for it)."""
        state = self._views.get(layers)
        if state is None or state.cache.layers[0] is not self.cache.layers[0]:
            state = StaticKV(self.config, self.capacity, cache=Cache(layers=list(self.cache.layers[:layers])))
            state.parent = self
            self._views[layers] = state
        state.length = self.length
        return state


def static_capacity(needed: int) -> int:
    """The capacity a static state is allocated with for ``needed`` positions: the next power of two, at least
    :data:`MIN_CAPACITY`."""
    capacity = MIN_CAPACITY
    while capacity < needed:
        capacity *= 2
    return capacity


#: A static state taken by another decoder in the middle of a turn (two decoders' turns interleaved).
LOST_STATE = ("the {role} model's static KV state was used by another decoder in the middle of this turn; run one "
              "decoder's turn at a time (finish or close a stream before starting another over the same models)")


class StaticPool:
    """One static KV state of a model in this process, and the holder (a :class:`HeldState`, each owner's) that last
    filled it. It is taken two ways, both through :class:`HeldState`: :meth:`claim` at a turn's start (a holder that
    finds it used by another since feeds what it needs again), :meth:`hold` in a block (it must still be the
    holder's: :data:`LOST_STATE`)."""

    def __init__(self, config: Any):
        self.config = config
        self.state: StaticKV | None = None
        self._owner: weakref.ref | None = None  # weak: an owner holds its model, the pool's key

    def claim(self, owner: object, needed: int) -> tuple[StaticKV, bool]:
        """The state, holding at least ``needed`` positions' room; whether ``owner`` (a holder) still finds its own
        entries."""
        if self.state is None:
            self.state = StaticKV(self.config, static_capacity(needed))
        else:
            self.state.room_for(needed - self.state.length)
        mine = self._owner is not None and self._owner() is owner
        if not mine:
            self._owner = weakref.ref(owner)
        return self.state, mine

    def hold(self, owner: object, needed: int, role: str) -> StaticKV:
        """In a block: the state, which ``owner`` (the ``role`` model's) must still hold; one line if another decoder
        took it since (:data:`LOST_STATE`), never a silent re-encoding."""
        state, mine = self.claim(owner, needed)
        if not mine:
            raise MmspecError(LOST_STATE.format(role=role))
        return state


_POOLS: "weakref.WeakKeyDictionary[Any, dict[str, StaticPool]]" = weakref.WeakKeyDictionary()


def static_pool(module: Any, purpose: str = "cached") -> StaticPool:
    """The one :class:`StaticPool` of ``module`` (a model, or a draft head) for ``purpose`` in this process (a model's
    single cached sequence, or a batch of ``rows2``, ...: a static cache has a fixed batch)."""
    pools = _POOLS.setdefault(module, {})
    if purpose not in pools:
        pools[purpose] = StaticPool(module.config)
    return pools[purpose]


class HeldState:
    """A KV state as its owner holds it: the one type every owner in the decoding loop keeps its state in (a cached
    model, a batch of draft rows, a head drafter, a timing), and so the one way a static pool is claimed.

    Dynamic (``pool`` None): a :class:`~mmspec_cli.decoding.kv_state.DynamicKV` of the owner's own, which nothing
    else can take. Static: the state of ``pool`` (:func:`static_pool`: one per module and purpose in a process),
    which decoders take turns with. :meth:`at_turn_start` claims it and says whether the owner's entries are still
    in it (if not, the owner feeds what it needs again); :meth:`in_block` refuses a state another decoder took in
    the middle of a turn (:data:`LOST_STATE`), never re-encoding in silence. How many positions the state holds is
    its ``length``; what an owner keeps beside it (a cached model's ids, the rows' masks) is the owner's."""

    def __init__(self, config: Any, pool: StaticPool | None, role: str):
        self.config, self.role = config, role
        self.pool: StaticPool | None = None
        self.state: DynamicKV | StaticKV = DynamicKV(config=config)
        self.use(pool)

    @property
    def static(self) -> bool:
        return self.pool is not None

    def use(self, pool: StaticPool | None) -> None:
        """Hold ``pool``'s state from now on (None: a dynamic one of the owner's own); a new state holds nothing of
        the owner's, so the owner feeds it anew."""
        if pool is self.pool:
            return
        self.pool = pool
        self.state = DynamicKV(config=self.config) if pool is None else pool.claim(self, 1)[0]

    def at_turn_start(self, needed: int) -> bool:
        """At a turn's start: the state, with room for ``needed`` positions, is this owner's from now on; whether the
        owner's entries are still in it (a static state another owner filled since holds its entries instead)."""
        if self.pool is None:
            return True
        self.state, mine = self.pool.claim(self, needed)
        return mine

    def restart(self, needed: int) -> DynamicKV | StaticKV:
        """The state emptied for the owner to fill anew, claimed as at a turn's start with room for ``needed``
        positions (a prefill, a head started over, a timing)."""
        self.at_turn_start(needed)
        self.state.reset()
        return self.state

    def in_block(self, needed: int) -> DynamicKV | StaticKV:
        """In a block: the state, which must still be this owner's (:data:`LOST_STATE` if another decoder took it
        since), with room for ``needed`` positions."""
        if self.pool is not None:
            self.state = self.pool.hold(self, needed, self.role)
        return self.state
