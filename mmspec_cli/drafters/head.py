"""Drafting with a trained head that reads the target's own features: ``eagle`` (EAGLE-2's head) and
``vispec`` (ViSpec: the same head plus a vision adaptor and a global image feature).

The head (:mod:`mmspec_cli.models.head`) keeps its own KV cache of the verified context, one entry
per pair (f_p, e_{p+1}) of the target's last hidden state and the next input embedding. Each block:

1. **Catch up.** The target's cache holds every verified token but the last, and its
   :class:`~mmspec_cli.decoding.features.FeatureTrack` the features of those positions, read by a
   forward hook during verification (the first block of a turn prefills the target first, as
   ``ssd`` does, so the prompt's features exist before the first draft). The pairs not yet in the
   head's cache are fed in ONE head forward; the last one's output h approximates the target's
   hidden state at the last verified token.
2. **Draft.** ``lm_head(h)`` (the TARGET's LM head) proposes the next token x; the pair (h, e_x)
   is fed next, at the next position, and so on: a chain of γ, or a tree level by level
   (EAGLE-2's dynamic tree when ``--tree dynamic``), each node fed with its parent's h.
3. **Roll back.** Every drafted entry is cropped again: the next catch-up feeds the accepted
   tokens with the target's true features instead.

A head is not an ensemble row: it is a different network over a different cache, fed by the
target's features, so ``tabed:mv`` is refused (:mod:`.registry`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from mmspec_cli.decoding.drafter import Draft, Drafter
from mmspec_cli.decoding.kv import CachedModel
from mmspec_cli.decoding.compiled import CompiledGraphs, CompiledStep, shared_chain, shared_step, static_pool
from mmspec_cli.decoding.kv_state import DynamicKV
from mmspec_cli.decoding.sampling import TokenPicker
from mmspec_cli.decoding.tree import ROOT, PendingTree
from mmspec_cli.drafters.single import proposal
from mmspec_cli.drafters.tree_drafting import TreeDrafting
from mmspec_cli.models.head import DraftHead, causal_mask, fuse, head_sequence, layer_step
from mmspec_cli.models.loading import LoadedModel
from mmspec_cli.models.prompts import ModelPrompt, process


class HeadDrafter(TreeDrafting, Drafter):
    """``eagle`` / ``vispec``: draft with ``head`` over the target's features and its LM head."""

    def __init__(self, target: LoadedModel, head: DraftHead):
        self.name = head.kind
        self.target = target
        self.head = head
        self.lm_head = target.model.get_output_embeddings()
        self.device = head.fc.weight.device
        self.runner: CachedModel | None = None
        self.prompt = ModelPrompt(ids=[])
        self.prefilled = False
        self.kv = "dynamic"  # the target's kind (bind_target): static and compiled when the target's is
        self.compiled: CompiledStep | None = None
        self.chain: CompiledGraphs | None = None  # a greedy chain's γ steps in one graph (greedy_chain)
        self._reset_head()

    def _reset_head(self) -> None:
        # the head's KV state; its length counts entries, not positions (compressed image tokens replace images)
        if self.kv == "dynamic":
            self.state = DynamicKV(config=self.head.config)
        else:
            self.state = static_pool(self.head, "head").claim(self, 1)[0]
            self.state.reset()
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

    def bind_target(self, runner: CachedModel) -> None:
        self.runner = runner
        runner.track_features()
        if runner.kv != self.kv:
            self.kv = runner.kv
            self.compiled = compiled_head_step(self.head, self.device) if self.kv == "compiled" else None
            self.chain = shared_chain(self.head, "greedy chain", self.compiled, lambda: greedy_chain(self.head)) \
                if self.kv == "compiled" else None
            self._reset_head()

    def reserve(self, after_prompt: int) -> None:
        if self.kv != "dynamic":
            self._claim()
            static_pool(self.head, "head").claim(self, len(self.prompt.ids) + after_prompt)

    def _claim(self) -> None:
        """A static state another head drafter filled since is started over: the catch-up feeds every pair again."""
        if self.kv != "dynamic":
            self.state, mine = static_pool(self.head, "head").claim(self, self.entries + 1)
            if not mine:
                self._reset_head()

    def begin_turn(self, prompt_text: str, images: Sequence[Any]) -> None:
        self.prompt = process(self.target.processor, prompt_text, images)
        self.prefilled = False

    # ------------------------------------------------------------------ the verified context

    @torch.inference_mode()
    def _catch_up(self, generated: Sequence[int]) -> list[int]:
        """Feed the head every verified pair it lacks; returns the verified ids."""
        if self.runner is None:
            raise RuntimeError("HeadDrafter needs bind_target(runner) before propose")
        self._claim()
        verified = self.prompt.ids + list(generated)
        held = len(verified) - 1
        self.runner.hold(verified[:held], vision=self.prompt.vision, prompt_len=min(len(self.prompt.ids), held))
        if not self.prefilled:  # a new turn: the head reads the whole prompt again
            self._reset_head()
            self.prefilled = True
        track = self.runner.features
        if len(track) != held:
            raise RuntimeError(f"the target's features cover {len(track)} positions, {held} expected")
        first = self.pairs_done  # only the rows not fed yet are copied: the track grows with the turn
        last = self.head.embed_tokens(torch.tensor([verified[-1]], device=self.device))  # (1, H)
        embeds = torch.cat([self._here(track.embeds[first:]), last])  # e_p from p = first; projector outputs at slots
        seq = head_sequence(self.head, verified, self._here(track.hidden[first:]), embeds, first,
                            self.target.image_token_id, len(self.prompt.ids), self.glob, offset=first)
        if len(seq.positions):
            out = self._forward(seq.inputs, torch.tensor([seq.positions], device=self.device),
                                causal_mask(len(seq.positions), self.entries, seq.inputs.dtype, self.device))
            self.last_h = out[-1]
        self.pairs_done, self.glob = held, seq.glob
        return verified

    def _here(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.to(device=self.device, dtype=self.head.fc.weight.dtype)

    def _forward(self, inputs: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(n, H) layer inputs -> (n, H) outputs, appended to the head's cache."""
        state = self.state
        mask = state.fit_mask(mask)
        compiled = self.compiled(state, inputs[None], positions, mask) if self.compiled is not None else None
        if compiled is not None:
            return compiled[0][0]
        state.room_for(inputs.shape[0])
        out = self.head.body(inputs[None], positions, mask, state.cache)[0]
        state.wrote(inputs.shape[0])
        return out

    def _fuse(self, tokens: Sequence[int], parents_h: torch.Tensor) -> torch.Tensor:
        """Layer inputs (n, H) of drafted tokens, each fed with its parent's output as its feature."""
        embeds = self.head.embed_tokens(torch.tensor(list(tokens), device=self.device))
        return self.head.fuse(embeds, parents_h, None if self.glob is None else self.glob[None])

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden.to(self.lm_head.weight.dtype))

    # ------------------------------------------------------------------ chains

    @torch.inference_mode()
    def propose(self, generated: Sequence[int], gamma: int, picker: TokenPicker) -> Draft:
        verified = self._catch_up(generated)
        base, position = self.entries, len(verified) - 1
        if self.chain is not None and picker.greedy:
            tokens = self._compiled_chain(gamma, position)
            if tokens is not None:
                return Draft(tokens=tokens, probs=None)
        h = self.last_h
        tokens: list[int] = []
        dists: list[torch.Tensor] = []
        for step in range(gamma):
            token, probs = picker.choose(self._logits(h))
            tokens.append(token)
            if probs is not None:
                dists.append(probs)
            if step == gamma - 1:
                break
            seen = base + step
            h = self._forward(self._fuse([token], h[None]), torch.tensor([[position + step]], device=self.device),
                              causal_mask(1, seen, h.dtype, self.device))[-1]
        self.state.rollback(base)  # drafted entries go: the next catch-up feeds the target's features
        return Draft(tokens=tokens, probs=torch.stack(dists) if dists else None)

    def _compiled_chain(self, gamma: int, position: int) -> list[int] | None:
        """A greedy chain of ``gamma`` tokens in ONE compiled graph (:func:`greedy_chain`), or None when it can't (the
        head's cache not allocated yet, or compiling failed; the caller drafts step by step)."""
        state, lm_head = self.state, self.lm_head
        if not state.allocated:
            return None
        base = state.length
        state.room_for(gamma)
        positions = torch.arange(position, position + gamma - 1, device=self.device)[None]
        glob = None if self.glob is None else self.glob[None]
        key = ("chain", gamma, glob is None, state.capacity, self.last_h.dtype, lm_head.bias is None)
        out = self.chain(key, self.last_h[None], glob, positions, lm_head.weight, lm_head.bias, state.cache, gamma)
        state.rollback(base)  # the graph wrote γ − 1 entries: they go, as in the step-by-step chain
        return None if out is None else out[0].tolist()

    # ------------------------------------------------------------------ trees (tree_drafting)

    @torch.inference_mode()
    def tree_root(self, generated: Sequence[int], picker: TokenPicker) -> torch.Tensor:
        verified = self._catch_up(generated)
        self._tree = PendingTree(base=self.entries)
        self._shift = len(verified) - 1 - self.entries  # a node's position: the last verified token's + its depth
        self._outputs: list[torch.Tensor] = []
        return proposal(self._logits(self.last_h), picker)  # (V,)

    @torch.inference_mode()
    def tree_level(self, tokens: Sequence[int], parents: Sequence[int], picker: TokenPicker) -> torch.Tensor:
        """ONE head forward of the level's nodes, each fed with its parent's output and seeing its own branch."""
        parents_h = torch.stack([self.last_h if p == ROOT else self._outputs[p] for p in parents])  # (n, H)
        nodes = self._tree.add(tokens, parents)
        mask, positions = self._tree.inputs(nodes, parents_h.dtype, self.device)  # (1, 1, n, seen), (1, n)
        out = self._forward(self._fuse(tokens, parents_h), positions + self._shift, mask)  # (n, H)
        self._outputs.extend(out)
        return proposal(self._logits(out), picker)  # (n, V)

    def tree_done(self) -> None:
        self._tree.drop(self.state)
        self._outputs = []


def compiled_head_step(head: DraftHead, device: torch.device) -> CompiledStep:
    """The one compiled step of ``head``'s layer in this process (``inputs, positions, mask, cache`` -> its outputs):
    what a head drafts with under ``--compile``, and what ``profile-latency --compile`` times."""
    layer, rotary = head.layers[0], head.rotary  # its parts: the registry's key stays collectable
    return shared_step(head, "body", lambda: lambda inputs, positions, mask, cache: (
        layer_step(layer, rotary, inputs, positions, mask, cache),), "head", device)


def greedy_chain(head: DraftHead) -> Callable:
    """The step-by-step greedy chain of :meth:`HeadDrafter.propose` as one function of the head's parts, for one
    compiled graph per chain length (``steps``): ``lm_head(h)``'s argmax is the next token; the pair (h, e_token)
    is fed at the next position into the head's static cache, seeing every entry before it (the mask the eager
    chain builds, from the cache's write pointer), and its output is the next h. Step by step, each draft token
    costs an embedding, ``fc``, the layer's graph, the LM head and an argmax, each a call of its own; here a
    block's chain is one call (docs/BENCHMARKS.md, "Compiled decoding")."""
    embed, fc, img_fc = head.embed_tokens, head.fc, head.img_fc if head.sees_images else None
    layer, rotary = head.layers[0], head.rotary

    def chain(h, glob, positions, lm_weight, lm_bias, cache, steps):
        tokens = []
        for step in range(steps):
            token = torch.nn.functional.linear(h.to(lm_weight.dtype), lm_weight, lm_bias).argmax(-1)  # (1,)
            tokens.append(token)
            if step == steps - 1:
                break
            written = cache.layers[0]
            unwritten = torch.arange(written.max_cache_len, device=h.device) > written.cumulative_length
            mask = torch.zeros(unwritten.shape, dtype=h.dtype, device=h.device)
            mask = mask.masked_fill(unwritten, torch.finfo(h.dtype).min)
            inputs = fuse(fc, img_fc, embed(token), h, glob)  # (1, H)
            h = layer_step(layer, rotary, inputs[None], positions[:, step:step + 1], mask[None, None, None], cache)[0]
        return (torch.cat(tokens),)

    return chain
