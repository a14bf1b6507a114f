"""Self-speculative drafting, ``ssd`` (FastVLM; Elhoushi et al.'s LayerSkip, Zhang et al.'s draft & verify).

The draft is the target itself, cut short: its first n decoder layers, then its final norm
and LM head. There is no second model: :func:`early_exit_decoder` builds a decoder module
whose embedding, first n layers, norm and rotary embedding ARE the target's modules (the
same parameters), on a config that says n layers. It is built with the model's own class
on the meta device and then given the target's children through ``nn.Module`` attribute
assignment; nothing in transformers is patched.

The KV cache, and what is reused:

- The draft reads the target's own KV cache for layers 0..n-1, in place: a transformers
  ``Cache`` whose layer objects are the first n layers of the target's cache. Keys and values
  of a token at layer i depend only on layers < i, so the target's entries for the verified
  context (the prompt with its image features, and every verified token) are exactly what
  the draft would compute. The draft therefore never prefills, never sees pixels, and holds
  no cache of its own.
- The entries the draft writes for the block's new tokens (the last verified token and
  d_1..d_{γ-1}) are cropped again after drafting, and the target's verification forward
  recomputes them. That is a choice: verification must run all L layers on those tokens in
  one standard forward, which cannot start at layer n with given hidden states without
  transformers internals; recomputing costs n/L of the layer work of one verification
  forward. It also keeps the target's cache made only by the target's own forward calls,
  so greedy output stays token-for-token the target's ``generate`` (a token run alone and
  the same token run in a batch of γ+1 can differ in the last bits).

``ssd`` cannot be an ensemble member (``tabed:ms``): ensemble members are rows of ONE batched
forward of the draft model, and ``ssd`` runs a different network (the target's layers, at the
target's width) over a different cache (the target's). Mixing it in would add a second,
sequential forward of n target layers per draft step and would need the draft model in
memory as well, which is what ``ssd`` exists to avoid.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch

from mmspec_cli.errors import InputError, ModelLoadError
from mmspec_cli.models.loading import LoadedModel, check_beside
from mmspec_cli.models.parts import text_decoder, with_cache
from mmspec_cli.models.positions import TEXT_POSITIONS
from mmspec_cli.models.prompts import ModelPrompt
from mmspec_cli.decoding.chain import DraftStep, draft_chain
from mmspec_cli.decoding.drafter import Draft, Drafter, DrafterTraits, DraftShape, TreeDraft, TurnStart
from mmspec_cli.decoding.compiled import CompiledStep, shared_step
from mmspec_cli.decoding.inference import inference
from mmspec_cli.decoding.kv import CachedModel
from mmspec_cli.decoding.kv_state import KVState
from mmspec_cli.decoding.sampling import TokenPicker
from mmspec_cli.decoding.tree import PendingTree
from mmspec_cli.drafters.single import proposal
from mmspec_cli.drafters.tree_drafting import TreeDrafts, TreeStep


def layer_count(model: Any) -> int:
    return len(text_decoder(model).layers)


def require_layer(layer: int | None) -> int:
    """``ssd.layer`` must be set; the message says how to choose it."""
    if layer is None:
        raise InputError("drafter 'ssd' needs ssd.layer (how many of the target's layers draft); run "
                         "`mmspec select-layer --profile P --write P2` to choose it, or pass --ssd-layer N")
    return layer


def check_layer(layer: int | None, total: int) -> int:
    """``ssd.layer`` must be set and in [1, L-1]; one line saying how to fix it otherwise."""
    layer = require_layer(layer)
    if not 1 <= layer <= total - 1:
        raise InputError(f"ssd.layer {layer} is outside [1, {total - 1}] (the target has {total} decoder layers); "
                         f"pick a layer in that range, e.g. with `mmspec select-layer`")
    return layer


def early_exit_decoder(model: Any, layers: int, imitation: torch.nn.Module | None = None) -> torch.nn.Module:
    """A decoder made of the target's embedding, first ``layers`` layers, final norm and rotary embedding.

    Shares every parameter with ``model``; its forward returns normed hidden states after layer ``layers``.
    With an ``imitation`` network (FastVLM's IN), the hidden state after layer ``layers`` goes through it
    before the final norm: the view's norm is ``Sequential(imitation, the target's norm)``.
    """
    decoder = text_decoder(model)
    config = copy.deepcopy(decoder.config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = list(config.layer_types)[:layers]
    with torch.device("meta"):
        view = type(decoder)(config)  # an empty shell: every child is replaced below
    for name, child in decoder.named_children():
        setattr(view, name, torch.nn.ModuleList(list(child)[:layers]) if name == "layers" else child)
    if imitation is not None:
        view.norm = torch.nn.Sequential(imitation, decoder.norm)
    leftovers = [n for n, t in [*view.named_parameters(), *view.named_buffers()] if t.is_meta]
    if leftovers:
        raise ModelLoadError(f"self-speculative drafting can't share {type(decoder).__name__}'s "
                             f"{leftovers[0]}; use another drafter")
    return view.eval()


def compiled_early_exit(model: Any, layer: int, imitation: torch.nn.Module | None, decoder: torch.nn.Module,
                        lm_head: torch.nn.Module) -> CompiledStep:
    """The one compiled early-exit step of ``model`` at ``layer`` (through ``imitation``) in this process, over the
    target's static state: ``decoder`` (:func:`early_exit_decoder`) and the target's ``lm_head`` on ``ids, positions, mask,
    cache``. What ``ssd`` drafts with under ``--compile``, and what ``profile-latency --compile`` times."""

    def make():
        def early_exit(ids, positions, mask, cache):
            hidden = decoder(input_ids=ids, **with_cache(cache), use_cache=True, position_ids=positions,
                             attention_mask=mask).last_hidden_state
            return (lm_head(hidden),)
        return early_exit

    name = f"ssd-{layer}-{id(imitation)}"  # one per layer and imitation network
    return shared_step(model, name, make, "ssd draft", model.device)


def early_exit_logits(decoder: torch.nn.Module, lm_head: torch.nn.Module, state: KVState, ids: torch.Tensor,
                      position_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """Logits (n, V) of ``ids`` (1, n) fed after ``state`` (a view of the target's first layers:
    :meth:`~mmspec_cli.decoding.kv_state.KVState.view`) through an :func:`early_exit_decoder` and the target's LM
    ``lm_head``, at ``position_ids`` (default: the chain after the state) with a tree's ``attention_mask`` if given:
    one draft step of ``ssd``, which ``profile-latency`` times."""
    if position_ids is None:
        position_ids = TEXT_POSITIONS.chain(state.length, ids.shape[1], ids.device)
    hidden = decoder(input_ids=ids, **with_cache(state.cache), use_cache=True, position_ids=position_ids,
                     attention_mask=attention_mask).last_hidden_state  # (1, n, H)
    state.wrote(ids.shape[1])
    return lm_head(hidden[0])  # (n, V)


class SelfSpeculativeDrafter(Drafter):
    """``ssd``: draft with the target's first ``layer`` layers, over the target's own KV cache; with an
    ``imitation`` network (FastVLM's IN) between that layer and the final norm when one is given."""

    def __init__(self, target: LoadedModel, layer: int, imitation: torch.nn.Module | None = None,
                 name: str = "ssd"):
        self.name = name
        self.traits = DrafterTraits()  # no model of its own: the target's first layers, over the target's cache
        self.target = target
        self.layer = check_layer(layer, layer_count(target.model))
        self.imitation = imitation
        self.lm_head = target.model.get_output_embeddings()
        if imitation is not None:
            check_beside(imitation, "imitation network", text_decoder(target.model).norm, "final norm",
                         "load_imitation")  # it feeds the final norm
        self.decoder = early_exit_decoder(target.model, self.layer, imitation)
        self.cached_target: CachedModel | None = None
        self.prompt = ModelPrompt(ids=[])
        self.prompt_fed = False  # whether the target holds the turn's prompt (after its first block)
        self.step = DraftStep(self._feed)
        # the tree is drafted in the target's cache and given back (done): nothing to keep after verification
        self.trees = TreeDrafts(TreeStep(root=self._tree_root, level=self._tree_level, keep=lambda fed: None,
                                         done=self._tree_done))
        self._view: KVState | None = None  # while a tree is drafted: the draft's view of the target's cache,
        self._context = 0  # the verified context it is cropped back to,
        self._tree: PendingTree | None = None  # and the tree's nodes in it
        self.compiled: CompiledStep | None = None

    def begin_turn(self, turn: TurnStart) -> None:
        self.cached_target = turn.cached_target
        self.compiled = None
        if turn.cached_target.kv == "compiled":  # the early exit's step, compiled over the target's static state
            self.compiled = compiled_early_exit(turn.cached_target.model, self.layer, self.imitation, self.decoder,
                                                self.lm_head)
        self.prompt = turn.prompt
        self.prompt_fed = False

    def _start(self, verified: Sequence[int]) -> tuple[int, KVState]:
        """The cached context's length (every verified token but the last, which the draft feeds first) and the
        draft's view of the target's cache. The turn's first block has the target hold the prompt first."""
        cached_target = self.cached_target
        if cached_target is None:
            raise RuntimeError("SelfSpeculativeDrafter needs begin_turn before propose")
        context = len(self.prompt.ids) + len(verified) - 1
        if not self.prompt_fed:
            ids = self.prompt.ids + list(verified)
            cached_target.hold(ids[:context], vision=self.prompt.vision, prompt_len=min(len(self.prompt.ids), context))
            self.prompt_fed = True
        elif cached_target.length != context:
            raise RuntimeError(f"the target holds {cached_target.length} positions, {context} expected")
        return context, cached_target.state.view(self.layer)

    def _last(self, verified: Sequence[int]) -> int:
        return verified[-1] if verified else self.prompt.ids[-1]

    def _logits(self, view: KVState, tokens: Sequence[int], **tree) -> torch.Tensor:
        """Logits (n, V) of the early exit for ``tokens`` fed after ``view`` (``tree``: mask and positions)."""
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.cached_target.device)  # (1, n)
        tree.setdefault("position_ids", self.cached_target.positions.chain(view.length, len(tokens), ids.device))
        if self.compiled is not None:
            compiled = self.compiled(view, ids, tree["position_ids"], tree.get("attention_mask"))
            if compiled is not None:
                return compiled[0][0]  # (n, V)
        view.room_for(len(tokens))
        return early_exit_logits(self.decoder, self.lm_head, view, ids, **tree)  # (n, V)

    @inference
    def propose(self, verified: Sequence[int], shape: DraftShape, picker: TokenPicker) -> Draft | TreeDraft:
        """A chain drafted in the view, given back before verification: layers 0..n-1 are rolled back to the verified
        context at once (verification recomputes the block and must find the pointers there), so ``roll_back`` has
        nothing to roll back."""
        if shape.tree:
            return self.trees.draft(verified, shape, picker)
        context, self._view = self._start(verified)
        first = self._logits(self._view, [self._last(verified)])[-1]
        tokens, drawn_from = draft_chain(self.step, first, None, shape.length, picker)
        self._view.rollback(context)  # layers 0..n-1 back to the verified context: verification recomputes the block
        return Draft(tokens=tokens, probs=None if picker.greedy else torch.stack(drawn_from))

    def _feed(self, token: int, carry: None, i: int) -> tuple[torch.Tensor, None]:
        return self._logits(self._view, [token])[-1], None

    @inference
    def _tree_root(self, verified: Sequence[int], picker: TokenPicker) -> torch.Tensor:
        self._context, self._view = self._start(verified)
        self._tree = PendingTree(base=self._context + 1)  # the tree hangs off the last verified token, fed here
        return proposal(self._logits(self._view, [self._last(verified)])[-1], picker)  # (V,)

    @inference
    def _tree_level(self, tokens: Sequence[int], parents: Sequence[int], picker: TokenPicker) -> torch.Tensor:
        """ONE forward of the level's nodes through the shared layers, each seeing the prefix and its own branch."""
        nodes = self._tree.add(tokens, parents)
        mask, positions = self._tree.inputs(nodes, self.decoder.dtype, self.cached_target.device,
                                            positions=self.cached_target.positions,
                                            width=self._view.mask_width(len(nodes)))  # (1, 1, n, W), (1, n)
        return proposal(self._logits(self._view, tokens, attention_mask=mask, position_ids=positions), picker)

    def _tree_done(self) -> None:
        self._view.rollback(self._context)  # as in propose: verification recomputes the block
