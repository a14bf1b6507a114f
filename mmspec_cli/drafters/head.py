"""Drafting with a trained head that reads the target's own features: ``eagle`` (EAGLE-2's head), ``vispec``
(ViSpec: the same head plus a vision adaptor and a global image feature) and ``eagle3`` (EAGLE-3's head: the inputs
of three target layers fused, its own draft vocabulary, :mod:`mmspec_cli.models.eagle3`).

The head (:mod:`mmspec_cli.models.head`) keeps its own KV cache of the verified context, one entry
per pair (f_p, e_{p+1}) of the target's last hidden state and the next input embedding. Each block:

1. **Catch up.** The target's cache holds every verified token but the last, and its
   :class:`~mmspec_cli.decoding.features.FeatureTrack` the features of those positions, read by a
   forward hook during verification (the first block of a turn prefills the target first, as
   ``ssd`` does, so the prompt's features exist before the first draft). The pairs not yet in the
   head's cache are fed in ONE head forward; the last one's output h approximates the target's
   hidden state at the last verified token.
2. **Draft.** ``lm_head(h)`` (the TARGET's LM head; an EAGLE-3 head's own, over its draft vocabulary) proposes the
   next token x; the pair (h, e_x)
   is fed next, at the next position, and so on: a chain of γ, or a tree level by level
   (EAGLE-2's dynamic tree when ``--tree dynamic``), each node fed with its parent's h.
3. **Roll back** (``roll_back``). Every drafted entry is cropped again: the next catch-up feeds the
   accepted tokens with the target's true features instead.

A head is not an ensemble row: it is a different network over a different cache, fed by the
target's features, so ``tabed:mv`` is refused (:mod:`.registry`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from mmspec_cli.decoding.chain import DraftStep, draft_chain
from mmspec_cli.decoding.drafter import Draft, Drafter, DrafterTraits, DraftShape, Kept, TreeDraft, TurnStart
from mmspec_cli.decoding.features import position_ids
from mmspec_cli.decoding.inference import inference
from mmspec_cli.decoding.kv import CachedModel
from mmspec_cli.decoding.compiled import CompiledGraphs, CompiledStep, compiled_chain, shared_step
from mmspec_cli.decoding.kv_state import HeldState, KVState, StaticKV, static_pool
from mmspec_cli.decoding.sampling import TokenPicker
from mmspec_cli.decoding.tree import ROOT, PendingTree
from mmspec_cli.drafters.single import proposal
from mmspec_cli.drafters.tree_drafting import TreeDrafts, TreeStep
from mmspec_cli.models.eagle3 import Eagle3Head, full_vocabulary, layer_pass, own_pair
from mmspec_cli.models.head import DraftHead, causal_mask, fuse, head_sequence, image_runs, layer_step
from mmspec_cli.models.loading import LoadedModel, check_beside
from mmspec_cli.models.prompts import ModelPrompt


class HeadDrafter(Drafter):
    """``eagle`` / ``vispec`` / ``eagle3``: draft with ``head`` over the target's features (and the target's LM head,
    or an EAGLE-3 head's own)."""

    def __init__(self, target: LoadedModel, head: DraftHead | Eagle3Head):
        self.name = head.kind
        self.traits = DrafterTraits()  # its network is the head: no draft model, nothing of the engine's to load
        self.target = target
        self.head = head
        self.lm_head = target.model.get_output_embeddings()
        check_beside(head, "draft head", self.lm_head, "LM head", "load_head")
        self.eagle3 = isinstance(head, Eagle3Head)  # reads layer inputs, runs at the target's positions
        self._logits = head_logits(head, self.lm_head)  # a head's outputs -> logits over the target's vocabulary
        self.device = head.fc.weight.device
        self.cached_target: CachedModel | None = None
        self.prompt = ModelPrompt(ids=[])
        self.prompt_fed = False
        self.kv = "dynamic"  # the target's kind (begin_turn): static and compiled when the target's is
        self.compiled: CompiledStep | None = None
        self.chain: CompiledGraphs | None = None  # a greedy chain's γ steps in one graph (head_step)
        self.step = DraftStep(self._feed, first_of=self._logits)
        # a tree's nodes leave the head's cache when it is drafted: nothing to keep after verification
        self.trees = TreeDrafts(TreeStep(root=self._tree_root, level=self._tree_level, keep=lambda fed: None,
                                         done=self._tree_done))
        self.base = 0  # entries before the block's drafts
        self.image_runs: list[tuple[int, int]] = []  # the prompt's image runs (models.head.image_runs), per turn
        self.rope_rows = 1  # rows of the positions an EAGLE-3 head runs at: the target's (3 for M-RoPE)
        # the head's KV state; its length counts entries, not positions (compressed image tokens replace images)
        self.holding = HeldState(head.config, None, "draft head")
        self._reset_head()

    @property
    def state(self) -> KVState:
        """The head's KV state (:class:`~mmspec_cli.decoding.kv_state.HeldState`'s)."""
        return self.holding.state

    def _reset_head(self) -> None:
        self.holding.use(None if self.kv == "dynamic" else static_pool(self.head, "head"))
        self.holding.restart(1)
        self.pairs_done = 0  # pairs (f_p, e_{p+1}) fed so far: p < pairs_done
        self.glob: torch.Tensor | None = None  # the latest image's global feature g (vispec)
        self.last_h: torch.Tensor | None = None  # the head's output at the last fed pair

    @property
    def entries(self) -> int:
        """Entries in the head's cache."""
        return self.state.length

    @property
    def cache(self):
        return self.state.cache

    def begin_turn(self, turn: TurnStart) -> None:
        """Read the target's features from now on; the head's state is of the target's kind (static and compiled
        when the target's is); the prompt, which the first block's catch-up feeds whole."""
        self.cached_target = turn.cached_target
        self.cached_target.track_features(self.head.layers_read if self.eagle3 else ())
        if turn.cached_target.kv != self.kv:
            self.kv = turn.cached_target.kv
            self.compiled = compiled_head_step(self.head, self.device) if self.kv == "compiled" else None
            self.chain = head_chain(self.head, self.compiled) if self.kv == "compiled" else None
            self.step = DraftStep(self._feed, first_of=self._logits,
                                  compiled=self._compiled if self.chain is not None else None)
            self._reset_head()
        self.prompt = turn.prompt
        self.image_runs = image_runs(self.prompt.ids, self.target.image_token_id, len(self.prompt.ids))
        self.prompt_fed = False
        self._claim(len(self.prompt.ids) + turn.room)

    def _claim(self, room: int = 0) -> None:
        """At a turn's start: a static state another owner filled since is started over (the catch-up feeds every
        pair again), with room for ``room`` entries. In a block, the state must still be this drafter's
        (``HeldState.in_block``)."""
        if self.prompt_fed:
            self.holding.in_block(self.entries + 1)
        elif not self.holding.at_turn_start(max(self.entries + 1, room)):
            self._reset_head()

    # ------------------------------------------------------------------ the verified context

    @inference
    def _catch_up(self, generated: Sequence[int]) -> int:
        """Feed the head every verified pair it lacks; returns the position of the last verified token."""
        if self.cached_target is None:
            raise RuntimeError("HeadDrafter needs begin_turn before propose")
        self._claim()
        held = len(self.prompt.ids) + len(generated) - 1
        if not self.prompt_fed:  # a new turn: the target holds the prompt, and the head reads all of it again
            self.cached_target.hold(self.prompt.ids + list(generated[:-1]) if generated else self.prompt.ids[:-1],
                                    vision=self.prompt.vision, prompt_len=min(len(self.prompt.ids), held))
            self._reset_head()
            self.prompt_fed = True
        elif self.cached_target.length != held:
            raise RuntimeError(f"the target holds {self.cached_target.length} positions, {held} expected")
        track = self.cached_target.features
        if len(track) != held:
            raise RuntimeError(f"the target's features cover {len(track)} positions, {held} expected")
        first = self.pairs_done  # only the rows not fed yet are copied: the track grows with the turn
        if self.eagle3:  # e_p: the head's embedding of the token ids (a placeholder's at image slots)
            ids = self._verified_ids(first, generated)
            embeds = self.head.embed_tokens(torch.tensor(ids, device=self.device))
        else:  # e_p: the target's input embeddings (projector outputs at image slots), then the last token's
            last_token = generated[-1] if generated else self.prompt.ids[-1]
            last = self.head.embed_tokens(torch.tensor([last_token], device=self.device))  # (1, H)
            embeds = torch.cat([self._here(track.embeds[first:]), last])
        seq = head_sequence(self.head, range(held + 1), self._here(track.hidden[first:]), embeds, first,
                            self.target.image_token_id, len(self.prompt.ids), self.glob, offset=first,
                            runs=self.image_runs)  # range: only the length is read, the runs are the turn's
        if len(seq.positions):
            positions = (position_ids(track.positions[first:held].to(self.device)) if self.eagle3
                         else torch.tensor([seq.positions], device=self.device))
            out = self._forward(seq.inputs, positions)
            self.last_h = out[-1]
        self.pairs_done, self.glob = held, seq.glob
        self.base = self.entries
        if self.eagle3:  # drafts run at the last verified token's position + 1, and on (vLLM's proposer alike)
            self.rope_rows = track.positions.shape[-1]
            return int(track.positions[held - 1, 0]) + 1 if held else 0
        return held

    def _verified_ids(self, start: int, generated: Sequence[int]) -> list[int]:
        """The verified token ids from index ``start`` on (the prompt's, then the turn's generated ones)."""
        prompt = self.prompt.ids
        return list(prompt[start:]) + list(generated[max(0, start - len(prompt)):])

    def _draft_positions(self, start: torch.Tensor | int, count: int | None = None) -> torch.Tensor:
        """Positions of drafted entries: ``start`` .. ``start + count − 1`` (or the (1, n) ``start`` given), every
        M-RoPE row alike (text after the prompt), as the target's positions ids are shaped."""
        positions = start if count is None else torch.arange(start, start + count, device=self.device)[None]
        return positions if self.rope_rows == 1 else positions[None].expand(self.rope_rows, *positions.shape)

    def _here(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.to(device=self.device, dtype=self.head.fc.weight.dtype)

    def _forward(self, inputs: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """(n, H) layer inputs -> (n, H) outputs, appended to the head's cache. ``mask`` None: each new entry sees
        every entry before it and the new ones up to itself, which a compiled step over an allocated state computes
        inside its graph from the write pointer (:func:`entries_mask`), an eager one over a static state or of
        several entries is given, and one entry over a dynamic cache (an eager chain's step) needs none."""
        state = self.state
        if mask is None and self.compiled is not None and state.allocated:
            compiled = self.compiled(state, inputs[None], positions, None)
            if compiled is not None:
                return compiled[0][0]
        if mask is None and (inputs.shape[0] > 1 or isinstance(state, StaticKV)):
            mask = causal_mask(inputs.shape[0], self.entries, inputs.dtype, self.device)
        if mask is not None:  # else one entry over a dynamic cache, which sees every key there is: no mask
            mask = state.fit_mask(mask)
        compiled = self.compiled(state, inputs[None], positions, mask) if self.compiled is not None else None
        if compiled is not None:
            return compiled[0][0]
        state.room_for(inputs.shape[0])
        out = self.head.body(inputs[None], positions, mask, state.cache)[0]
        state.wrote(inputs.shape[0])
        return out

    def _fuse(self, tokens: Sequence[int], parents_h: torch.Tensor) -> torch.Tensor:
        """Layer inputs of drafted tokens, each fed with its parent's output as its feature: (n, H), or an EAGLE-3
        head's pairs (n, 2H)."""
        embeds = self.head.embed_tokens(torch.tensor(list(tokens), device=self.device))
        return self.head.feed_own(embeds, parents_h, None if self.glob is None else self.glob[None])

    # ------------------------------------------------------------------ chains

    @inference
    def propose(self, verified: Sequence[int], shape: DraftShape, picker: TokenPicker) -> Draft | TreeDraft:
        if shape.tree:
            return self.trees.draft(verified, shape, picker)
        self._position = self._catch_up(verified)  # the last verified token's position: drafts follow it
        tokens, drawn_from = draft_chain(self.step, None, self.last_h, shape.length, picker)  # first: the LM head's
        return Draft(tokens=tokens, probs=None if picker.greedy else torch.stack(drawn_from))

    def roll_back(self, kept: Kept) -> None:
        """Every drafted entry goes (a tree's went already): the next catch-up feeds the kept tokens with the target's
        own features."""
        self.state.rollback(self.base)

    def _feed(self, token: int, h: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The eager draft step: the pair (h, e_token) at the next position, seeing every entry before it."""
        h = self._forward(self._fuse([token], h[None]), self._draft_positions(self._position + i, 1))[-1]
        return self._logits(h), h

    def _compiled(self, first: torch.Tensor | None, lead: None, h: torch.Tensor,
                  steps: int) -> tuple[list[int], list] | None:
        """A greedy chain in ONE compiled graph of :func:`chain_step`, its first proposal (the LM head over ``h``)
        included, or None when it can't (the head's cache not allocated yet, or compiling failed; the chain then
        runs eagerly)."""
        state, lm_head = self.state, self.lm_head
        if not state.allocated:
            return None
        fed = steps - 1
        state.room_for(fed)
        positions = self._draft_positions(self._position, fed)
        out = self.chain(first, None, h[None], positions, steps, *chain_params(self.head, lm_head, self.glob),
                         state.cache)
        if out is None:
            state.rollback(state.length)
            return None
        state.wrote(fed)  # the graph moved the write pointers itself; accept rolls them back
        return out[0].tolist(), [None] * steps

    # ------------------------------------------------------------------ trees (tree_drafting)

    @inference
    def _tree_root(self, verified: Sequence[int], picker: TokenPicker) -> torch.Tensor:
        position = self._catch_up(verified)
        self._tree = PendingTree(base=self.entries)
        self._shift = position - self.entries  # a node's position: the last verified token's + its depth
        self._outputs: list[torch.Tensor] = []
        return proposal(self._logits(self.last_h), picker)  # (V,)

    @inference
    def _tree_level(self, tokens: Sequence[int], parents: Sequence[int], picker: TokenPicker) -> torch.Tensor:
        """ONE head forward of the level's nodes, each fed with its parent's output and seeing its own branch."""
        parents_h = torch.stack([self.last_h if p == ROOT else self._outputs[p] for p in parents])  # (n, H)
        nodes = self._tree.add(tokens, parents)
        mask, positions = self._tree.inputs(nodes, parents_h.dtype, self.device)  # (1, 1, n, seen), (1, n)
        out = self._forward(self._fuse(tokens, parents_h), self._draft_positions(positions + self._shift), mask)
        self._outputs.extend(out)
        return proposal(self._logits(out), picker)  # (n, V)

    def _tree_done(self) -> None:
        self._tree.drop(self.state)
        self._outputs = []


def head_logits(head: DraftHead | Eagle3Head, lm_head: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """What turns ``head``'s outputs into logits over the target's vocabulary: the target's ``lm_head`` (EAGLE-2,
    ViSpec), or an EAGLE-3 head's own over its draft vocabulary, scattered into the target's."""
    if isinstance(head, Eagle3Head):
        return head.logits
    return lambda hidden: lm_head(hidden.to(lm_head.weight.dtype))


def compiled_head_step(head: DraftHead | Eagle3Head, device: torch.device) -> CompiledStep:
    """The one compiled step of ``head``'s layer in this process (``inputs, positions, mask, cache`` -> its outputs):
    what a head drafts with under ``--compile``, and what ``profile-latency --compile`` times. ``mask`` None: the
    entries are causal after the cache's written ones (:func:`entries_mask`, made inside the graph: a catch-up's
    and a chain step's case); a tree level passes its own."""
    if isinstance(head, Eagle3Head):
        midlayer, rotary = head.midlayer, head.rotary  # its parts: the registry's key stays collectable
        return shared_step(head, "body", lambda: lambda inputs, positions, mask, cache: (
            layer_pass(midlayer, rotary, inputs, positions, own_mask(mask, cache, inputs), cache),), "head", device)
    layer, rotary = head.layers[0], head.rotary
    return shared_step(head, "body", lambda: lambda inputs, positions, mask, cache: (
        layer_step(layer, rotary, inputs, positions, own_mask(mask, cache, inputs), cache),), "head", device)


def own_mask(mask: torch.Tensor | None, cache, inputs: torch.Tensor) -> torch.Tensor:
    """``mask``, or where it is None the causal mask of the (1, n, ...) ``inputs`` written after ``cache``'s entries."""
    return entries_mask(cache, inputs.shape[1], inputs.dtype) if mask is None else mask


def head_chain(head: DraftHead | Eagle3Head, step: CompiledStep) -> CompiledGraphs:
    """``head``'s one compiled greedy chain (:func:`~mmspec_cli.decoding.compiled.compiled_chain` over
    :func:`chain_step`), which also makes the chain's first proposal from the head's last output when called with
    ``first`` None (:func:`chain_first`): what the drafter runs, and what ``profile-latency --compile`` times."""
    return compiled_chain(head, "greedy chain", step, lambda: chain_step(head), lambda: chain_first(head))


def chain_step(head: DraftHead | Eagle3Head) -> Callable:
    """The draft step of ``head``'s compiled chain: :func:`head_step`, or :func:`eagle3_step`."""
    return eagle3_step(head) if isinstance(head, Eagle3Head) else head_step(head)


def chain_first(head: DraftHead | Eagle3Head) -> Callable:
    """The first proposal of ``head``'s compiled chain from its carried output h (1, H), with the step's parameters
    (:func:`chain_params`, then the cache), of which it reads the LM head's only: the logits its draft step makes of
    each later output."""
    if isinstance(head, Eagle3Head):
        propose = eagle3_proposal(head)
        return lambda h, *_: propose(h)
    return lambda h, lm_weight, lm_bias, *_: lm_head_proposal(h, lm_weight, lm_bias)


def lm_head_proposal(h: torch.Tensor, lm_weight: torch.Tensor, lm_bias: torch.Tensor | None) -> torch.Tensor:
    """An EAGLE-2 / ViSpec head's proposal: the target's LM head (``lm_weight``, ``lm_bias``) over the output h."""
    return torch.nn.functional.linear(h.to(lm_weight.dtype), lm_weight, lm_bias)


def eagle3_proposal(head: Eagle3Head) -> Callable[[torch.Tensor], torch.Tensor]:
    """An EAGLE-3 head's proposal of its output h: its own logits over the target's vocabulary
    (:meth:`~mmspec_cli.models.eagle3.Eagle3Head.logits`, as a function of its parts for a graph)."""
    norm, lm_head = head.norm, head.lm_head
    target_ids, vocab_size = head.target_ids, head.config.vocab_size
    whole = head.whole_vocabulary  # decided here, not in the graph: a data-dependent branch would break it

    def propose(h):
        draft = lm_head(norm(h))
        return draft if whole else full_vocabulary(draft, target_ids, vocab_size)

    return propose


def chain_params(head: DraftHead | Eagle3Head, lm_head: torch.nn.Module, glob: torch.Tensor | None) -> tuple:
    """What :func:`chain_step`'s step reads besides the token, its carry, its position and the cache: the target's LM
    head and ViSpec's global image feature ``glob`` (H,) for :func:`head_step`; nothing for an EAGLE-3 head, whose
    LM head is its own."""
    if isinstance(head, Eagle3Head):
        return ()
    return lm_head.weight, lm_head.bias, None if glob is None else glob[None]


def entries_mask(cache, new: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask (1, 1, new, capacity) of ``new`` entries written into a head's static cache from its write
    pointer on: entry i sees every written slot and the new ones up to itself (slots up to the pointer + i), nothing
    after; what :func:`~mmspec_cli.models.head.causal_mask` makes, widened to the capacity
    (:meth:`~mmspec_cli.decoding.kv_state.KVState.fit_mask`), from the pointer, so that a graph makes it itself."""
    written = cache.layers[0]
    device = written.cumulative_length.device
    slots = torch.arange(written.max_cache_len, device=device)
    own = written.cumulative_length + torch.arange(new, device=device)  # the slot each new entry is written to
    unwritten = slots[None, :] > own[:, None]
    return torch.zeros(unwritten.shape, dtype=dtype, device=device).masked_fill(unwritten, torch.finfo(dtype).min)[
        None, None]


def head_step(head: DraftHead) -> Callable:
    """A head's draft step as one function of its parts, for the compiled chain
    (:func:`~mmspec_cli.decoding.compiled.compiled_chain`): the pair (h, e_token) of the carried output h and the
    chosen token (1,) is fed at ``position`` into the head's static cache, seeing every entry before it (the mask
    the eager step builds, from the cache's write pointer); its output is the next h, and ``lm_head`` of it (the
    target's: ``lm_weight``, ``lm_bias``) the next proposal. Step by step, each draft token costs an embedding,
    ``fc``, the layer's graph, the LM head and an argmax, each a call of its own; in the chain's graph a block's
    chain is one call (docs/BENCHMARKS.md, "Compiled decoding")."""
    embed, fc, img_fc = head.embed_tokens, head.fc, head.img_fc if head.sees_images else None
    layer, rotary = head.layers[0], head.rotary

    def step(token, h, position, lm_weight, lm_bias, glob, cache):
        inputs = fuse(fc, img_fc, embed(token), h, glob)  # (1, H)
        h = layer_step(layer, rotary, inputs[None], position, entries_mask(cache, 1, h.dtype), cache)[0]
        return lm_head_proposal(h, lm_weight, lm_bias), h

    return step


def eagle3_step(head: Eagle3Head) -> Callable:
    """An EAGLE-3 head's draft step for the compiled chain, as :func:`head_step`: the pair ``cat(e_token, h)`` at
    ``position``; the next proposal is the head's own logits over the target's vocabulary
    (:meth:`~mmspec_cli.models.eagle3.Eagle3Head.logits`)."""
    embed, midlayer, rotary = head.embed_tokens, head.midlayer, head.rotary
    propose = eagle3_proposal(head)

    def step(token, h, position, cache):
        inputs = own_pair(embed(token), h)  # (1, 2H)
        h = layer_pass(midlayer, rotary, inputs[None], position, entries_mask(cache, 1, h.dtype), cache)[0]
        return propose(h), h

    return step
