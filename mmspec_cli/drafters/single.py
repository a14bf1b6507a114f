"""Drafting with one draft model over one view of the prompt: ``m`` and ``t``.

``m`` (multimodal, TABED §4): the draft sees the images through its own vision tower and
projector, and the same text. ``t`` (text-only, Gagrani et al.; TABED App. I.2): the draft
sees the text with each image replaced by one newline token, and no pixels.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from mmspec_cli.decoding.chain import DraftStep, draft_chain
from mmspec_cli.decoding.compiled import compiled_chain
from mmspec_cli.decoding.drafter import Draft, Drafter, DrafterTraits, DraftShape, Kept, TreeDraft, TurnStart
from mmspec_cli.decoding.kv import CachedModel
from mmspec_cli.decoding.sampling import TokenPicker
from mmspec_cli.drafters.tree_drafting import TreeDrafts, TreeStep
from mmspec_cli.models.loading import LoadedModel
from mmspec_cli.models.parts import text_decoder, with_cache
from mmspec_cli.models.prompts import ModelPrompt, process, text_only_ids

PromptView = Callable[[str, Sequence[Any]], ModelPrompt]


def fit_vocab(logits: torch.Tensor, size: int) -> torch.Tensor:
    """Make draft logits (..., V_d) cover the target's V ids: pad with -inf or cut the padding rows."""
    have = logits.shape[-1]
    if have == size:
        return logits
    if have > size:
        return logits[..., :size]
    pad = logits.new_full((*logits.shape[:-1], size - have), float("-inf"))
    return torch.cat([logits, pad], dim=-1)


def multimodal_view(draft: LoadedModel) -> PromptView:
    return lambda text, images: process(draft.processor, text, images)


def text_only_view(target: LoadedModel) -> PromptView:
    """The target's text in the target's ids, each image one newline token: what a draft reads (a language-only
    draft reads target ids through its table, :mod:`~mmspec_cli.models.vocabulary`)."""
    def view(text: str, images: Sequence[Any]) -> ModelPrompt:
        return ModelPrompt(ids=text_only_ids(target.tokenizer, text, target.image_placeholder_ids, len(images)))

    return view


def proposal(logits: torch.Tensor, picker: TokenPicker) -> torch.Tensor:
    """What a token is picked from (``tree_drafting``): the logits when greedy, their distribution when sampling."""
    return logits if picker.greedy else picker.distribution(logits)


def model_step(model: torch.nn.Module) -> Callable:
    """A draft model's draft step as a function of its parts, for the compiled chain
    (:func:`~mmspec_cli.decoding.compiled.compiled_chain`): feed tokens (n,) at ``position`` (1, n), or at the indices
    the cache writes them at when None, after the state in ``cache``, causally; the logits after the last over the
    target's ``vocab`` ids (:func:`fit_vocab`)."""
    decoder, embed, lm_head = text_decoder(model), model.get_input_embeddings(), model.get_output_embeddings()

    def step(tokens, carry, position, cache, vocab):
        hidden = decoder(inputs_embeds=embed(tokens[None]), position_ids=position, **with_cache(cache),
                         use_cache=True).last_hidden_state  # (1, n, H)
        return fit_vocab(lm_head(hidden)[0, -1], vocab), carry

    return step


