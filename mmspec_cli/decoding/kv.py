"""A model together with its KV cache and the token ids that cache holds: :class:`CachedModel`.

Two ways in, one per moment of a turn:

- **At a turn's start** (the prompt, and a conversation's earlier turns): :meth:`CachedModel.logits` takes the
  whole token sequence, keeps the longest prefix its state holds already (a later turn reuses the turns
  before), and feeds only the rest at explicit positions (its family's: :mod:`mmspec_cli.models.families`).
  The whole prefix is never re-run, except when the new part contains image placeholders (their pixels
  must go through the vision tower with the full prompt). :meth:`hold` makes the state hold a sequence.
- **In a block**: lengths only. :meth:`extend` feeds tokens after what is held; :meth:`rollback` keeps the
  first ``length`` positions (the engine's visible step after verification; a drafter's in ``roll_back``). No
  prefix search: the block knows what the state holds.

Positions after a prompt fed with its images follow that prompt's rope offset (Qwen-VL's M-RoPE δ,
0 for LLaVA), computed from the prompt when it is fed and held with the ids it belongs to: a cached
model that drops those images (reset, or a prefix that cuts into them) drops the offset with them.

A static state is one per model, role and process (:func:`~mmspec_cli.decoding.kv_state.static_pool`). Decoders
take turns with it: at a turn's start a cached model that finds it used by another since feeds its prompt
again; in the middle of a turn that is an error (:data:`~mmspec_cli.decoding.kv_state.LOST_STATE`), never a silent
re-encoding. It holds its state as every owner does, as a :class:`~mmspec_cli.decoding.kv_state.HeldState`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from mmspec_cli.decoding.compiled import CompiledGraphs, CompiledStep, compiled_forward
from mmspec_cli.decoding.features import FeatureTrack
from mmspec_cli.decoding.inference import inference
from mmspec_cli.decoding.kv_state import HeldState, KVState, static_pool
from mmspec_cli.decoding.tree import PendingTree
from mmspec_cli.errors import MmspecError
from mmspec_cli.models.families import family_of
from mmspec_cli.models.parts import with_cache


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two id sequences.

    One extends the other in the common case (a C-speed list compare); after a rejected
    draft the first difference is near the end, so the search walks back from there.
    """
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    start, step = n, 16
    while start > 0:
        start = max(0, n - step)
        if a[:start] == b[:start]:
            break
        step *= 8
    while a[start] == b[start]:  # start < n, and a difference lies before n
        start += 1
    return start


def same_tensors(a: Mapping[str, torch.Tensor] | None, b: Mapping[str, torch.Tensor] | None) -> bool:
    """Whether two sets of image tensors are the same images (identity first, then values)."""
    a, b = a or {}, b or {}
    if a.keys() != b.keys():
        return False
    for key in a:
        x, y = a[key], b[key]
        if x is y:
            continue
        if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)) or x.shape != y.shape or not torch.equal(x, y):
            return False
    return True


#: How a cached model keeps its KV state: transformers' DynamicCache, a static preallocated one, or the
#: static one with the steps compiled (``decoding.compile``).
KV_KINDS = ("dynamic", "static", "compiled")


