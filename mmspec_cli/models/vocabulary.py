"""A draft's token ids against the target's: one table from target ids to the draft's, checked once at load.

Speculative decoding compares token ids, so a draft must share the target's tokenizer. A language-only draft (Gagrani
et al.: Qwen2.5-0.5B-Instruct for Qwen2.5-VL, a Vicuna for LLaVA-1.5) shares its *ordinary* tokens and differs in the
special ones: LLaVA's ``<image>`` and ``<pad>`` (32000, 32001) are not in Vicuna's tokenizer; Qwen's vision markers
are in Qwen2.5's. Embedding matrices also differ in their padding rows (Qwen2.5-VL-7B has 152,064, the 3B and
Qwen2.5-0.5B 151,936), and a target trained by someone else may emit any of its rows.

:func:`match_vocabularies` builds ``to_draft``: for every row of the target's embedding, the draft id of the same
token, or -1 where the draft has no such token. It refuses in one line a draft whose ordinary tokens sit at other ids
than the target's (another tokenizer altogether). Special tokens at other ids are mapped through the table.

:func:`speak_target_ids` then makes the draft model read and write target ids, through the hooks transformers gives a
model for its embeddings (``set_input_embeddings``/``set_output_embeddings``), and only where the table is not the
identity:

- its input embedding looks each target id up in the table first; a target id the draft lacks is fed as the draft's
  ``unk`` token (its newline token when it has none);
- its LM head's logits are gathered into the target's id order when some token sits at another id, with -inf for the
  target ids the draft lacks (where ids agree, :func:`~mmspec_cli.drafters.single.fit_vocab` already pads or cuts).

Everything that feeds the draft (the plain cache, batched rows, compiled chains, trees) then runs unchanged. What the
draft proposes can only change how much is accepted, never the output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mmspec_cli.errors import ModelLoadError

NO_TOKEN = -1  # in ``to_draft``: the draft has no token for this target id


@dataclass(frozen=True)
class VocabularyMatch:
    """How a draft's ids relate to the target's.

    ``to_draft`` (target rows,): the draft id of each target id, ``NO_TOKEN`` where the draft lacks it;
    ``draft_rows``: the draft's embedding rows; ``substitute``: the draft id fed for a target id it lacks;
    ``moved``: how many tokens sit at another id in the draft; ``lacking``: how many of the target tokenizer's
    tokens the draft has not."""

    to_draft: torch.Tensor
    draft_rows: int
    substitute: int
    moved: int
    lacking: int

    @property
    def reads_other_ids(self) -> bool:
        """Whether some target id must be looked up before the draft's embedding reads it."""
        rows = torch.arange(len(self.to_draft))
        return bool((self.to_draft != rows).any())

    @property
    def writes_other_ids(self) -> bool:
        """Whether the draft's logits must be reordered into target ids (beyond padding or cutting rows)."""
        shared = min(len(self.to_draft), self.draft_rows)
        head = self.to_draft[:shared]
        return bool(((head != torch.arange(shared)) & (head != NO_TOKEN)).any())


def _added(tokenizer: Any) -> set[str]:
    """The tokens added on top of the tokenizer's base vocabulary (special tokens and the like)."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {str(token) for token in decoder.values()} | set(getattr(tokenizer, "all_special_tokens", []))


def match_vocabularies(target_tokenizer: Any, draft_tokenizer: Any, target_rows: int, draft_rows: int,
                       draft_name: str, substitute: int) -> VocabularyMatch:
    """The table from the target's ids to the draft's; a draft whose ordinary tokens are not at the target's ids is
    refused in one line (``draft_name`` names it). ``substitute``: the draft id fed for a target id it lacks."""
    target_vocab, draft_vocab = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    added = _added(target_tokenizer) | _added(draft_tokenizer)
    target_at = {i: s for s, i in target_vocab.items()}
    differing = [(i, s) for s, i in draft_vocab.items() if s not in added and target_at.get(i) != s]
    if differing:
        i, token = min(differing)
        there = target_at.get(i)
        said = "no token" if there is None else repr(there)
        raise ModelLoadError(
            f"draft.model: '{draft_name}' has another tokenizer than the target's: {len(differing)} of its "
            f"{len(draft_vocab)} ordinary tokens sit at other ids (id {i} is {token!r} in the draft, {said} in the "
            f"target); use a draft trained with the target's tokenizer (special tokens may differ)")
    to_draft = torch.full((target_rows,), NO_TOKEN, dtype=torch.long)
    named = torch.zeros(target_rows, dtype=torch.bool)
    moved = lacking = 0
    for token, i in target_vocab.items():
        if i >= target_rows:
            continue
        named[i] = True
        j = draft_vocab.get(token)
        if j is None or j >= draft_rows:
            lacking += 1
        else:
            to_draft[i] = j
            moved += j != i
    unnamed = (~named).nonzero().flatten()  # rows no token of the target's tokenizer names: padding rows
    to_draft[unnamed[unnamed < draft_rows]] = unnamed[unnamed < draft_rows]
    return VocabularyMatch(to_draft=to_draft, draft_rows=draft_rows, substitute=substitute, moved=moved,
                           lacking=lacking)


class TargetIdEmbedding(torch.nn.Module):
    """A draft's input embedding read with target ids: each is looked up in the table first (a target id the draft
    lacks becomes the substitute)."""

    def __init__(self, embedding: torch.nn.Module, match: VocabularyMatch):
        super().__init__()
        self.embedding = embedding
        table = match.to_draft.where(match.to_draft != NO_TOKEN, torch.tensor(match.substitute))
        self.register_buffer("draft_ids", table.to(embedding.weight.device), persistent=False)

    @property
    def weight(self) -> torch.Tensor:  # the draft's own rows, for code that reads the matrix (its dtype, device)
        return self.embedding.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embedding(self.draft_ids[ids])


class TargetIdLogits(torch.nn.Module):
    """A draft's LM head whose logits come out in target ids: the draft's logit of the same token, -inf where the
    draft has none."""

    def __init__(self, head: torch.nn.Module, match: VocabularyMatch):
        super().__init__()
        self.head = head
        never = head.weight.shape[0]  # the column appended after the head's own rows, -inf
        columns = match.to_draft.where(match.to_draft != NO_TOKEN, torch.tensor(never))
        self.register_buffer("columns", columns.to(head.weight.device), persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        return self.head.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.head(hidden)
        never = logits.new_full((*logits.shape[:-1], 1), float("-inf"))
        return torch.cat([logits, never], dim=-1).index_select(-1, self.columns)


def speak_target_ids(model: Any, match: VocabularyMatch) -> None:
    """Make ``model`` (the draft) read and write target ids, where the table says they differ. The wrappers expose
    the draft's own matrices as ``weight`` (its rows, dtype and device); transformers' ``tie_weights`` must not be
    called on a model that has them. A model that already reads target ids is left as it is."""
    if isinstance(model.get_input_embeddings(), TargetIdEmbedding) or \
            isinstance(model.get_output_embeddings(), TargetIdLogits):
        return
    if match.reads_other_ids:
        model.set_input_embeddings(TargetIdEmbedding(model.get_input_embeddings(), match))
    if match.writes_other_ids:
        model.set_output_embeddings(TargetIdLogits(model.get_output_embeddings(), match))
