"""In-batch ensemble drafting: static (IbED Alg. 1) and test-time adaptive (TABED Alg. 1).

All members are rows of ONE batched forward of ONE draft model (:mod:`.rows`). At each
draft step every row yields a next-token distribution q_k; they are mixed with the
block's weights, q = Σ_k w_k q_k, and one token is chosen from q (argmax when greedy, a
draw when sampling) and appended to every row. The verifier receives q itself, which keeps
the ensemble lossless under sampling. After verification the drafter records, for each
verified position, the target's p and every q_k; the weight policy (:mod:`..ensemble`)
picks the next block's weights from that evidence.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mmspec_cli.drafters.captioner import Captioner
from mmspec_cli.drafters.weights import PolicyConfig, WeightPolicy, mixture
from mmspec_cli.models.loading import LoadedModel
from mmspec_cli.decoding.sampling import TokenPicker, working_dtype
from mmspec_cli.decoding.verify import Verdict
from mmspec_cli.drafters.base import Draft, Drafter, TreeDraft, first_tokens
from mmspec_cli.drafters.rows import BatchedRows
from mmspec_cli.drafters.single import fit_vocab
from mmspec_cli.drafters.views import RowView


def member_distributions(logits: torch.Tensor, picker: TokenPicker) -> torch.Tensor:
    """Per-row q_k (B, V): softmax(logits / T) shaped like the target's p; T = 1 when greedy."""
    if picker.greedy:
        return torch.softmax(logits.to(working_dtype(logits)), dim=-1)
    return picker.distribution(logits)


class EnsembleDrafter(Drafter):
    """Members ``names`` (e.g. "m", "t") drafted as rows of one batch and mixed by ``policy``."""

    def __init__(self, name: str, members: Sequence[str], views: Sequence[RowView], draft: LoadedModel,
                 target_vocab: int, policy: PolicyConfig, seed: int = 0, captioner: Captioner | None = None):
        self.name = name
        self.captioner = captioner
        self.members = tuple(members)
        self.views = list(views)
        self.target_vocab = target_vocab
        self.rows = BatchedRows(draft.model, draft.image_token_id)
        self.policy = WeightPolicy(len(members), policy, vocab_size=target_vocab, seed=seed)
        self.prefix: list[int] = []  # shared tokens before this turn's generated ones (later turns)
        self._block_q: torch.Tensor | None = None  # (γ, m, V) member distributions of the last block
        self._branch_q: torch.Tensor | None = None  # (d, γ, m, V) the same for each branch of a tree block
        self._tree_shape = (1, 0)  # (branches, tree steps fed) of the last tree block

    def models(self) -> list[Any]:
        return [self.rows.model]

    def begin_turn(self, prompt_text: str, images: Sequence[Any]) -> None:
        self.prefix = self.rows.begin([view(prompt_text, images) for view in self.views])
        self.policy.reset()

    def slow_start(self, images: Sequence[Any]) -> bool:
        return self.captioner is not None and bool(images)

    @property
    def caption_seconds(self) -> float:
        return self.captioner.seconds if self.captioner is not None else 0.0

    def propose(self, generated: Sequence[int], gamma: int, picker: TokenPicker) -> Draft:
        weights = self.policy.weights()  # (m,), fixed for the whole block (TABED Alg. 1 line 3)
        shared = self.prefix + list(generated)
        tokens: list[int] = []
        members_q, mixed_q = [], []
        for _ in range(gamma):
            q_k = member_distributions(fit_vocab(self.rows.logits(shared), self.target_vocab), picker)  # (m, V)
            q = mixture(q_k, weights)  # (V,)
            token = int(q.argmax()) if picker.greedy else picker.choose_from(q)
            tokens.append(token)
            members_q.append(q_k)
            mixed_q.append(q)
            shared.append(token)
        self._block_q = torch.stack(members_q) if members_q else None
        self._branch_q = None
        return Draft(tokens=tokens, probs=None if picker.greedy else torch.stack(mixed_q),
                     weights=[float(w) for w in weights])

    def propose_tree(self, generated: Sequence[int], gamma: int, width: int, picker: TokenPicker) -> TreeDraft:
        """Every branch × every member in each draft forward: the members are the batch rows, the branches
        nodes of one token tree in every row (``rows.tree_logits``); each branch is mixed with the block's weights."""
        weights = self.policy.weights()  # (m,)
        q_k = member_distributions(fit_vocab(self.rows.logits(self.prefix + list(generated)), self.target_vocab),
                                   picker)  # (m, V)
        q = mixture(q_k, weights)  # (V,)
        firsts = first_tokens(q, width, picker)
        branches = [[token] for token in firsts]
        members_q = [[q_k] for _ in firsts]
        mixed_q = [[q] for _ in firsts]
        parents = [-1] * len(firsts)
        for step in range(gamma - 1):
            logits = fit_vocab(self.rows.tree_logits([b[-1] for b in branches], parents), self.target_vocab)  # (m, d, V)
            for j, branch in enumerate(branches):
                q_kj = member_distributions(logits[:, j], picker)  # (m, V)
                q_j = mixture(q_kj, weights)
                branch.append(int(q_j.argmax()) if picker.greedy else picker.choose_from(q_j))
                members_q[j].append(q_kj)
                mixed_q[j].append(q_j)
            parents = [step * len(branches) + j for j in range(len(branches))]
        self._tree_shape = (len(branches), gamma - 1)
        self._branch_q = torch.stack([torch.stack(m) for m in members_q])  # (d, γ, m, V)
        self._block_q = None
        probs = None if picker.greedy else torch.stack([torch.stack(m) for m in mixed_q])  # (d, γ, V)
        return TreeDraft(branches=branches, probs=probs, weights=[float(w) for w in weights])

    def keep_branch(self, branch: int, accepted: int) -> None:
        width, fed = self._tree_shape
        self.rows.keep_path([s * width + branch for s in range(min(accepted, fed))])

    def observe(self, target_logits: torch.Tensor, draft: Draft, verdict: Verdict, picker: TokenPicker) -> None:
        """Record the verified positions: those whose prefix the target accepted (accepted + 1, at most γ)."""
        block_q = self._block_q if self._branch_q is None else self._branch_q[draft.branch]  # (γ, m, V)
        if block_q is None or not self.policy.uses_evidence:
            return
        n = min(verdict.accepted + 1, len(draft))
        kept = torch.tensor((draft.tokens[: verdict.accepted] + [verdict.next_token])[:n])
        p = member_distributions(target_logits[:n], picker)  # (n, V)
        self.policy.observe(p, block_q[:n].to(p), kept)
