"""Drafting with one draft model over one view of the prompt: ``m`` and ``t``.

``m`` (multimodal, TABED §4): the draft sees the images through its own vision tower and
projector, and the same text. ``t`` (text-only, Gagrani et al.; TABED App. I.2): the draft
sees the text with each image replaced by one newline token, and no pixels.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from mmspec_cli.models.loading import LoadedModel
from mmspec_cli.models.prompts import ModelPrompt, process, text_only_ids
from mmspec_cli.decoding.kv import CachedModel
from mmspec_cli.decoding.sampling import TokenPicker
from mmspec_cli.decoding.drafter import Draft, Drafter
from mmspec_cli.drafters.tree_drafting import TreeDrafting

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


def text_only_view(draft: LoadedModel) -> PromptView:
    def view(text: str, images: Sequence[Any]) -> ModelPrompt:
        return ModelPrompt(ids=text_only_ids(draft.tokenizer, text, draft.image_placeholder_ids, len(images)))

    return view


def proposal(logits: torch.Tensor, picker: TokenPicker) -> torch.Tensor:
    """What a token is picked from (``tree_drafting``): the logits when greedy, their distribution when sampling."""
    return logits if picker.greedy else picker.distribution(logits)


class SingleModelDrafter(TreeDrafting, Drafter):
    """Autoregressive drafting with the draft model's KV cache over one prompt view."""

    def __init__(self, name: str, draft: LoadedModel, view: PromptView, target_vocab: int):
        self.name = name
        self.view = view
        self.target_vocab = target_vocab
        self.runner = CachedModel(draft.model, role="draft", image_token_id=draft.image_token_id)
        self.prompt = ModelPrompt(ids=[])

    def models(self) -> list[Any]:
        return [self.runner.model]

    def begin_turn(self, prompt_text: str, images: Sequence[Any]) -> None:
        self.prompt = self.view(prompt_text, images)

    def prompt_lengths(self) -> list[tuple[Any, int]]:
        return [(self.runner.model, len(self.prompt.ids))]

    def bind_target(self, runner: CachedModel) -> None:
        """The draft's state is of the target's kind: static and compiled when the target's is."""
        if runner.kv != self.runner.kv:
            self.runner = CachedModel(self.runner.model, role="draft", image_token_id=self.runner.image_token_id,
                                      kv=runner.kv)

    def reserve(self, after_prompt: int) -> None:
        self.runner.reserve(len(self.prompt.ids) + after_prompt)

    def propose(self, generated: Sequence[int], gamma: int, picker: TokenPicker) -> Draft:
        ids = self.prompt.ids + list(generated)
        tokens: list[int] = []
        dists: list[torch.Tensor] = []
        while len(tokens) < gamma:
            if tokens and picker.greedy:  # compiled: the rest of a greedy chain in one graph
                more = self.runner.greedy_chain(tokens[-1], gamma - len(tokens), self.target_vocab)
                if more is not None:
                    tokens += more
                    break
            logits = self.runner.logits(ids, 1, self.prompt.vision, prompt_len=len(self.prompt.ids))[-1]
            logits = fit_vocab(logits, self.target_vocab)  # (V,)
            token, probs = picker.choose(logits)
            tokens.append(token)
            if probs is not None:
                dists.append(probs)
            ids.append(token)
        return Draft(tokens=tokens, probs=torch.stack(dists) if dists else None)

    def tree_root(self, generated: Sequence[int], picker: TokenPicker) -> torch.Tensor:
        ids = self.prompt.ids + list(generated)
        logits = self.runner.logits(ids, 1, self.prompt.vision, prompt_len=len(self.prompt.ids))[-1]
        return proposal(fit_vocab(logits, self.target_vocab), picker)  # (V,)

    def tree_level(self, tokens: Sequence[int], parents: Sequence[int], picker: TokenPicker) -> torch.Tensor:
        """ONE forward of the level's nodes in the draft's cache, each seeing the prefix and its own branch."""
        return proposal(fit_vocab(self.runner.tree_logits(tokens, parents), self.target_vocab), picker)  # (n, V)

    def keep_fed(self, fed: Sequence[int]) -> None:
        self.runner.keep_path(fed)
