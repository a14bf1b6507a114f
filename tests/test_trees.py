"""Token trees (``--tree-width d``): one target forward over all branches, lossless under greedy and sampling."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from tests import tiny
from mmspec_cli.cli.app import app
from mmspec_cli.drafters import build_drafter
from mmspec_cli.drafters.rows import BatchedRows
from mmspec_cli.drafters.views import multimodal_row, text_only_row
from mmspec_cli.decoding.engine import SpeculativeDecoder
from mmspec_cli.errors import InputError, ModelLoadError
from mmspec_cli.models.prompts import process, render_prompt
from mmspec_cli.decoding.drafter import EMPTY_DRAFT, Draft, Drafter, DrafterTraits, DraftShape, TreeDraft, TurnStart, as_asked
from mmspec_cli.decoding.kv import CachedModel
from mmspec_cli.decoding.tree import TreeTopology, check_tree_support, check_tree_width

from tests.helpers import save_images, write_profile
from tests.helpers import assert_one_line_error
from tests.helpers import FOLLOW_UP, MAX_NEW, QUESTION, reference
from tests.distributions import ENGINE_RUNS, PARAMS, chi_square_p_value, sampled_pairs

BRANCHES = [[50, 60, 70], [80, 90, 100], [110, 120, 130]]


def tree_nodes(root, branches):
    """Tokens and parents of a root followed by chains, branch after branch (the engine's layout)."""
    gamma = len(branches[0])
    tokens = [root] + [t for b in branches for t in b]
    parents = [-1] + [0 if t == 0 else j * gamma + t for j in range(len(branches)) for t in range(gamma)]
    return tokens, parents


@pytest.mark.parametrize("n_images", [0, 1, 2])
def test_each_branch_in_the_tree_forward_equals_the_branch_alone(tiny_models, n_images):
    target = tiny_models["target"]
    prompt = process(target.processor, render_prompt(target.processor, [QUESTION], [], n_images), tiny.images(n_images))
    runner = CachedModel(target.model, "target", target.image_token_id)
    runner.hold(prompt.ids[:-1], prompt.vision, len(prompt.ids) - 1)
    logits = runner.tree_logits(*tree_nodes(prompt.ids[-1], BRANCHES))  # (1 + 3·3, V)
    for j, branch in enumerate(BRANCHES):
        alone = CachedModel(target.model, "target", target.image_token_id)
        chain = alone.logits(prompt.ids + branch, keep=4, vision=prompt.vision, prompt_len=len(prompt.ids))
        rows = [0] + [1 + j * 3 + t for t in range(3)]
        torch.testing.assert_close(logits[rows], chain, rtol=0, atol=1e-10)
    # keep branch 1's first two tokens: the cache then continues exactly like a plain run over them
    runner.keep_path([0, 4, 5])
    assert runner.ids == prompt.ids + BRANCHES[1][:2]
    fresh = CachedModel(target.model, "target", target.image_token_id)
    ids = prompt.ids + BRANCHES[1][:2] + [7, 8]
    torch.testing.assert_close(runner.logits(ids, keep=2, vision=prompt.vision, prompt_len=len(prompt.ids)),
                               fresh.logits(ids, keep=2, vision=prompt.vision, prompt_len=len(prompt.ids)),
                               rtol=0, atol=1e-10)


def test_batched_rows_tree_equals_each_row_and_branch_alone(tiny_models):
    """Left-padded member rows × branches in one forward: each (row, branch) as if run alone."""
    draft = tiny_models["perturbed"]
    text = render_prompt(draft.processor, [QUESTION], [], 1)
    views = [multimodal_row(draft), text_only_row(draft)]
    rows = BatchedRows(draft.model, draft.image_token_id)
    rows.begin([v(text, tiny.images(1)) for v in views])
    rows.logits([5])
    tokens, parents = tree_nodes(6, BRANCHES)
    first = rows.tree_logits(tokens[:4], parents[:4])  # the tree in two calls, as the drafter feeds it
    second = rows.tree_logits(tokens[4:], parents[4:])
    tree = torch.cat([first, second], dim=1)  # (2, 10, V)
    for j, branch in enumerate(BRANCHES):
        for row, view in enumerate(views):
            alone = BatchedRows(draft.model, draft.image_token_id)
            alone.begin([view(text, tiny.images(1))])
            expected = torch.stack([alone.logits([5, 6] + branch[:t])[0] for t in range(4)])  # (4, V)
            got = tree[row, [0] + [1 + j * 3 + t for t in range(3)]]
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)


@pytest.mark.parametrize("width", [2, 3])
@pytest.mark.parametrize("drafter, draft", [("m", "perturbed"), ("t", "perturbed"), ("m", "random"),
                                            ("tabed", "perturbed"), ("mtp", "perturbed"), ("m", "same")])
@pytest.mark.parametrize("gamma", [1, 4])
def test_greedy_equals_target_generate(tiny_models, width, drafter, draft, gamma):
    target = tiny_models["target"]
    decoder = SpeculativeDecoder(target, build_drafter(drafter, target, tiny_models[draft]), gamma=gamma,
                                 max_new_tokens=MAX_NEW, tree_width=width)
    generation = decoder.generate(tiny.images(1), [QUESTION, FOLLOW_UP])
    first = generation.turns[0]
    assert first.token_ids == reference(target, [QUESTION], [], 1)
    assert generation.turns[1].token_ids == reference(target, [QUESTION, FOLLOW_UP], [first.text], 1)
    for block in first.blocks:
        if block.draft:
            assert len(block.tree) == width and block.draft in block.tree
            assert len({b[0] for b in block.tree}) == width  # distinct first tokens
            assert block.tokens[: block.accepted] == block.draft[: block.accepted]


