"""One block: the drafter proposes, the target verifies in ONE forward, the drafter observes.

1. **propose**: the drafter proposes up to γ tokens after the verified ones (a chain), or a
   token tree (its cache rolls back by itself);
2. **verify**: the target scores [last verified token, draft...] in ONE forward over its KV
   cache (a tree goes through one forward with a tree mask, :mod:`.tree`); the first block of
   a turn also feeds the prompt;
3. **accept**: the verification rule (:mod:`.verify`) accepts a prefix (for a tree: of one
   branch) and adds the target's own token;
4. **roll back**: the target's KV state keeps the verified tokens and the accepted drafts
   (:meth:`CachedModel.rollback`; a tree keeps its accepted path: ``keep_path``), so the next
   block feeds only the target's token and the new draft;
5. the drafter sees the target's logits along the followed chain (TABED's evidence).

What the block added to the output, cut at EOS, is :class:`TurnOutput`'s business.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mmspec_cli.decoding.drafter import EMPTY_DRAFT, Draft, Drafter, TreeDraft
from mmspec_cli.decoding.events import BlockVerified, TurnResult
from mmspec_cli.decoding.kv import CachedModel
from mmspec_cli.decoding.metrics import RunStats
from mmspec_cli.decoding.sampling import TokenPicker
from mmspec_cli.decoding.timing import Laps
from mmspec_cli.decoding.tree import TreeSettings, rooted, rooted_parents, rooted_values, split_rooted, unrooted
from mmspec_cli.decoding.verify import (Verdict, verify_any_tree_greedy, verify_any_tree_sampling, verify_greedy,
                                        verify_sampling, verify_tree_greedy, verify_tree_sampling)
from mmspec_cli.models.prompts import ModelPrompt


@dataclass(frozen=True)
class BlockOutcome:
    """A verified block: the chain the target followed (a tree's accepted branch), the verdict, the stage times."""

    draft: Draft
    verdict: Verdict
    tree: TreeDraft | None
    draft_s: float
    verify_s: float
    update_s: float


class BlockStep:
    """Runs blocks of ``drafter`` against the target's cached model, as chains or trees (``settings``)."""

    def __init__(self, target: CachedModel, drafter: Drafter, settings: TreeSettings = TreeSettings()):
        self.target = target
        self.drafter = drafter
        self.settings = settings
        self.trees = settings.drafts_tree and drafter.drafts

    def length(self, scheduled: int, room: int) -> int:
        """Tokens a block may draft: the schedule's γ (a dynamic tree: its levels), at most ``room``."""
        return min(self.settings.depth + 1 if self.settings.kind == "dynamic" else scheduled, room)

    def run(self, prompt: ModelPrompt, generated: list[int], gamma: int, picker: TokenPicker) -> BlockOutcome:
        laps = Laps()
        tree = None
        if gamma > 0 and self.trees:
            tree = self._propose_tree(generated, gamma, picker)
            draft_s = laps.lap()
            verdict, logits, draft = self._verify_tree(prompt, generated, tree, picker)
        else:
            draft = self.drafter.propose(generated, gamma, picker) if gamma > 0 else EMPTY_DRAFT
            draft_s = laps.lap()
            verdict, logits = self._verify(prompt, generated, draft, picker)
            self.target.rollback(len(prompt.ids) + len(generated) + verdict.accepted)  # the rejected tail goes
        verify_s = laps.lap()
        if len(draft):
            self.drafter.observe(logits, draft, verdict, picker)
        return BlockOutcome(draft, verdict, tree, draft_s, verify_s, laps.lap())

    def _propose_tree(self, generated: list[int], gamma: int, picker: TokenPicker) -> TreeDraft:
        s = self.settings
        if s.kind == "dynamic":
            return self.drafter.propose_dynamic_tree(generated, gamma, s.budget, s.topk, picker)
        return self.drafter.propose_tree(generated, gamma, s.width, picker)

    def _verify(self, prompt: ModelPrompt, generated: list[int], draft: Draft,
                picker: TokenPicker) -> tuple[Verdict, torch.Tensor]:
        """ONE target forward over the verified tokens plus the draft; then the verification rule."""
        logits = self.target.logits(prompt.ids + generated + draft.tokens, keep=len(draft) + 1,
                                    vision=prompt.vision, prompt_len=len(prompt.ids))  # (γ+1, V)
        tokens = torch.tensor(draft.tokens, dtype=torch.long)
        if picker.greedy:
            return verify_greedy(tokens, logits), logits
        return verify_sampling(tokens, draft.probs, picker.distribution(logits), picker.generator), logits

    def _verify_tree(self, prompt: ModelPrompt, generated: list[int], tree: TreeDraft,
                     picker: TokenPicker) -> tuple[Verdict, torch.Tensor, Draft]:
        """ONE target forward over the root (the last verified token) and every node; then the tree rule.

        Only the accepted path stays in the target's cache and in the draft's. Returns the verdict,
        the target's logits along the followed branch (γ+1, V), and that branch as a chain.
        """
        verified = prompt.ids + generated
        self.target.hold(verified[:-1], vision=prompt.vision, prompt_len=min(len(prompt.ids), len(verified) - 1))
        tokens, parents = rooted_values(tree.tokens, verified[-1]), rooted_parents(tree.topology)
        logits = self.target.tree_logits(tokens, parents)  # (1 + n, V)
        if tree.scores is not None:
            accepted, next_token, followed = self._follow_dynamic(tree, tokens, parents, logits, picker)
        else:
            accepted, next_token, followed = self._follow_width(tree, logits, picker)
        self.target.keep_path(rooted(accepted))
        self.drafter.keep_path(accepted)
        return Verdict(len(accepted), next_token), logits[rooted(followed.nodes)], followed

    def _follow_width(self, tree: TreeDraft, logits: torch.Tensor, picker: TokenPicker):
        """A width tree: the branch rules of TABED §6.1 (greedy) and recursive rejection sampling."""
        root, branches = split_rooted(tree.topology, logits)  # (V,), (d, γ, V)
        tokens = torch.tensor(tree.branches, dtype=torch.long)  # (d, γ)
        if picker.greedy:
            outcome = verify_tree_greedy(tokens, root, branches)
        else:
            outcome = verify_tree_sampling(tokens, tree.branch_probs(), picker.distribution(root),
                                           picker.distribution(branches), picker.generator)
        followed = tree.branch(outcome.branch)
        return list(followed.nodes[: outcome.accepted]), outcome.next_token, followed

    def _follow_dynamic(self, tree: TreeDraft, tokens: list[int], parents: list[int], logits: torch.Tensor,
                        picker: TokenPicker):
        """A dynamic tree: the longest matching path (greedy) or deterministic candidates (sampling);
        the followed chain is the accepted path continued through the best-scoring children."""
        if picker.greedy:
            verdict = verify_any_tree_greedy(parents, tokens, logits)
        else:
            verdict = verify_any_tree_sampling(parents, tokens, rooted_values(tree.scores), picker.distribution(logits),
                                               picker.generator)
        accepted = unrooted(verdict.rows)
        return accepted, verdict.next_token, tree.chain(tree.topology.extend(accepted, tree.scores))


def cut_after_eos(tokens: list[int], eos: set[int]) -> tuple[list[int], bool]:
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[: i + 1], True
    return tokens, False


@dataclass
class TurnOutput:
    """A turn's output so far: what each verified block added, cut after EOS."""

    turn: int
    eos: set[int]
    tokens: list[int] = field(default_factory=list)
    blocks: list[BlockVerified] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    finished: bool = False

    def add(self, outcome: BlockOutcome) -> BlockVerified:
        """Append the block's accepted drafts and the target's token, up to and including an EOS."""
        verdict, draft = outcome.verdict, outcome.draft
        new_tokens, self.finished = cut_after_eos(draft.tokens[: verdict.accepted] + [verdict.next_token], self.eos)
        kept_drafts = min(verdict.accepted, len(new_tokens))
        self.tokens.extend(new_tokens)
        self.drafted += len(draft)
        self.accepted += kept_drafts
        block = BlockVerified(
            turn=self.turn, index=len(self.blocks), draft=list(draft.tokens), accepted=kept_drafts,
            emitted=verdict.next_token if len(new_tokens) > kept_drafts else None, tokens=new_tokens,
            draft_s=outcome.draft_s, verify_s=outcome.verify_s, update_s=outcome.update_s, weights=draft.weights,
            tree=None if outcome.tree is None else outcome.tree.branches)
        self.blocks.append(block)
        return block

    def result(self, question: str, text: str, wall_s: float, caption_s: float) -> TurnResult:
        stats = RunStats(new_tokens=len(self.tokens), blocks=len(self.blocks), drafted=self.drafted,
                         accepted=self.accepted, wall_s=wall_s)
        return TurnResult(question=question, text=text, token_ids=self.tokens, stats=stats, blocks=self.blocks,
                          caption_s=caption_s)
