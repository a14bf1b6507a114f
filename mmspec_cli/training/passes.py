"""One training step's forward: the head over a batch of target sequences, in K multi-token passes.

**Layout.** Each sequence is laid out by :func:`~mmspec_cli.models.head.head_sequence`, the
function inference uses: entry i stands for pair p = (f_p, e_{p+1}) and its output h_p, through the
target's LM head, predicts token p+2, so it is compared with the target's logits at p+1,
``lm_head(f_{p+1})``. Only entries that predict an answer token are scored: P − 2 ≤ p ≤ N − 3 for a
prompt of P ids and a sequence of N (the last answer token's successor is not known).

**Noise.** The target's features f_p get uniform noise first (:func:`.losses.uniform_noise`).

**Passes ("training-time test", EAGLE-3; ViSpec trains with multi-token prediction).** Pass 0 is
plain teacher forcing on the (noisy) target features. Pass k replaces the feature of each text
pair p by the head's own pass-(k − 1) output at pair p − 1 (the same tokens), exactly as drafting
feeds a drafted token with its parent's output. Its attention context is what drafting sees at
depth k + 1: the pass-0 entries of pairs ≤ p − k (the verified context, computed from the target's
features) and the entries of passes 1 .. k − 1 at pairs p − k + 1 .. p − 1 (the draft's own earlier
steps), through one KV cache that holds every pass. Pass k's loss teaches the head to draft the
(k + 1)-th token of a block. Every pass is weighted equally.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache

from mmspec_cli.models.head import DraftHead, head_sequence
from mmspec_cli.training.losses import top1_agreement, uniform_noise
from mmspec_cli.training.sequences import TargetSequence

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class _Item:
    """One sequence of the batch: noisy features, embeddings, its pass-0 layout and the scored range."""

    seq: TargetSequence
    features: torch.Tensor  # (N − 1, H), noisy
    embeds: torch.Tensor  # (N, H)
    pairs: list[int]  # pair of each pass-0 entry
    text: list[bool]  # whether the entry is a text pair (a prediction), not a compressed image token
    entry_of: dict[int, int]  # pair -> pass-0 entry
    lo: int  # scored pairs: lo .. hi
    hi: int
    target_logits: torch.Tensor  # (hi − lo + 1, V): the target's logits at pairs lo+1 .. hi+1
    inputs0: torch.Tensor  # (n, H) the pass-0 layer inputs
    positions0: list[int]


def additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean (B, q, k) "may attend" tensor as the additive (B, 1, q, k) mask the decoder layer takes."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
        ~allowed, torch.finfo(dtype).min)[:, None]


class HeadObjective(nn.Module):
    """The loss of ``head`` on a batch (one forward, so that DDP under ``accelerate`` sees one call per step).

    ``lm_head`` is the target's, frozen; ``passes`` ≥ 1; ``noise`` the relative noise amplitude.
    """

    def __init__(self, head: DraftHead, lm_head: nn.Module, image_token_id: int | None, loss: LossFn,
                 passes: int, noise: float):
        super().__init__()
        self.head = head
        object.__setattr__(self, "lm_head", lm_head)  # the target's: not a submodule (DDP syncs the head alone)
        self.image_token_id = image_token_id
        self.loss = loss
        self.passes = passes
        self.noise = noise

    def _item(self, seq: TargetSequence, generator: torch.Generator | None) -> _Item:
        head = self.head
        device, dtype = head.fc.weight.device, head.fc.weight.dtype
        f = seq.hidden[:-1].to(device, dtype)
        f = f + uniform_noise(f, self.noise, generator)
        e = seq.embeds.to(device, dtype)
        layout = head_sequence(head, seq.ids, f, e, 0, self.image_token_id, seq.prompt_len)
        n = len(seq.ids)
        lo, hi = max(0, seq.prompt_len - 2), n - 3
        with torch.no_grad():
            rows = seq.hidden[lo + 1:hi + 2].to(self.lm_head.weight.device, self.lm_head.weight.dtype)
            target_logits = self.lm_head(rows)
        return _Item(seq, f, e, layout.pairs, layout.predicts, {p: i for i, p in enumerate(layout.pairs)}, lo, hi,
                     target_logits, layout.inputs, layout.positions)

    def forward(self, batch: Sequence[TargetSequence], generator: torch.Generator | None = None):
        """(loss, stats): the mean of the passes' losses; stats per pass: loss, top-1 agreement, positions."""
        head = self.head
        device, dtype = head.fc.weight.device, head.fc.weight.dtype
        items = [self._item(seq, generator) for seq in batch]
        B = len(items)
        cache = DynamicCache(config=head.config)
        # pass 0: every entry, causal within its sequence
        n0 = max(len(it.pairs) for it in items)
        hidden = items[0].inputs0.shape[-1]
        x = torch.zeros(B, n0, hidden, device=device, dtype=dtype)
        positions = torch.zeros(B, n0, dtype=torch.long, device=device)
        allowed = torch.zeros(B, n0, n0, dtype=torch.bool, device=device)
        tril = torch.tril(torch.ones(n0, n0, dtype=torch.bool, device=device))
        for b, it in enumerate(items):
            n = len(it.pairs)
            x[b, :n] = it.inputs0
            positions[b, :n] = torch.tensor(it.positions0, device=device)
            allowed[b] = tril
            allowed[b, :, n:] = False
            allowed[b, n:, 0] = True  # padding rows see one key (their outputs are never used)
        out = head.body(x, positions, additive(allowed, dtype), cache)  # (B, n0, H)
        # per pass, per sequence: the pairs its slots hold, in slot order, and where each pass starts in the cache
        slot_pairs: list[list[list[int]]] = [[list(it.pairs) for it in items]]
        slot_of: list[list[dict[int, int]]] = [[dict(it.entry_of) for it in items]]
        offsets = [0]
        width = [n0]
        losses, stats = [], []
        self._score(items, out, slot_pairs[0], [[i for i, t in enumerate(it.text) if t] for it in items], losses, stats)
        for k in range(1, self.passes):
            # pass k: text pairs p whose pair p − 1 holds a text entry of pass k − 1
            queries: list[list[int]] = []
            for b, it in enumerate(items):
                lowest = it.lo - (self.passes - 1 - k)  # entries below this feed no scored entry
                prev = slot_of[k - 1][b]
                queries.append([p + 1 for p in prev if p + 1 <= it.hi and p + 1 >= lowest
                                and it.text[it.entry_of[p]] and p + 1 in it.entry_of and it.text[it.entry_of[p + 1]]])
            m = max((len(q) for q in queries), default=0)
            if m == 0:
                break
            x = torch.zeros(B, m, hidden, device=device, dtype=dtype)
            positions = torch.zeros(B, m, dtype=torch.long, device=device)
            start = offsets[-1] + width[-1]
            allowed = torch.zeros(B, m, start + m, dtype=torch.bool, device=device)
            for b, it in enumerate(items):
                q = queries[b]
                if not q:
                    allowed[b, :, 0] = True
                    continue
                prev_slots = torch.tensor([slot_of[k - 1][b][p - 1] for p in q], device=device)
                features = it.features.clone()
                features[torch.tensor(q, device=device)] = out[b, prev_slots]
                layout = head_sequence(head, it.seq.ids, features, it.embeds, 0, self.image_token_id, it.seq.prompt_len)
                rows = torch.tensor([it.entry_of[p] for p in q], device=device)
                x[b, :len(q)] = layout.inputs[rows]
                positions[b, :len(q)] = torch.tensor([layout.positions[i] for i in rows.tolist()], device=device)
                qt = torch.tensor(q, device=device)[:, None]
                pairs0 = torch.tensor(slot_pairs[0][b], device=device)[None, :]
                allowed[b, :len(q), :len(slot_pairs[0][b])] = pairs0 <= qt - k  # the verified context
                here = torch.arange(len(q), device=device)
                for j in range(1, k):  # the draft's own earlier steps at pairs p − k + j
                    slots = torch.tensor([slot_of[j][b][p - k + j] for p in q], device=device)
                    allowed[b, here, offsets[j] + slots] = True
                allowed[b, here, start + here] = True
                allowed[b, len(q):, 0] = True
            out = head.body(x, positions, additive(allowed, dtype), cache)  # (B, m, H)
            offsets.append(start)
            width.append(m)
            slot_pairs.append(queries)
            slot_of.append([{p: i for i, p in enumerate(q)} for q in queries])
            self._score(items, out, queries, [list(range(len(q))) for q in queries], losses, stats)
        loss = torch.stack(losses).mean()
        return loss, stats

    def _score(self, items: list[_Item], out: torch.Tensor, pairs: list[list[int]], slots: list[list[int]],
               losses: list[torch.Tensor], stats: list[dict]) -> None:
        """The loss of one pass over the scored slots (``slots`` of each sequence, holding ``pairs``)."""
        rows, targets = [], []
        for b, it in enumerate(items):
            keep = [(s, pairs[b][s]) for s in slots[b] if it.lo <= pairs[b][s] <= it.hi]
            if not keep:
                continue
            rows.append(out[b, torch.tensor([s for s, _ in keep], device=out.device)])
            targets.append(it.target_logits[torch.tensor([p - it.lo for _, p in keep], device=out.device)])
        if not rows:
            return
        draft_logits = self.lm_head(torch.cat(rows).to(self.lm_head.weight.dtype))
        target_logits = torch.cat(targets).to(draft_logits.device)
        loss = self.loss(draft_logits, target_logits)
        losses.append(loss)
        stats.append({"loss": float(loss.detach()), "top1": float(top1_agreement(draft_logits.detach(), target_logits)),
                      "positions": int(target_logits.shape[0])})
