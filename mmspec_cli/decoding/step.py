"""One block, as gpt-fast's reads: propose, verify, accept, roll back, in :meth:`BlockStep.run`.

1. **propose**: the drafter proposes a chain of up to γ tokens after the verified ones, or a token tree
   (:class:`~.drafter.DraftShape`);
2. **verify**: the target scores [last verified token, draft...] in ONE forward over its KV state (a tree
   goes through one forward with a tree mask, :mod:`.tree`); the turn's first block also feeds the prompt
   (the one place a prefix is searched: a conversation's earlier turns are kept);
3. **accept**: the verification rule (:mod:`.verify`) accepts a prefix (for a tree: of one branch) and
   adds the target's own token;
4. **roll back**, two visible lines: the target keeps the verified tokens and the accepted drafts (a
   length, or a tree's accepted path), and the drafter is told what was kept (``roll_back``), where it rolls
   its own states back. After a block the target holds every verified token but the last, so the next
   block feeds only the target's token and the new draft;
5. the drafter sees the target's logits along the followed chain (TABED's evidence).

What the block added to the output, cut at EOS, is :class:`TurnOutput`'s business.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mmspec_cli.decoding.drafter import EMPTY_DRAFT, Draft, Drafter, DraftShape, Kept, TreeDraft, as_asked
from mmspec_cli.decoding.events import BlockVerified, TurnResult
from mmspec_cli.decoding.inference import inference
from mmspec_cli.decoding.kv import CachedModel
from mmspec_cli.decoding.metrics import RunStats
from mmspec_cli.decoding.sampling import TokenPicker, branch_repeats, penalize_repeats
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

    def __init__(self, cached_target: CachedModel, drafter: Drafter, settings: TreeSettings = TreeSettings(),
                 repetition_penalty: float = 1.0):
        self.cached_target = cached_target
        self.drafter = drafter
        self.settings = settings
        self.drafts_trees = settings.drafts_tree and drafter.traits.drafts
        self.prompt_fed = False  # whether this turn's prompt is in the target's state (after the turn's first block)
        self.repetition_penalty = repetition_penalty  # the target's generation_config's (1.0: none)
        self.seen: dict[int, None] | None = None  # the distinct ids the verified sequence holds (a penalty's), in order
        self.seen_ids: torch.Tensor | None = None  # ``seen`` as a (U,) tensor on the logits' device
        self.seen_generated = 0  # how many of the turn's generated tokens ``seen`` holds

    def begin_turn(self) -> None:
        """A new turn: its first block feeds the prompt."""
        self.prompt_fed = False
        self.seen = None

    def length(self, scheduled: int, room: int) -> int:
        """Tokens a block may draft: the schedule's γ (a dynamic tree: its levels), at most ``room``."""
        return min(self.settings.depth + 1 if self.settings.kind == "dynamic" else scheduled, room)

    def shape(self, gamma: int) -> DraftShape:
        """What a block of ``gamma`` asks the drafter for: a chain, or the settings' tree."""
        s = self.settings
        if not self.drafts_trees:
            return DraftShape(gamma)
        return DraftShape(gamma, s.kind, width=s.width, budget=s.budget, topk=s.topk)

    @inference  # the whole block: the calls it makes find the mode on (:mod:`.inference`)
    def run(self, prompt: ModelPrompt, generated: list[int], gamma: int, picker: TokenPicker) -> BlockOutcome:
        laps = Laps()
        held = len(prompt.ids) + len(generated) - 1  # the verified tokens but the last: what the target holds
        # 1. propose
        if gamma > 0:
            shape = self.shape(gamma)
            proposed = as_asked(shape, self.drafter.propose(generated, shape, picker), self.drafter.name)
        else:
            proposed = EMPTY_DRAFT
        draft_s = laps.lap()
        # 2. verify (ONE target forward) and 3. accept
        if isinstance(proposed, TreeDraft):
            tree = proposed
            verdict, logits, draft, kept = self._verify_tree(prompt, generated, tree, picker)
        else:
            tree, draft = None, proposed
            verdict, logits = self._verify(prompt, generated, draft, picker)
            kept = Kept(verdict.accepted)
        # 4. roll back: the target keeps the verified tokens and the accepted drafts; the drafter what was kept
        if tree is None:
            self.cached_target.rollback(held + 1 + kept.count)
        else:
            self.cached_target.keep_path(rooted(kept.nodes))
        if gamma > 0:  # a block cut to γ = 0 proposed nothing: the drafter has nothing to keep
            self.drafter.roll_back(kept)
        verify_s = laps.lap()
        # 5. observe
        if len(draft):
            self.drafter.observe(logits, draft, verdict, picker)
        return BlockOutcome(draft, verdict, tree, draft_s, verify_s, laps.lap())

    def _feed_prompt(self, prompt: ModelPrompt, generated: list[int], after: list[int], keep: int) -> torch.Tensor:
        """The turn's first block: the target is fed the prompt (what earlier turns left in its state is kept), the
        verified tokens and ``after``; logits of the last ``keep`` positions."""
        self.prompt_fed = True
        return self.cached_target.logits(prompt.ids + generated + after, keep=keep, vision=prompt.vision,
                                         prompt_len=len(prompt.ids))

    def _held_then(self, prompt: ModelPrompt, generated: list[int]) -> int:
        """In a later block: the last verified token, after checking the target holds every one before it."""
        held = len(prompt.ids) + len(generated) - 1
        if self.cached_target.length != held:
            raise RuntimeError(f"the target holds {self.cached_target.length} positions, {held} expected")
        return generated[-1] if generated else prompt.ids[-1]

    def _verify(self, prompt: ModelPrompt, generated: list[int], draft: Draft,
                picker: TokenPicker) -> tuple[Verdict, torch.Tensor]:
        """ONE target forward over the last verified token plus the draft; then the verification rule."""
        keep = len(draft) + 1
        if self.prompt_fed:
            logits = self.cached_target.extend([self._held_then(prompt, generated), *draft.tokens], keep)  # (γ+1, V)
        else:
            logits = self._feed_prompt(prompt, generated, draft.tokens, keep)
        logits = self._penalized(logits, prompt, generated, [0, *draft.tokens], list(range(-1, len(draft))))
        if picker.greedy:
            return verify_greedy(draft.tokens, logits), logits
        tokens = torch.tensor(draft.tokens, dtype=torch.long)
        return verify_sampling(tokens, draft.probs, picker.distribution(logits), picker.generator), logits

    def _verify_tree(self, prompt: ModelPrompt, generated: list[int], tree: TreeDraft,
                     picker: TokenPicker) -> tuple[Verdict, torch.Tensor, Draft, Kept]:
        """ONE target forward over the root (the last verified token) and every node; then the tree rule.

        Returns the verdict, the target's logits along the followed branch (γ+1, V), that branch as a chain, and
        the accepted path.
        """
        if self.prompt_fed:
            root = self._held_then(prompt, generated)
        else:
            verified = prompt.ids + generated
            self.cached_target.hold(verified[:-1], vision=prompt.vision,
                                    prompt_len=min(len(prompt.ids), len(verified) - 1))
            self.prompt_fed, root = True, verified[-1]
        tokens, parents = rooted_values(tree.tokens, root), rooted_parents(tree.topology)
        logits = self._penalized(self.cached_target.tree_logits(tokens, parents), prompt, generated, tokens,
                                 parents)  # (1 + n, V)
        if tree.scores is not None:
            accepted, next_token, followed = self._follow_dynamic(tree, tokens, parents, logits, picker)
        else:
            accepted, next_token, followed = self._follow_width(tree, logits, picker)
        return Verdict(len(accepted), next_token), logits[rooted(followed.nodes)], followed, Kept(len(accepted),
                                                                                                  tuple(accepted))

    def _penalized(self, logits: torch.Tensor, prompt: ModelPrompt, generated: list[int], tokens: list[int],
                   parents: list[int]) -> torch.Tensor:
        """The target's logits of the rows [root, nodes...] (a chain: each row's parent is the one before) under the
        repetition penalty, as ``generate`` applies it; unchanged when there is none. The verified sequence's distinct
        ids are gathered once a turn, then only the new ones."""
        if self.repetition_penalty == 1.0:
            return logits
        vocab = logits.shape[-1]
        if self.seen is None:  # an id past the LM head's rows (an image placeholder) has no logit
            self.seen = dict.fromkeys(token for token in prompt.ids if token < vocab)
            self.seen_ids, self.seen_generated = None, 0
        if len(generated) > self.seen_generated:
            size = len(self.seen)
            self.seen.update(dict.fromkeys(generated[self.seen_generated:]))
            self.seen_generated = len(generated)
            if len(self.seen) > size:
                self.seen_ids = None
        if self.seen_ids is None:
            self.seen_ids = torch.tensor(list(self.seen), dtype=torch.long, device=logits.device)
        rows, ids = branch_repeats(tokens, parents, self.seen)
        return penalize_repeats(logits, self.seen_ids, rows, ids, self.repetition_penalty)

    def _follow_width(self, tree: TreeDraft, logits: torch.Tensor, picker: TokenPicker):
        """A width tree: the branch rules of TABED §6.1 (greedy) and recursive rejection sampling."""
        root, branches = split_rooted(tree.topology, logits)  # (V,), (d, γ, V)
        tokens = torch.tensor(tree.branches, dtype=torch.long)  # (d, γ)
        if picker.greedy:
            outcome = verify_tree_greedy(tokens, root, branches)
        else:
            outcome = verify_tree_sampling(tokens, tree.branch_probs(), picker.distribution(root),
                                           lambda at: picker.distribution(branches[at.to(branches.device)]),
                                           picker.generator)  # the followed branch only
        followed = tree.branch(outcome.branch)
        return list(followed.nodes[: outcome.accepted]), outcome.next_token, followed

    def _follow_dynamic(self, tree: TreeDraft, tokens: list[int], parents: list[int], logits: torch.Tensor,
                        picker: TokenPicker):
        """A dynamic tree: the longest matching path (greedy) or deterministic candidates (sampling);
        the followed chain is the accepted path continued through the best-scoring children."""
        if picker.greedy:
            verdict = verify_any_tree_greedy(parents, tokens, logits)
        else:
            verdict = verify_any_tree_sampling(parents, tokens, rooted_values(tree.scores),
                                               lambda rows: picker.distribution(logits[rows.to(logits.device)]),
                                               picker.generator)  # the rows the walk reaches only
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