class CachedModel:
    """Runs ``model`` incrementally over growing (and rolled-back) token sequences, over one :class:`KVState`.

    ``kv``: ``dynamic`` (a ``DynamicCache``), ``static`` (the model's one preallocated state in this
    process, eager) or ``compiled`` (that state, with the short steps compiled: :mod:`.compiled`).
    """

    def __init__(self, model: torch.nn.Module, role: str, image_token_id: int | None, kv: str = "dynamic"):
        if kv not in KV_KINDS:
            raise ValueError(f"kv must be one of {KV_KINDS}, not {kv!r}")
        self.model = model
        self.role = role
        self.image_token_id = image_token_id
        self.device = model.device
        self.kv = kv
        self.family = family_of(model)
        self.positions = self.family.positions()  # after the held prompt: its rope offset (0 without images)
        self.images_end = 0  # one past the last image placeholder the state holds with its pixels
        self.images_count = 0  # how many images the state holds
        self.compiled: CompiledStep | None = compiled_forward(model, role) if kv == "compiled" else None
        self.holding = HeldState(model.config, None if kv == "dynamic" else static_pool(model, f"cached {role}"), role)
        self.ids: list[int] = []  # the token ids whose keys/values the state holds, in order
        self.vision: Mapping[str, torch.Tensor] = {}  # the image tensors behind the cached placeholders
        self.tree: PendingTree | None = None  # a token tree fed after ``ids`` and not settled yet
        self.features: FeatureTrack | None = None  # the model's own features at ``ids``, when a draft head reads them

    @property
    def state(self) -> KVState:
        """The KV state (:class:`~mmspec_cli.decoding.kv_state.HeldState`'s)."""
        return self.holding.state

    @property
    def cache(self):
        """The transformers ``Cache`` the state holds."""
        return self.state.cache

    @property
    def length(self) -> int:
        """Positions the state holds."""
        return len(self.ids)

    def _claim(self, room: int = 0) -> KVState:
        """At a turn's start: the state, ready to use, with room for ``room`` positions; a static one another owner
        filled since is emptied (the caller feeds what it needs again)."""
        if not self.holding.at_turn_start(max(len(self.ids) + 1, room)):
            self.state.reset()
            self._forget()
        return self.state

    def _still_held(self) -> KVState:
        """In a block: the state, which must still hold what this cached model fed (else one line:
        :data:`~mmspec_cli.decoding.kv_state.LOST_STATE`)."""
        return self.holding.in_block(len(self.ids) + 1)

    def reserve(self, positions: int) -> None:
        """Room for ``positions`` in a static state (allocated or grown now, not in the middle of a turn)."""
        self._claim(positions)  # a state another owner used is emptied for this one

    def track_features(self, layers: tuple[int, ...] = ()) -> FeatureTrack:
        """From now on keep the model's input embeddings and features of every cached position: its last hidden
        states, or the inputs of ``layers`` (an EAGLE-3 head's)."""
        if self.features is None or self.features.layers != tuple(layers):
            self.reset()  # what is cached already was fed without them
            self.features = FeatureTrack(self.model, tuple(layers))
            if self.kv == "compiled":
                self.compiled = compiled_forward(self.model, self.role, tuple(layers))
        return self.features

    def reset(self) -> None:
        self._claim()
        self.state.reset()
        self._forget()

    def _forget(self) -> None:
        self.ids = []
        self.vision = {}
        self.positions = self.family.positions()
        self.images_end = 0
        self.images_count = 0
        self.tree = None
        if self.features is not None:
            self.features.clear()

    def rollback(self, length: int) -> None:
        """Hold only the first ``length`` ids: the step after verification that drops a rejected draft's tail
        (self-speculative drafting then extends them again)."""
        if self.tree is None and length >= len(self.ids):  # nothing to drop (every draft accepted): no state to move
            return
        self._still_held()
        self._drop_tree()
        self._crop(length)
        del self.ids[length:]

    def _crop(self, length: int) -> None:
        self.state.rollback(length)
        if self.features is not None:
            self.features.crop(length)

    # ----------------------------------------------------------------- token trees (tree.PendingTree)

    def hold(self, ids: Sequence[int], vision: Mapping[str, torch.Tensor] | None = None,
             prompt_len: int | None = None) -> None:
        """Make the cache hold exactly ``ids``, feeding only what it lacks (nothing if it holds them already)."""
        self._claim()
        self._drop_tree()
        prompt_len = len(ids) if prompt_len is None else prompt_len
        images_end = _placeholders_end(ids[:prompt_len], self.image_token_id)
        held = common_prefix_length(self.ids, ids) == len(ids) and len(ids) >= max(1, self.images_end)
        if held and (not images_end or same_tensors(self.vision, vision)):
            self._crop(len(ids))
            self.ids = list(ids)
            return
        self.logits(ids, keep=1, vision=vision, prompt_len=prompt_len)

    @inference
    def tree_logits(self, tokens: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """Feed tree nodes after the held ids (``parents``: earlier node indices, -1 for the held ids);
        logits (n, V) of every node. Nodes fed by earlier calls stay visible to their descendants."""
        state = self._still_held()
        if self.tree is None:
            self.tree = PendingTree(base=len(self.ids))
        nodes = self.tree.add(tokens, parents)
        mask, positions = self.tree.inputs(nodes, self.model.dtype, self.device, positions=self.positions,
                                           width=state.mask_width(len(nodes)))  # (1, 1, n, W), (1, n)
        input_ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)  # (1, n)
        compiled = self.compiled(state, input_ids, positions, mask) if self.compiled is not None else None
        if compiled is not None:
            if self.features is not None:
                self.features.hold_tree_rows(compiled[1][0], compiled[2][0], positions)
            return compiled[0][0]  # (n, V)
        state.room_for(len(nodes))
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                         **with_cache(state.cache), use_cache=True, logits_to_keep=0)
        state.wrote(len(nodes))
        if self.features is not None:
            self.features.hold_tree(positions)
        return out.logits[0]  # (n, V)

    @inference
    def keep_path(self, nodes: Sequence[int]) -> None:
        """Settle the tree: keep the entries of ``nodes`` (one path from the tree's top) after the held ids."""
        if self.tree is not None:
            fed = [node for node in nodes if node < len(self.tree.parents)]
            self.ids = self.ids + self.tree.settle(self.state, nodes)  # the block that fed the tree holds the state
            self.tree = None
            if self.features is not None:
                self.features.settle_tree(fed)

    def _drop_tree(self) -> None:
        if self.tree is not None:
            self.tree.drop(self.state)
            self.tree = None
            if self.features is not None:
                self.features.drop_tree()

    @inference
    def logits(self, ids: Sequence[int], keep: int = 1, vision: Mapping[str, torch.Tensor] | None = None,
               prompt_len: int | None = None) -> torch.Tensor:
        """Logits (keep, V) for the last ``keep`` positions of ``ids``; the cache then holds all of ``ids``.

        ``vision`` holds the processor's image tensors for the image placeholders in the first
        ``prompt_len`` ids (default: all of ``ids``). Image ids after the prompt (drafted or
        generated) are ordinary tokens, as in transformers' own ``generate``. When the part to
        feed reaches back into the prompt's placeholders, the prompt is encoded again from the
        start with its pixels, never spliced. When a later turn brings new images after the held
        conversation (whose images are the first ones of ``vision``), only the new part is fed, with
        the new images' tensors and the positions the whole prompt gives it (:meth:`_images_after`).
        """
        self._claim()
        self._drop_tree()
        prompt_len = len(ids) if prompt_len is None else prompt_len
        images_end = _placeholders_end(ids[:prompt_len], self.image_token_id)
        reuse = min(common_prefix_length(self.ids, ids), len(ids) - keep)  # positions whose logits we need are fed
        added = None
        if reuse and images_end:
            if same_tensors(self.vision, vision):
                self.vision = dict(vision or {})  # the same images: identity checks succeed from now on
            else:
                added = self._images_after(ids, reuse, prompt_len, vision or {})
                if added is None:
                    reuse = 0  # same placeholder ids, other images: the cached image positions are stale
        if reuse < self.images_end or (reuse < images_end and added is None):  # images to feed, or held images cut into
            self.reset()
            segments = [(0, prompt_len, vision or {}, None), (prompt_len, len(ids), {}, None)]
        elif added is not None:  # a later turn's new images, after the held conversation
            self._crop(reuse)
            positions, offset = self.family.prompt_positions(self.model, ids[:prompt_len], vision, self.device)
            self.positions = self.family.positions(offset)
            segments = [(reuse, prompt_len, added, positions[..., reuse:prompt_len]), (prompt_len, len(ids), {}, None)]
        else:
            self._crop(reuse)
            segments = [(reuse, len(ids), {}, None)]
        parts = [self._forward(ids[start:stop], images, wanted=min(stop - start, max(0, keep - (len(ids) - stop))),
                               positions=positions)
                 for start, stop, images, positions in segments if stop > start]
        self.ids = list(ids)
        if images_end:
            self.vision = dict(vision or {})
            self.images_end, self.images_count = images_end, self.family.image_count(self.vision)
        return torch.cat([p for p in parts if p is not None])  # (keep, V)

    @inference
    def extend(self, tokens: Sequence[int], keep: int = 1) -> torch.Tensor:
        """In a block: feed ``tokens`` after the held ids; logits (keep, V) of the last ``keep`` of them."""
        self._still_held()
        self._drop_tree()
        logits = self._forward(tokens, {}, wanted=keep)
        self.ids.extend(tokens)
        return logits

    @inference
    def run_chain(self, graphs: CompiledGraphs, first: torch.Tensor | None, lead: list[int] | None, steps: int,
                  *params) -> list[int] | None:
        """In a block: a greedy chain of ``steps`` tokens in ONE compiled graph of ``graphs``
        (:func:`~mmspec_cli.decoding.compiled.compiled_chain`), from ``first``, the logits after the held ids, or
        from feeding ``lead`` (the verified tokens not held yet) first: the graph feeds the lead and every token
        but the last after the held ids, at the chain's positions, and moves the state's write pointers itself. The
        tokens; None (nothing fed) when it can't run now: a draft head's features kept, a tree pending, the state not
        allocated yet, or compiling failed (the caller runs the chain eagerly)."""
        state = self._still_held()
        if self.features is not None or self.tree is not None or not state.allocated:
            return None
        fed = steps - 1 + (0 if lead is None else len(lead))
        state.room_for(fed)
        positions = self._chain_positions(state.length, fed)  # (1, fed), (3, 1, fed) or None (the cache's)
        positions = None if positions is None else positions.contiguous()
        leading = None if lead is None else torch.tensor(lead, device=self.device)
        out = graphs(first, leading, None, positions, steps, state.cache, *params)
        if out is None:
            state.rollback(state.length)  # the pointers back where they were, whatever the failed call wrote
            return None
        tokens = out[0].tolist()
        state.wrote(fed)  # the graph moved the write pointers itself
        if lead is not None:
            self.ids.extend(lead)
        self.ids.extend(tokens[:-1])
        return tokens

    def _chain_positions(self, start: int, n: int) -> torch.Tensor | None:
        """The positions of ``n`` tokens fed after ``start`` held ones: (1, n), or M-RoPE's (3, 1, n). None for a
        compiled step's graph where the model computes the same from its cache's write pointer
        (:attr:`~mmspec_cli.models.positions.Positions.follows_cache`) and no draft head's features record them: the
        graph adds them itself, and the host makes one tensor fewer per forward (on this CPU a compiled block's wall
        time did not move; on a GPU a compiled block is host time). Eager, they are passed: the model would make the
        same tensor itself, in one op more."""
        if self.kv == "compiled" and self.positions.follows_cache and self.features is None:
            return None
        return self.positions.chain(start, n, self.device)

    def _images_after(self, ids: Sequence[int], reuse: int, prompt_len: int,
                      vision: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """The tensors of the images whose placeholders lie after the ``reuse`` held ids, when everything before
        is what the state holds: its images are the first ones of ``vision`` and no other placeholder comes
        before ``reuse``. None when that is not so, or the family can't cut its tensors per image."""
        held, total = self.images_count, self.family.image_count(vision)
        if reuse < self.images_end or total <= held or self.image_token_id in ids[self.images_end:reuse]:
            return None
        if held:
            mine = self.family.images_in(self.vision, 0, held, slice(0, 0))  # per-token tensors: the ids compared them
            theirs = self.family.images_in(vision, 0, held, slice(0, 0))
            if mine is None or theirs is None or not same_tensors(mine, theirs):
                return None
        return self.family.images_in(vision, held, total, slice(reuse, prompt_len))

    def _forward(self, ids: Sequence[int], images: Mapping[str, torch.Tensor], wanted: int,
                 positions: torch.Tensor | None = None) -> torch.Tensor | None:
        """Feed ``ids`` (with ``images`` for their placeholders) at the next positions, or at ``positions`` (a
        later turn's new images); logits of the last ``wanted`` positions."""
        state = self.state
        if positions is None and images:  # a whole prompt from position 0: its positions and its rope offset
            positions, offset = self.family.prompt_positions(self.model, ids, images, self.device)
            self.positions = self.family.positions(offset)
        elif positions is None:
            positions = self._chain_positions(state.length, len(ids))
        compiled = None
        if self.compiled is not None and not images:
            input_ids = torch.tensor([list(ids)], dtype=torch.long, device=self.device)  # (1, n)
            compiled = self.compiled(state, input_ids, positions, None)
        if compiled is not None:
            logits = compiled[0][0]  # (n, V); the embeddings and features only where a head reads them
            if self.features is not None:
                self.features.append_rows(compiled[1][0], compiled[2][0], positions)
        else:
            logits = self._eager(ids, images, positions, wanted)  # (max(wanted, 1), V)
            if self.features is not None:
                self.features.extend(positions)
        if not wanted:
            return None
        return logits if logits.shape[0] == wanted else logits[-wanted:]

    def _eager(self, ids: Sequence[int], images: Mapping[str, torch.Tensor], positions: torch.Tensor,
               wanted: int) -> torch.Tensor:
        state = self.state
        state.room_for(len(ids))
        input_ids = torch.tensor([list(ids)], dtype=torch.long, device=self.device)  # (1, n)
        try:
            out = self.model(
                input_ids=input_ids,
                position_ids=positions,
                **with_cache(state.cache),
                use_cache=True,
                logits_to_keep=max(wanted, 1),  # 0 would mean "all positions" to transformers
                **{k: to_model(v, self.model) for k, v in images.items()},
            )
        except torch.cuda.OutOfMemoryError as exc:
            raise MmspecError(
                f"CUDA ran out of memory in the {self.role} model; set {self.role}.quantization: 4bit "
                f"(or 8bit), a smaller dtype such as float16, or a shorter prompt"
            ) from exc
        state.wrote(len(ids))
        return out.logits[0]


def _placeholders_end(ids: Sequence[int], image_token_id: int | None) -> int:
    """One past the last image placeholder in ``ids`` (0 when there is none)."""
    if image_token_id is None or image_token_id not in ids:
        return 0
    return len(ids) - list(reversed(ids)).index(image_token_id)


def to_model(value: torch.Tensor, model: torch.nn.Module) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        return value
    if value.is_floating_point():
        return value.to(device=model.device, dtype=model.dtype)
    return value.to(model.device)