class SingleModelDrafter(Drafter):
    """Autoregressive drafting with the draft model's KV cache over one prompt view.

    Its cache holds the prompt view, the verified tokens but the last, and what the block fed of its draft;
    ``roll_back`` rolls it back to the kept drafts, and the next block's catch-up feeds only the new verified tokens.
    """

    def __init__(self, name: str, draft: LoadedModel, view: PromptView, target_vocab: int):
        self.name = name
        self.view = view
        self.target_vocab = target_vocab
        self.traits = DrafterTraits(models=(draft.model,))
        self.cached = CachedModel(draft.model, role="draft", image_token_id=draft.image_token_id)
        self.step = DraftStep(self._feed, catch_up=self._feed_lead)
        self.trees = TreeDrafts(TreeStep(root=self._tree_root, level=self._tree_level, keep=self._keep_fed))
        self.prompt = ModelPrompt(ids=[])
        self.prompt_fed = False  # whether the turn's prompt view is in the cache (after its first block)
        self.base = 0  # the cache's length before the block's drafts
        self.graphs = None  # the compiled chain of its step (--compile)

    def begin_turn(self, turn: TurnStart) -> None:
        """The draft's state is of the target's kind (static and compiled when the target's is); its prompt view."""
        kv = turn.cached_target.kv
        if kv != self.cached.kv:
            model = self.cached.model
            self.cached = CachedModel(model, role="draft", image_token_id=self.cached.image_token_id, kv=kv)
            graphs = compiled_chain(model, "greedy chain", self.cached.compiled, lambda: model_step(model)) \
                if kv == "compiled" else None
            self.step = DraftStep(self._feed, compiled=self._compiled if graphs is not None else None,
                                  catch_up=self._feed_lead)
            self.graphs = graphs
        self.prompt = self.view(turn.text, turn.images)
        self.traits.prompt_views = [(self.cached.model, len(self.prompt.ids))]
        self.cached.reserve(len(self.prompt.ids) + turn.room)
        self.prompt_fed = False

    def _lacks(self, verified: Sequence[int]) -> list[int] | None:
        """The verified tokens the cache lacks, in a block after the turn's first (None before it)."""
        return list(verified[self.cached.length - len(self.prompt.ids):]) if self.prompt_fed else None

    def _catch_up(self, verified: Sequence[int]) -> torch.Tensor:
        """Feed the verified tokens the cache lacks; the logits after them (V,). The turn's first block feeds the
        prompt view (what an earlier turn left is kept); later ones only the tokens since the last block."""
        lacking = self._lacks(verified)
        if lacking is not None:
            logits, _ = self._feed_lead(lacking, None)
        else:
            logits = fit_vocab(self.cached.logits(self.prompt.ids + list(verified), 1, self.prompt.vision,
                                                  prompt_len=len(self.prompt.ids))[-1], self.target_vocab)
            self.prompt_fed = True
        self.base = self.cached.length
        return logits  # (V,)

    def _feed_lead(self, tokens: list[int], carry: None) -> tuple[torch.Tensor, None]:
        """Feed the verified tokens the cache lacks, in one forward; the logits after them (V,)."""
        return fit_vocab(self.cached.extend(tokens, 1)[-1], self.target_vocab), carry

    def _feed(self, token: int, carry: None, i: int) -> tuple[torch.Tensor, None]:
        return self._feed_lead([token], carry)

    def _compiled(self, first: torch.Tensor | None, lead: list[int] | None, carry: None,
                  steps: int) -> tuple[list[int], list] | None:
        tokens = self.cached.run_chain(self.graphs, first, lead, steps, self.target_vocab)
        return None if tokens is None else (tokens, [None] * steps)

    def propose(self, verified: Sequence[int], shape: DraftShape, picker: TokenPicker) -> Draft | TreeDraft:
        if shape.tree:
            return self.trees.draft(verified, shape, picker)
        lacking = self._lacks(verified)
        if lacking:  # the chain feeds them first (in its graph, compiled)
            self.base = self.cached.length + len(lacking)
            tokens, drawn_from = draft_chain(self.step, None, None, shape.length, picker, lead=lacking)
        else:
            tokens, drawn_from = draft_chain(self.step, self._catch_up(verified), None, shape.length, picker)
        return Draft(tokens=tokens, probs=None if picker.greedy else torch.stack(drawn_from))

    def roll_back(self, kept: Kept) -> None:
        """Keep the verified context and the kept drafts the block fed (a tree: its accepted path)."""
        if kept.nodes is not None:
            self.trees.keep_path(kept.nodes)
        else:
            self.cached.rollback(min(self.cached.length, self.base + kept.count))

    def _tree_root(self, verified: Sequence[int], picker: TokenPicker) -> torch.Tensor:
        return proposal(self._catch_up(verified), picker)  # (V,)

    def _tree_level(self, tokens: Sequence[int], parents: Sequence[int], picker: TokenPicker) -> torch.Tensor:
        """ONE forward of the level's nodes in the draft's cache, each seeing the prefix and its own branch."""
        return proposal(fit_vocab(self.cached.tree_logits(tokens, parents), self.target_vocab), picker)  # (n, V)

    def _keep_fed(self, fed: Sequence[int]) -> None:
        self.cached.keep_path(fed)
