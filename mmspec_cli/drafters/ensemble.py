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

import torch

from mmspec_cli.drafters.captioner import Captioner
from mmspec_cli.drafters.weights import WeightPolicy, mixture
from mmspec_cli.models.profiles import EnsembleSpec
from mmspec_cli.models.loading import LoadedModel
from mmspec_cli.decoding.chain import DraftStep, draft_chain
from mmspec_cli.decoding.sampling import TokenPicker, working_dtype
from mmspec_cli.decoding.verify import Verdict
from mmspec_cli.decoding.drafter import Draft, Drafter, DrafterTraits, DraftShape, Kept, TreeDraft, TurnStart
from mmspec_cli.drafters.tree_drafting import TreeDrafts, TreeStep, probabilities_log_proposal
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
                 target_vocab: int, policy: EnsembleSpec, seed: int = 0, captioner: Captioner | None = None):
        self.name = name
        self.traits = DrafterTraits(models=(draft.model,), members=tuple(members), slow_start=captioner is not None,
                                    captioner=captioner)
        self.views = list(views)
        self.target_vocab = target_vocab
        self.rows = BatchedRows(draft.model, draft.image_token_id)
        self.step = DraftStep(self._feed, from_logits=False, catch_up=self._feed_lead)
        self.trees = TreeDrafts(TreeStep(root=self._tree_root, level=self._tree_level, keep=self.rows.keep_path,
                                         log_proposal=probabilities_log_proposal))  # the mixture is a distribution
        self.prompt_fed = False  # whether the turn's rows are caught up (after its first block)
        self.base = 0  # shared tokens held before the block's drafts
        self.policy = WeightPolicy(len(members), policy, vocab_size=target_vocab, seed=seed)
        self.turn_shared: list[int] = []  # shared tokens before this turn's generated ones (later turns)
        self._picker: TokenPicker | None = None  # the block's picker, for the eager draft step
        self._block_q: torch.Tensor | None = None  # (γ, m, V) member distributions of the last chain block
        self._weights = torch.ones(len(members), dtype=torch.float64) / len(members)  # the tree block's weights
        self._root_q: torch.Tensor | None = None  # (m, V) member distributions at a tree's root
        self._node_q: list[torch.Tensor] = []  # (m, V) after each fed node of the tree, in node order

    def begin_turn(self, turn: TurnStart) -> None:
        """The rows' state is of the target's kind (static and compiled when the target's is); each member's row."""
        self.rows.use_kv(turn.cached_target.kv)
        self.step = DraftStep(self._feed, from_logits=False, catch_up=self._feed_lead,
                              compiled=self._compiled if self.rows.chain is not None else None)
        rows = [view(turn.text, turn.images) for view in self.views]
        # the longest member row: each row counts its own positions, so that is the one that must fit
        self.traits.prompt_views = [(self.rows.model, max(len(row.ids) for row in rows))]
        self.turn_shared = self.rows.begin(rows)
        self.rows.reserve(turn.room)
        self.policy.reset()
        self.prompt_fed = False

    def _lacks(self, verified: Sequence[int]) -> list[int] | None:
        """The verified tokens the rows lack, in a block after the turn's first (None before it)."""
        return list(verified[self.rows.held - len(self.turn_shared):]) if self.prompt_fed else None

    def _feed_lead(self, tokens: list[int], carry: None) -> tuple[tuple[torch.Tensor, torch.Tensor], None]:
        """Feed every row the verified tokens it lacks, in one forward; the mixture after them and its members."""
        q_k = member_distributions(fit_vocab(self.rows.extend(tokens), self.target_vocab), self._picker)  # (m, V)
        return (mixture(q_k, self._weights), q_k), carry

    def _catch_up(self, verified: Sequence[int], picker: TokenPicker) -> torch.Tensor:
        """Feed every row the verified tokens it lacks; the member distributions after them (m, V). The turn's
        first block keeps what an earlier turn left; later ones feed only the tokens since the last block."""
        lacking = self._lacks(verified)
        if lacking is not None:
            logits = self.rows.extend(lacking)
        else:
            logits = self.rows.logits(self.turn_shared + list(verified))
            self.prompt_fed = True
        self.base = self.rows.held
        return member_distributions(fit_vocab(logits, self.target_vocab), picker)  # (m, V)

    def _feed(self, token: int, carry: None, i: int) -> tuple[tuple[torch.Tensor, torch.Tensor], None]:
        return self._feed_lead([token], carry)

    def _compiled(self, first: tuple[torch.Tensor, torch.Tensor] | None, lead: list[int] | None, carry: None,
                  steps: int):
        """The greedy chain in one graph: its tokens, and the member distributions each was chosen from as one
        (steps, m, V) tensor (what :meth:`propose` keeps), not a pair per token."""
        return self.rows.run_chain(first, lead, steps, self._weights, self.target_vocab)

    def propose(self, verified: Sequence[int], shape: DraftShape, picker: TokenPicker) -> Draft | TreeDraft:
        self._weights = self.policy.weights()  # (m,), fixed for the whole block (TABED Alg. 1 line 3)
        weights = self._weights.tolist()
        if shape.tree:
            tree = self.trees.draft(verified, shape, picker)
            self._block_q = None
            return dataclasses.replace(tree, weights=weights)
        self._picker = picker
        lacking = self._lacks(verified)
        if lacking:  # the chain feeds them first (in its graph, compiled)
            self.base = self.rows.held + len(lacking)
            tokens, kept = draft_chain(self.step, None, None, shape.length, picker, lead=lacking)
        else:
            q_k = self._catch_up(verified, picker)
            tokens, kept = draft_chain(self.step, (mixture(q_k, self._weights), q_k), None, shape.length, picker)
        if isinstance(kept, torch.Tensor):  # the compiled chain's (γ, m, V), already stacked
            self._block_q = kept
            return Draft(tokens=tokens, probs=None, weights=weights)  # greedy: no draft distributions
        self._block_q = torch.stack([members_q for _, members_q in kept])  # (γ, m, V)
        return Draft(tokens=tokens, probs=None if picker.greedy else torch.stack([q for q, _ in kept]),
                     weights=weights)

    def roll_back(self, kept: Kept) -> None:
        """Keep the verified context and the kept drafts the block fed to every row (a tree: its accepted path)."""
        if kept.nodes is not None:
            self.trees.keep_path(kept.nodes)
        else:
            self.rows.rollback(min(self.rows.held, self.base + kept.count))

    def _tree_root(self, verified: Sequence[int], picker: TokenPicker) -> torch.Tensor:
        """The mixture at the last verified token (every member row in one forward), with the block's weights."""
        self._root_q = self._catch_up(verified, picker)  # (m, V)
        self._node_q = []
        return mixture(self._root_q, self._weights)  # (V,)

    def _tree_level(self, tokens: Sequence[int], parents: Sequence[int], picker: TokenPicker) -> torch.Tensor:
        """Every member row × every node of the level in ONE forward; each node's mixture with the block's weights."""
        logits = fit_vocab(self.rows.tree_logits(tokens, parents), self.target_vocab)  # (m, n, V)
        q_k = member_distributions(logits.transpose(0, 1), picker)  # (n, m, V)
        self._node_q.extend(q_k)
        return mixture(q_k, self._weights)  # (n, V)

    def _branch_q(self, nodes: Sequence[int]) -> torch.Tensor:
        """(γ, m, V): the member distributions each token of a tree branch was picked from (after the
        root, then after each fed node of the path)."""
        return torch.stack([self._root_q] + [self._node_q[self.trees.fed[node]] for node in nodes[:-1]])

    def observe(self, target_logits: torch.Tensor, draft: Draft, verdict: Verdict, picker: TokenPicker) -> None:
        """Record the verified positions: those whose prefix the target accepted (accepted + 1, at most γ)."""
        if not self.policy.uses_evidence:
            return
        block_q = self._block_q if draft.nodes is None else self._branch_q(draft.nodes)  # (γ, m, V)
        if block_q is None:
            return
        n = min(verdict.accepted + 1, len(draft))
        kept = (draft.tokens[: verdict.accepted] + [verdict.next_token])[:n]
        p = member_distributions(target_logits[:n], picker)  # (n, V)
        self.policy.observe(p, block_q[:n].to(p), kept)
