"""Training an EAGLE-3 head (``mmspec train-head eagle3``): its data, its draft vocabulary and its training-time test.

**Data.** Per answered turn, the target runs as decoding fed it (:func:`.sequences.run_turn`); kept per position:
the inputs of the head's target layers concatenated, read by the same forward pre-hooks inference reads them with
(:func:`~mmspec_cli.decoding.features.tap_for`: a layer's input, which on Qwen3-VL holds the DeepStack visual features
added at image slots, unlike ``output_hidden_states``), the last hidden state after the final norm (the target's
logits are ``lm_head`` of it, computed when used) and the position ids.

**Draft vocabulary** (EAGLE's ``traineagle3/cnets.py``, SpecForge's ``preprocessing.py``): the ``--draft-vocab`` most
frequent tokens of the target's answers, ascending (:func:`~mmspec_cli.models.eagle3.draft_vocabulary`).

**Training-time test** (shared/notes §A5; EAGLE-3 §3). Entry p of step 0 is the pair (e_{p+1}, fc(layer inputs
at p)) at p's position. Step k ≥ 1 feeds, at every index p, the pair (e_{p+1+k}, h^{k−1}_p): the head's own output
at the same index one step before stands for the feature of token p + k, as drafting feeds a drafted token with its
parent's output; its positions are step 0's + k. Entry (k, p) attends to step 0's entries at indices ≤ p and to
steps 1 .. k at index p only (:func:`ttt_mask`): what the entry of the k-th drafted token after p sees at
inference. It is supervised with the target's distribution of token p + k + 2, softmax of the target's logits
restricted to the draft vocabulary, by soft cross-entropy, on answer tokens whose target argmax lies in the draft
vocabulary. Step k's loss, the mean over its scored entries, is weighted 0.8^k (EAGLE's ``main.py``; EAGLE's code
averages over every position, scored or not, which also weighs a step by its share of scored entries: fewer at later
steps, whose targets run past the answer's end), and a batch's loss is the mean over its sequences; the unroll is
``--mtp`` steps (7 by default for eagle3, EAGLE's and SpecForge's ``ttt_length``). No feature noise is added
(EAGLE-3's training adds none; eagle and vispec heads get a fixed ±10% of the features' RMS).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache

from mmspec_cli.decoding.features import position_ids, position_rows, tap_for
from mmspec_cli.models.eagle3 import Eagle3Head
from mmspec_cli.models.loading import LoadedModel
from mmspec_cli.training.answers import Answer
from mmspec_cli.training.losses import soft_cross_entropy
from mmspec_cli.training.passes import additive
from mmspec_cli.training.sequences import Turn, run_turn

DEFAULT_TTT_STEPS = 7  # EAGLE's self.length, SpecForge's --ttt-length
STEP_DECAY = 0.8  # step k's loss weight 0.8^k


@dataclass(frozen=True)
class Eagle3Sequence:
    """``ids`` = prompt + answer (``prompt_len`` prompt ids); per position the target's layer inputs ``features``
    (N, len(layers)·H), last hidden states ``hidden`` (N, H) and ``positions`` (N, R)."""

    ids: list[int]
    prompt_len: int
    features: torch.Tensor
    hidden: torch.Tensor
    positions: torch.Tensor

    @property
    def nbytes(self) -> int:
        return (self.features.numel() + self.hidden.numel()) * 4 + self.positions.numel() * 8


def eagle3_reader(layers: Sequence[int]):
    """A reader of :class:`Eagle3Sequence` reading the inputs of ``layers`` (for :class:`~.sequences.SequenceStore`)."""

    def read(target: LoadedModel, turn: Turn) -> Eagle3Sequence:
        fused, last = tap_for(target.model, tuple(layers)), tap_for(target.model)
        parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

        def keep(output, positions: torch.Tensor) -> None:
            parts.append((fused.take()[1], last.take()[1], position_rows(positions)))

        prompt = run_turn(target, turn, keep)
        features, hidden, positions = (torch.cat(part) for part in zip(*parts))
        return Eagle3Sequence(prompt.ids + list(turn.answer.answer_ids), len(prompt.ids), features.float().clone(),
                              hidden.float().clone(), positions.clone())

    return read


def answer_token_counts(answers: Sequence[Answer]) -> dict[int, int]:
    """How often each token id occurs in the target's answers (what the draft vocabulary is chosen from)."""
    counts: dict[int, int] = {}
    for answer in answers:
        for token in answer.answer_ids:
            counts[token] = counts.get(token, 0) + 1
    return counts


