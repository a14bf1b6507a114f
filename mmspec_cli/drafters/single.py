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
from mmspec_cli.drafters.base import Draft, Drafter, TreeDraft, first_tokens

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
        return ModelPrompt(ids=text_only_ids(draft.tokenizer, text, draft.image_token_id, len(images)))

    return view


class SingleModelDrafter(Drafter):
    """Autoregressive drafting with the draft model's KV cache over one prompt view."""

    def __init__(self, name: str, draft: LoadedModel, view: PromptView, target_vocab: int):
        self.name = name
        self.view = view
        self.target_vocab = target_vocab
        self.runner = CachedModel(draft.model, role="draft", image_token_id=draft.image_token_id)
        self.prompt = ModelPrompt(ids=[])
        self._tree_shape = (1, 0)  # (branches, tree steps fed) of the last tree block

    def models(self) -> list[Any]:
        return [self.runner.model]

    def begin_turn(self, prompt_text: str, images: Sequence[Any]) -> None:
        self.prompt = self.view(prompt_text, images)

    def propose(self, generated: Sequence[int], gamma: int, picker: TokenPicker) -> Draft:
        ids = self.prompt.ids + list(generated)
        tokens: list[int] = []
        dists: list[torch.Tensor] = []
        for _ in range(gamma):
            logits = self.runner.logits(ids, 1, self.prompt.vision, prompt_len=len(self.prompt.ids))[-1]
            logits = fit_vocab(logits, self.target_vocab)  # (V,)
            token, probs = picker.choose(logits)
            tokens.append(token)
            if probs is not None:
                dists.append(probs)
            ids.append(token)
        return Draft(tokens=tokens, probs=torch.stack(dists) if dists else None)

    def propose_tree(self, generated: Sequence[int], gamma: int, width: int, picker: TokenPicker) -> TreeDraft:
        """Branches as nodes of one token tree in the draft's cache: each step is ONE forward of all
        branches' newest tokens, each seeing the prefix and its own branch (``tree.py``)."""
        ids = self.prompt.ids + list(generated)
        root = fit_vocab(self.runner.logits(ids, 1, self.prompt.vision, prompt_len=len(self.prompt.ids))[-1],
                         self.target_vocab)  # (V,)
        q_root = None if picker.greedy else picker.distribution(root)
        firsts = first_tokens(root if q_root is None else q_root, width, picker)
        branches = [[token] for token in firsts]
        dists = [[q_root] for _ in firsts]
        parents = [-1] * len(firsts)
        for step in range(gamma - 1):
            logits = fit_vocab(self.runner.tree_logits([b[-1] for b in branches], parents), self.target_vocab)  # (d, V)
            for j, branch in enumerate(branches):
                token, probs = picker.choose(logits[j])
                branch.append(token)
                dists[j].append(probs)
            parents = [step * len(branches) + j for j in range(len(branches))]
        self._tree_shape = (len(branches), gamma - 1)
        probs = None if picker.greedy else torch.stack([torch.stack(d) for d in dists])  # (d, γ, V)
        return TreeDraft(branches=branches, probs=probs)

    def keep_branch(self, branch: int, accepted: int) -> None:
        """Keep the followed branch's accepted tokens in the draft cache (node s·d + j is token s+1 of branch j)."""
        width, fed = self._tree_shape
        self.runner.keep_path([s * width + branch for s in range(min(accepted, fed))])
