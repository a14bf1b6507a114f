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

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from mmspec_cli.drafters.captioner import Captioner
from mmspec_cli.drafters.weights import WeightPolicy, mixture
from mmspec_cli.models.profiles import EnsembleSpec
from mmspec_cli.models.loading import LoadedModel
from mmspec_cli.decoding.sampling import TokenPicker, working_dtype
from mmspec_cli.decoding.verify import Verdict
from mmspec_cli.decoding.drafter import Draft, Drafter, TreeDraft
from mmspec_cli.drafters.tree_drafting import TreeDrafting, pick
from mmspec_cli.drafters.rows import BatchedRows
from mmspec_cli.drafters.single import fit_vocab
from mmspec_cli.drafters.views import RowView


def member_distributions(logits: torch.Tensor, picker: TokenPicker) -> torch.Tensor:
    """Per-row q_k (B, V): softmax(logits / T) shaped like the target's p; T = 1 when greedy."""
    if picker.greedy:
        return torch.softmax(logits.to(working_dtype(logits)), dim=-1)
    return picker.distribution(logits)


class EnsembleDrafter(TreeDrafting, Drafter):
    """Members ``names`` (e.g. "m", "t") drafted as rows of one batch and mixed by ``policy``."""

    def __init__(self, name: str, members: Sequence[str], views: Sequence[RowView], draft: LoadedModel,
                 target_vocab: int, policy: EnsembleSpec, seed: int = 0, captioner: Captioner | None = None):
        self.name = name
        self.captioner = captioner
        self.members = tuple(members)
        self.views = list(views)
        self.target_vocab = target_vocab
        self.rows = BatchedRows(draft.model, draft.image_token_id)
        self.policy = WeightPolicy(len(members), policy, vocab_size=target_vocab, seed=seed)
        self.prefix: list[int] = []  # shared tokens before this turn's generated ones (later turns)
        self._longest = 0  # tokens of this turn's longest member row
        self._block_q: torch.Tensor | None = None  # (γ, m, V) member distributions of the last chain block
        self._weights = torch.ones(len(members), dtype=torch.float64) / len(members)  # the tree block's weights
        self._root_q: torch.Tensor | None = None  # (m, V) member distributions at a tree's root
        self._node_q: list[torch.Tensor] = []  # (m, V) after each fed node of the tree, in node order

    def models(self) -> list[Any]:
        return [self.rows.model]

    def bind_target(self, runner: Any) -> None:
        """The rows' state is of the target's kind: static and compiled when the target's is."""
        self.rows.use_kv(runner.kv)

    def reserve(self, after_prompt: int) -> None:
        self.rows.reserve(after_prompt)

    def begin_turn(self, prompt_text: str, images: Sequence[Any]) -> None:
        rows = [view(prompt_text, images) for view in self.views]
        self._longest = max(len(row.ids) for row in rows)
        self.prefix = self.rows.begin(rows)
        self.policy.reset()

    def prompt_lengths(self) -> list[tuple[Any, int]]:
        """The longest member row: each row counts its own positions, so that is the one that must fit."""
        return [(self.rows.model, self._longest)]

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
        while len(tokens) < gamma:
            if tokens and picker.greedy:  # compiled: the rest of a greedy chain in one graph
                chained = self.rows.greedy_mixture_chain(tokens[-1], gamma - len(tokens), weights, self.target_vocab)
                if chained is not None:
                    tokens += chained[0]
                    members_q.extend(chained[1].to(members_q[0]))
                    break
            q_k = member_distributions(fit_vocab(self.rows.logits(shared), self.target_vocab), picker)  # (m, V)
            q = mixture(q_k, weights)  # (V,)
            token = pick(q, picker)
            tokens.append(token)
            members_q.append(q_k)
            mixed_q.append(q)
            shared.append(token)
        self._block_q = torch.stack(members_q) if members_q else None
        return Draft(tokens=tokens, probs=None if picker.greedy else torch.stack(mixed_q),
                     weights=[float(w) for w in weights])

    def tree_root(self, generated: Sequence[int], picker: TokenPicker) -> torch.Tensor:
        """The block's weights, then the mixture at the last verified token (every member row in one forward)."""
        self._weights = self.policy.weights()  # (m,)
        self._root_q = member_distributions(fit_vocab(self.rows.logits(self.prefix + list(generated)),
                                                      self.target_vocab), picker)  # (m, V)
        self._node_q = []
        return mixture(self._root_q, self._weights)  # (V,)

    def tree_level(self, tokens: Sequence[int], parents: Sequence[int], picker: TokenPicker) -> torch.Tensor:
        """Every member row × every node of the level in ONE forward; each node's mixture with the block's weights."""
        logits = fit_vocab(self.rows.tree_logits(tokens, parents), self.target_vocab)  # (m, n, V)
        q_k = member_distributions(logits.transpose(0, 1), picker)  # (n, m, V)
        self._node_q.extend(q_k)
        return mixture(q_k, self._weights)  # (n, V)

    def propose_tree(self, generated: Sequence[int], gamma: int, width: int, picker: TokenPicker) -> TreeDraft:
        tree = TreeDrafting.propose_tree(self, generated, gamma, width, picker)
        self._block_q = None
        return dataclasses.replace(tree, weights=[float(w) for w in self._weights])

    def propose_dynamic_tree(self, generated: Sequence[int], levels: int, budget: int, topk: int,
                             picker: TokenPicker) -> TreeDraft:
        tree = TreeDrafting.propose_dynamic_tree(self, generated, levels, budget, topk, picker)
        self._block_q = None
        return dataclasses.replace(tree, weights=[float(w) for w in self._weights])

    def keep_fed(self, fed: Sequence[int]) -> None:
        self.rows.keep_path(fed)

    def log_proposal(self, proposal: torch.Tensor, picker: TokenPicker) -> torch.Tensor:
        """The mixture is a distribution, greedy or not."""
        return proposal.to(torch.float64).clamp_min(torch.finfo(torch.float64).tiny).log()

    def _branch_q(self, nodes: Sequence[int]) -> torch.Tensor:
        """(γ, m, V): the member distributions each token of a tree branch was picked from (after the
        root, then after each fed node of the path)."""
        return torch.stack([self._root_q] + [self._node_q[self._fed[node]] for node in nodes[:-1]])

    def observe(self, target_logits: torch.Tensor, draft: Draft, verdict: Verdict, picker: TokenPicker) -> None:
        """Record the verified positions: those whose prefix the target accepted (accepted + 1, at most γ)."""
        if not self.policy.uses_evidence:
            return
        block_q = self._block_q if draft.nodes is None else self._branch_q(draft.nodes)  # (γ, m, V)
        if block_q is None:
            return
        n = min(verdict.accepted + 1, len(draft))
        kept = torch.tensor((draft.tokens[: verdict.accepted] + [verdict.next_token])[:n])
        p = member_distributions(target_logits[:n], picker)  # (n, V)
        self.policy.observe(p, block_q[:n].to(p), kept)