def ttt_mask(n: int, step: int, device=None) -> torch.Tensor:
    """Which keys the ``n`` entries of unroll step ``step`` attend to, (n, n·(step + 1)) bool: step 0's block
    causally (index ≤ p), and each block of steps 1 .. ``step`` on its diagonal (index p only)."""
    index = torch.arange(n, device=device)
    blocks = [index[None, :] <= index[:, None]] + [index[None, :] == index[:, None]] * step
    return torch.cat(blocks, dim=1)


class Eagle3Objective(nn.Module):
    """The training-time-test loss of ``head`` on a batch of :class:`Eagle3Sequence` (module doc)."""

    def __init__(self, head: Eagle3Head, lm_head: nn.Module, steps: int = DEFAULT_TTT_STEPS):
        super().__init__()
        self.head = head
        object.__setattr__(self, "lm_head", lm_head)  # the target's: frozen, not trained, not saved
        self.steps = steps

    def forward(self, batch: Sequence[Eagle3Sequence], generator: torch.Generator | None = None):
        """(loss, stats): Σ_k 0.8^k · (step k's loss), averaged over the batch; stats per step: loss, top-1
        agreement with the target (draft ids mapped to target ids), scored positions."""
        totals = [[0.0, 0.0, 0] for _ in range(self.steps)]
        loss = None
        for seq in batch:
            seq_loss = self._sequence(seq, totals)
            loss = seq_loss if loss is None else loss + seq_loss
        stats = [{"loss": lo / max(n, 1), "top1": hit / max(n, 1), "positions": n} for lo, hit, n in totals]
        return loss / len(batch), stats

    def _sequence(self, seq: Eagle3Sequence, totals: list[list]) -> torch.Tensor:
        head = self.head
        device, dtype = head.fc.weight.device, head.fc.weight.dtype
        n = len(seq.ids) - 1  # entries: pairs p = 0 .. N − 2
        with torch.no_grad():  # the target's distribution of token p + 2 at index p, over the draft vocabulary
            target_logits = self.lm_head(seq.hidden[1:].to(device, self.lm_head.weight.dtype)).to(dtype)  # (n, V)
            in_vocab = head.t2d[target_logits.argmax(-1)]
            target_draft = target_logits[:, head.target_ids]  # (n, D)
        total = torch.zeros((), device=device, dtype=dtype)
        index = torch.arange(n, device=device)
        for k, h in enumerate(unrolled(head, seq, self.steps)):
            total = total + 0.0 * h.sum()  # keeps the graph when nothing is scored (no answer token in the vocabulary)
            # entry p of step k predicts token p + k + 2: an answer token, known, its target argmax in the vocabulary
            scored = (index + k + 2 >= seq.prompt_len) & (index + k + 2 <= n)
            rows = torch.nonzero(scored).flatten()
            rows = rows[in_vocab[rows + k]]
            if not len(rows):
                continue
            draft = head.lm_head(head.norm(h[rows]))
            wanted = target_draft[rows + k]
            step_loss = soft_cross_entropy(draft, wanted)
            total = total + STEP_DECAY ** k * step_loss
            totals[k][0] += float(step_loss.detach()) * len(rows)
            totals[k][1] += float((draft.argmax(-1) == wanted.argmax(-1)).sum())
            totals[k][2] += len(rows)
        return total


def unrolled(head: Eagle3Head, seq: Eagle3Sequence, steps: int):
    """The head's outputs h^k (n, H) of unroll steps k = 0 .. ``steps`` − 1 over ``seq`` (module doc), one step at a
    time, through one cache that holds every step's keys."""
    device, dtype = head.fc.weight.device, head.fc.weight.dtype
    ids = torch.tensor(seq.ids, device=device)
    n = len(seq.ids) - 1
    positions = position_ids(seq.positions.to(device)[:n])  # (1, n) or M-RoPE's (3, 1, n)
    x = head.fc(seq.features[:n].to(device, dtype))  # step 0's hidden stream: the fused target features
    cache = DynamicCache(config=head.config)
    for k in range(steps):
        embeds = head.embed_tokens(ids[torch.clamp(torch.arange(n, device=device) + 1 + k, max=n)])  # e_{p+1+k}
        mask = additive(ttt_mask(n, k, device)[None], dtype)
        x = head.body(torch.cat([embeds, x], dim=-1)[None], positions + k, mask, cache)[0]
        yield x