@pytest.mark.parametrize("n_images", [0, 2])
def test_greedy_with_images_and_ssd(tiny_models, n_images):
    target = tiny_models["target"]
    for drafter in (build_drafter("ssd", target, None, ssd_layer=1), build_drafter("t", target, tiny_models["perturbed"])):
        decoder = SpeculativeDecoder(target, drafter, gamma=3, max_new_tokens=MAX_NEW, tree_width=2)
        assert decoder.generate(tiny.images(n_images), [QUESTION]).turns[0].token_ids == reference(
            target, [QUESTION], [], n_images)


def test_trees_raise_block_efficiency_over_chains(tiny_models):
    target = tiny_models["target"]
    tau = {}
    for width in (1, 2, 3):
        decoder = SpeculativeDecoder(target, build_drafter("t", target, tiny_models["perturbed"]), gamma=3,
                                     max_new_tokens=MAX_NEW, tree_width=width)
        tau[width] = decoder.generate(tiny.images(1), [QUESTION]).stats.block_efficiency
    assert tau[1] <= tau[2] <= tau[3] and tau[1] < tau[3]


def test_sampled_pairs_follow_the_target_distribution(tiny_models, joint):
    """tabed (m and t mixed) drafting trees of width 2 and γ = 2: ENGINE_RUNS runs against the target's exact
    distribution (tests/test_engine_sampling.py says how); the rule is tested alone in test_tree_verify.py.

    What it can detect (measured when it was written, same seeds): handing the rule each branch's q rows for
    the other branch's gives p ≈ 5e-6; keeping the first branch whole p ≈ 0."""
    target = tiny_models["target"]
    decoder = SpeculativeDecoder(target, build_drafter("tabed", target, tiny_models["perturbed"]), gamma=2,
                                 max_new_tokens=3, sampling=PARAMS, tree_width=2)
    counts, turns = sampled_pairs(decoder, ENGINE_RUNS)
    first_blocks = [turn.blocks[0] for turn in turns]
    branches_taken = Counter(b.tree.index(b.draft) if b.accepted else -1 for b in first_blocks)
    assert branches_taken[1] > 0  # the second branch was accepted sometimes: the recursive step is exercised
    assert branches_taken[-1] > 0 and {b.accepted for b in first_blocks} == {0, 1, 2}
    assert chi_square_p_value(counts, joint, ENGINE_RUNS) > 1e-3


def test_width_and_model_checks():
    assert check_tree_width(8) == 8
    for bad in (0, 9):
        with pytest.raises(InputError, match=r"tree width .* is outside \[1, 8\]"):
            check_tree_width(bad)
    config = tiny.make_config(50)
    config.text_config._attn_implementation_internal = "flash_attention_2"  # as loading flash-attn would set it
    flash = SimpleNamespace(config=config)
    with pytest.raises(ModelLoadError, match="custom 4-D attention mask.*use --tree-width 1"):
        check_tree_support(flash)


def test_cli_tree_width(tiny_dirs, tmp_path):
    profile = write_profile(tmp_path / "p.yaml", tiny_dirs["target"], tiny_dirs["perturbed"], max_new_tokens=6)
    [image] = save_images(tmp_path, 1)
    args = ["generate", image, "-q", QUESTION, "--profile", profile]
    runner = CliRunner()
    for bad in ("0", "9"):
        assert_one_line_error(runner.invoke(app, [*args, "--tree-width", bad]),
                              f"--tree-width: expected an integer between 1 and 8, got {bad}")
    result = runner.invoke(app, [*args, "--tree-width", "2", "--json"])
    assert result.exit_code == 0, result.stderr
    assert "tree" in __import__("json").loads(result.stdout)["turns"][0]["blocks"][0]


class ChainsWhateverAsked(Drafter):
    """A drafter that ignores the shape it is asked for and proposes a chain of one token."""

    name = "chains-whatever-asked"
    traits = DrafterTraits()

    def begin_turn(self, turn: TurnStart) -> None:
        pass

    def propose(self, verified, shape: DraftShape, picker) -> Draft:
        return Draft(tokens=[7])


def test_a_drafter_that_proposes_a_chain_where_a_tree_was_asked_is_stopped(tiny_models):
    """Verified as a chain, such a block would make ``--tree-width`` do nothing without a word; a drafter that drafts
    chains only is refused trees before loading (``registry.CHAIN_ONLY``) instead."""
    with pytest.raises(TypeError, match="'chains-whatever-asked' was asked for a tree and proposed a chain"):
        SpeculativeDecoder(tiny_models["target"], ChainsWhateverAsked(), tree_width=2).generate(tiny.images(1), [QUESTION])
    assert as_asked(DraftShape(3), EMPTY_DRAFT, "x") is EMPTY_DRAFT
    assert as_asked(DraftShape(3, "width", width=2), EMPTY_DRAFT, "x") is EMPTY_DRAFT  # nothing fits every shape
    tree = TreeDraft(topology=TreeTopology(parents=[-1]), tokens=[5])
    assert as_asked(DraftShape(3, "width", width=2), tree, "x") is tree
    with pytest.raises(TypeError, match="asked for a chain and proposed a tree"):
        as_asked(DraftShape(3), tree, "x")
