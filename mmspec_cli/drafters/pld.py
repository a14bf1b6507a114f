"""``pld``: prompt-lookup decoding (Saxena 2023). No draft model: the draft is what followed an earlier occurrence of
the last n-gram of the sequence so far, the prompt as the target sees it plus the tokens verified in the turn.

The two implementations users know run one rule with different numbers:

- **Hugging Face** (``generate(..., prompt_lookup_num_tokens=K)``, ``PromptLookupCandidateGenerator``,
  transformers 5.24): n-gram sizes from ``min(max_matching_ngram_size, len - 1)`` down to 1, with
  ``max_matching_ngram_size`` 2 when unset; for the first size that matches, the FIRST (left-most) occurrence whose
  continuation is non-empty; it proposes up to K tokens after it (``prompt_lookup_num_tokens`` has no default: setting
  it turns prompt lookup on; the class's own default is 10, as in Saxena's reference code), cut before the first EOS.
- **vLLM** (``speculative_config={"method": "ngram", ...}``, ``ngram_proposer.py``, 0.33): the LONGEST suffix n-gram
  with a size in [``prompt_lookup_min``, ``prompt_lookup_max``], both 5 when unset (one set: the other copies it);
  among occurrences of that size, the EARLIEST; up to ``num_speculative_tokens`` tokens after it (required; the docs'
  example uses 5), no EOS cut.

Both take the largest matching size first and its earliest earlier occurrence, so :func:`lookup` is both, given the
sizes. mmspec uses **Hugging Face's** numbers, sizes 2 then 1 (:data:`MAX_NGRAM`, :data:`MIN_NGRAM`), and its EOS cut:
HF's prompt lookup is the peer ``bench`` and the benchmark tables put beside it, so the same inputs give the same
drafts, and a size-1 fallback still drafts on the short answers of a VLM, where vLLM's 5-grams rarely recur.
``PromptLookupDrafter(target, max_ngram=5, min_ngram=5)`` is vLLM's rule. The tokens proposed are the block's γ
(``--gamma`` and the schedule, ``DraftShape.length``), cut to what the match offers; ``--gamma 10`` is HF's class
default.

Choices the implementations leave open:

- The prompt searched is the target's own ids (``TurnStart.prompt``), image placeholders included, as
  HF's ``input_ids`` are. A continuation is cut before the first image placeholder id (the target's image token and
  its family's placeholder ids), as before an EOS: the target never emits one, and a placeholder fed without its
  image is a forward some families refuse. Cutting is lossless (only fewer tokens are proposed).
- Per block, the work is O(new tokens · max_ngram), not O(sequence): :class:`NgramIndex` maps each n-gram to its
  first start, built once per turn over the prompt and extended with each block's verified tokens. Drafted tokens
  never enter it, so there is nothing to roll back (``roll_back`` is the contract's no-op).
- Sampling: the proposal is a point mass, ``Draft.probs`` one-hot rows (q = 1 on the proposed token) over the target's
  vocabulary, so the standard rejection rule stays exact (accept with probability p(token)).
- Chains only: a lookup gives one continuation. Trees are refused before loading (``registry.check_chain_only``),
  and pld is never an ensemble member (members are rows of a draft model's batch; pld runs no model).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from mmspec_cli.decoding.drafter import EMPTY_DRAFT, Draft, Drafter, DrafterTraits, DraftShape, TurnStart
from mmspec_cli.decoding.engine import eos_ids
from mmspec_cli.decoding.sampling import TokenPicker
from mmspec_cli.errors import InputError
from mmspec_cli.models.loading import LoadedModel

#: The drafter's name (``--drafter pld``).
PLD = "pld"

#: Hugging Face's ``max_matching_ngram_size`` when unset: n-grams of 2 tokens are tried first, then 1.
MAX_NGRAM = 2
MIN_NGRAM = 1

NO_TREES = "the pld drafter drafts chains (a lookup copies one continuation); drop --tree and --tree-width"


def lookup(sequence: Sequence[int], length: int, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM) -> list[int]:
    """The rule, by brute force: for n from ``min(max_ngram, len - 1)`` down to ``min_ngram``, the last n tokens are
    searched left to right; the first occurrence with a token after it gives up to ``length`` tokens; none: []."""
    size = len(sequence)
    for n in range(min(max_ngram, size - 1), min_ngram - 1, -1):
        tail = list(sequence[size - n:])
        for start in range(size - n):  # start + n < size: a token follows
            if list(sequence[start:start + n]) == tail:
                return list(sequence[start + n:start + n + length])
    return []


class NgramIndex:
    """The sequence so far and, for each n-gram of ``min_ngram``..``max_ngram`` tokens, its first start: the same
    proposals as :func:`lookup`, in O(max_ngram) per appended token and per lookup."""

    def __init__(self, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram sizes {min_ngram}..{max_ngram}: need 1 <= min <= max")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.sequence: list[int] = []
        self.first: dict[tuple[int, ...], int] = {}  # n-gram -> its first start (tuples of each size share it)

    def extend(self, tokens: Iterable[int]) -> None:
        sequence, first = self.sequence, self.first
        for token in tokens:
            sequence.append(int(token))
            end = len(sequence)
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                first.setdefault(tuple(sequence[end - n:]), end - n)

    def lookup(self, length: int) -> list[int]:
        sequence, size = self.sequence, len(self.sequence)
        for n in range(min(self.max_ngram, size - 1), self.min_ngram - 1, -1):
            start = self.first.get(tuple(sequence[size - n:]))
            if start is not None and start + n < size:  # the tail's own window has nothing after it
                return sequence[start + n:start + n + length]
        return []


def cut_before(tokens: list[int], stops: set[int]) -> list[int]:
    """``tokens`` up to (not including) the first id in ``stops``."""
    for i, token in enumerate(tokens):
        if token in stops:
            return tokens[:i]
    return tokens


def point_mass(tokens: Sequence[int], vocab: int) -> torch.Tensor:
    """(γ, vocab) one-hot rows: the distribution a copied token was "drawn" from (q = 1 on it)."""
    probs = torch.zeros(len(tokens), vocab, dtype=torch.float64)  # verify's dtype: no conversion there
    probs[torch.arange(len(tokens)), torch.tensor(list(tokens), dtype=torch.long)] = 1.0
    return probs


class PromptLookupDrafter(Drafter):
    """Drafts by prompt lookup over the target's view of the prompt and the verified tokens (module doc)."""

    name = PLD

    def __init__(self, target: LoadedModel, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM):
        self.target = target
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.vocab = target.vocab_size
        placeholders = set(target.image_placeholder_ids) if target.image_token_id is not None else set()
        self.stops = eos_ids(target) | placeholders
        self.traits = DrafterTraits()
        self.index = NgramIndex(max_ngram, min_ngram)
        self.prompt_length = 0

    def begin_turn(self, turn: TurnStart) -> None:
        prompt = turn.prompt  # the target's own ids
        self.index = NgramIndex(self.max_ngram, self.min_ngram)
        self.index.extend(prompt.ids)
        self.prompt_length = len(prompt.ids)

    def propose(self, verified: Sequence[int], shape: DraftShape, picker: TokenPicker) -> Draft:
        if shape.tree:
            raise InputError(NO_TREES)
        self._catch_up(verified)
        tokens = cut_before(self.index.lookup(shape.length), self.stops)
        if not tokens:
            return EMPTY_DRAFT
        return Draft(tokens=tokens, probs=None if picker.greedy else point_mass(tokens, self.vocab))

    def _catch_up(self, verified: Sequence[int]) -> None:
        """Index the verified tokens not seen yet (a turn's tokens only grow; anything else starts the index over)."""
        seen = len(self.index.sequence) - self.prompt_length
        if seen > len(verified) or (seen and verified[seen - 1] != self.index.sequence[-1]):
            prompt = self.index.sequence[:self.prompt_length]
            self.index = NgramIndex(self.max_ngram, self.min_ngram)
            self.index.extend(prompt)
            seen = 0
        self.index.extend(verified[seen:])
