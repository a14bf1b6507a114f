"""EAGLE-2 dynamic draft trees (``--tree dynamic``): the selection maths, the rules for trees of any shape,
and losslessness end to end for every drafter that drafts trees."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from mmspec_cli.cli.app import app
from mmspec_cli.decoding.tree import ROOT, TreeSettings, TreeTopology, best, rerank, top_children
from mmspec_cli.decoding.verify import (PathVerdict, draw_rows, verify_any_tree_greedy, verify_any_tree_sampling,
                                        verify_any_tree_sampling_batch)
from mmspec_cli.drafters import build_drafter
from mmspec_cli.drafters.tree_drafting import top_log_probabilities
from mmspec_cli.errors import InputError
from mmspec_cli.models.profiles import apply_overrides, profile_from_dict
from tests import tiny
from tests.helpers import (FOLLOW_UP, QUESTION, assert_one_line_error, one_hot_logits, save_images, speculative_decoder,
                           write_profile)
from tests.helpers import reference
from tests.distributions import ENGINE_RUNS, PARAMS, ToyModel, chi_square_p_value, sampled_pairs

VISPEC = dict(tree="dynamic", tree_budget=30, tree_depth=3, tree_topk=8)
EAGLE2 = dict(tree="dynamic", tree_budget=60, tree_depth=5, tree_topk=10)


# --------------------------------------------------------------------------- selection (pure)


def test_top_children_score_whole_paths():
    log_q = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]], dtype=torch.float64))
    top = torch.topk(log_q, 2, dim=-1)
    rows, tokens, scores = top_children(top.values, top.indices, torch.tensor([0.0, -1.0], dtype=torch.float64))
    assert rows == [0, 0, 1, 1] and tokens == [0, 1, 2, 0]
    torch.testing.assert_close(torch.tensor(scores), torch.tensor([0.5, 0.3, 0.8, 0.1]).log()
                               + torch.tensor([0.0, 0.0, -1.0, -1.0]), rtol=0, atol=1e-12)
    assert best([-1.0, -0.5, -0.5, -2.0], 2) == [1, 2]  # ties: the earlier first


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_top_of_probabilities_is_the_top_of_their_logs(dtype):
    """The k logs a dynamic tree takes pick the ids, in the order, and the log q that the log of whole rows and then
    their top k gives: ties (bfloat16 logits tie often), rows with fewer than k tokens left (ties at zero) and the
    ensemble's floor included."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(96, 3000, generator=g) * 4).to(dtype)
    probs = torch.softmax(logits.float(), dim=-1)
    kept = torch.zeros_like(probs[::3]).scatter_(1, probs[::3].topk(3, dim=-1).indices, 1.0)
    probs[::3] *= kept  # 3 tokens left: 5 of the top 8 tie at 0
    for floor in (None, torch.finfo(torch.float64).tiny):
        values, ids = top_log_probabilities(probs, 8, floor)
        whole = torch.topk(probs.to(torch.float64).clamp_min(floor or 0.0).log(), 8, dim=-1)
        assert torch.equal(ids, whole.indices) and torch.equal(values, whole.values)
    tied = values[:, :-1] == values[:, 1:]
    assert bool(tied[::3, -4:].all())  # each such row's 5 zeros tie
    assert dtype == torch.float32 or bool(tied[1::3].any())  # bfloat16 logits tie among the likeliest


def test_rerank_keeps_the_best_as_a_tree_in_creation_order():
    #          0     1     2 (child of 0)  3 (child of 0)  4 (child of 1)  5 (child of 2)
    parents = [ROOT, ROOT, 0, 0, 1, 2]
    scores = [-0.1, -0.9, -0.3, -2.0, -1.5, -0.4]
    topology, kept = rerank(parents, scores, keep=4)
    assert kept == [0, 1, 2, 5] and topology.parents == (ROOT, ROOT, 0, 2)
    with pytest.raises(ValueError, match="without its parent"):
        rerank([ROOT, 0], [-1.0, -0.5], keep=1)  # a child scoring above its parent: not a path log-probability


def test_topology_children_and_extend():
    t = TreeTopology((ROOT, ROOT, 0, 0, 2))
    assert t.children(ROOT) == [0, 1] and t.children(0) == [2, 3] and t.children(4) == []
    assert t.extend([], [-1.0, -0.5, -2.0, -1.5, -3.0]) == [1]
    assert t.extend([0], [-1.0, -0.5, -2.0, -1.5, -3.0]) == [0, 3]
    assert t.extend([0, 2], [0.0] * 5) == [0, 2, 4]


@pytest.mark.parametrize("tree, width, message", [
    ("chain", 3, "--tree chain and --tree-width 3 disagree"),
    ("width", 1, "--tree width needs --tree-width 2 or more"),
    ("dynamic", 2, "--tree dynamic shapes its own tree"),
])
def test_tree_settings_that_disagree_are_one_line(tree, width, message):
    with pytest.raises(InputError, match=message):
        TreeSettings.resolve(tree, width)
    assert TreeSettings.resolve(None, 3).kind == "width" and TreeSettings.resolve(None, 1).kind == "chain"


# --------------------------------------------------------------------------- verification (pure)


def test_greedy_follows_the_longest_matching_path():
    # rows: 0 root; 1 '4' and 2 '5' off the root; 3 '6' and 4 '7' under row 1; 5 '1' under row 4
    parents = [-1, 0, 0, 1, 1, 4]
    tokens = [9, 4, 5, 6, 7, 1]
    logits = one_hot_logits([4, 7, 0, 0, 1, 2])  # the target wants 4, then 7, then 1, then 2
    assert verify_any_tree_greedy(parents, tokens, logits) == PathVerdict([1, 4, 5], 2)
    assert verify_any_tree_greedy(parents, tokens, one_hot_logits([3, 0, 0, 0, 0, 0])) == PathVerdict([], 3)


# a tree of deterministic candidates over 5 tokens (rows: 0 the root, then the drafted nodes)
#         row:  0   1    2    3    4    5    6    7    8
TREE_PARENTS = [-1, 0,   0,   0,   0,   1,   1,   1,   2]
TREE_TOKENS = [9,  1,   2,   4,   0,   3,   1,   4,   0]  # token 4: a candidate the target never gives
TREE_SCORES = [0.0, -0.2, -0.5, -0.7, -1.6, -0.9, -1.1, -2.0, -0.8]
DRAWS = 200_000


def any_tree_sequences(rule, target: ToyModel, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """DRAWS verifications of the tree above: row r's target distribution is the target's after the tokens on
    r's path. What ``rule`` emits (the accepted path's tokens, then its token) is completed to 3 tokens: (N, 3);
    and how many drafted tokens each verification accepted, (N,)."""
    def path_tokens(row):
        return [] if row == 0 else path_tokens(TREE_PARENTS[row]) + [TREE_TOKENS[row]]

    probs = torch.stack([target.probs(torch.tensor([path_tokens(r)], dtype=torch.long).reshape(1, -1))[0]
                         for r in range(len(TREE_PARENTS))])  # (rows, V)
    g = torch.Generator().manual_seed(seed)
    paths, next_token = rule(TREE_PARENTS, TREE_TOKENS, TREE_SCORES, probs.expand(DRAWS, -1, -1), g)
    lengths = (paths >= 0).sum(dim=1)
    return target.finish(torch.tensor(TREE_TOKENS)[paths.clamp_min(0)], lengths, next_token, g), lengths


def test_deterministic_candidates_keep_the_target_distribution():
    target = ToyModel(5, 3, seed=4, zero=4)
    sequences, accepted = any_tree_sequences(verify_any_tree_sampling_batch, target)
    assert target.p_value(sequences) > 1e-3
    assert set(accepted.tolist()) == {0, 1, 2}  # every depth of the tree was reached


def always_the_best_child(parents, tokens, scores, probs, generator):
    """Wrong: accept the best-scored child at every level, so the output follows the draft's scores."""
    rows, row = [], 0
    while children := [r for r, p in enumerate(parents) if p == row]:
        row = max(children, key=lambda r: scores[r])
        rows.append(row)
    n = probs.shape[0]
    return torch.tensor(rows).expand(n, -1), draw_rows(probs[:, row], generator)


def test_a_wrong_rule_for_deterministic_candidates_fails_the_distribution_test():
    """The test above can fail: the wrong rule gives p < 1e-6 (about 0)."""
    target = ToyModel(5, 3, seed=4, zero=4)
    sequences, _ = any_tree_sequences(always_the_best_child, target)
    assert target.p_value(sequences) < 1e-6


def test_one_verification_is_the_batched_rule_with_one_row():
    """The engine's one-tree call draws what the batched rule draws for that tree, from the same generator."""
    probs = ToyModel(5, 1, seed=6).tables[0].expand(len(TREE_PARENTS), -1)
    for i in range(30):
        one, batch = torch.Generator().manual_seed(i), torch.Generator().manual_seed(i)
        verdict = verify_any_tree_sampling(TREE_PARENTS, TREE_TOKENS, TREE_SCORES, probs, one)
        paths, next_token = verify_any_tree_sampling_batch(TREE_PARENTS, TREE_TOKENS, TREE_SCORES, probs[None], batch)
        assert verdict == PathVerdict([r for r in paths[0].tolist() if r >= 0], int(next_token[0]))
        assert torch.equal(one.get_state(), batch.get_state())


def test_the_rule_shapes_only_the_rows_its_walk_reaches():
    """Given the target's rows as a function (as the engine gives them, so that only the rows read are shaped and
    copied), the rule asks for the rows its walk stands on, one level at a time, and draws what it draws from the
    whole tensor: the same verdict and the same generator state."""
    probs = torch.stack([ToyModel(5, 1, seed=20 + r).tables[0] for r in range(len(TREE_PARENTS))])  # (rows, V)
    for i in range(60):
        asked: list[list[int]] = []

        def rows(at: torch.Tensor) -> torch.Tensor:
            asked.append(at.tolist())
            return probs[at].to(torch.float32)  # what the picker hands back: the rule copies it to float64 itself

        lazy, whole = torch.Generator().manual_seed(i), torch.Generator().manual_seed(i)
        verdict = verify_any_tree_sampling(TREE_PARENTS, TREE_TOKENS, TREE_SCORES, rows, lazy)
        assert verdict == verify_any_tree_sampling(TREE_PARENTS, TREE_TOKENS, TREE_SCORES, probs.to(torch.float32),
                                                   whole)
        assert torch.equal(lazy.get_state(), whole.get_state())
        assert asked == [[row] for row in [0, *verdict.rows]]  # the root, then each accepted row: nothing else
    with pytest.raises(TypeError, match="blocks=N"):  # a function does not say how many verifications it serves
        verify_any_tree_sampling_batch(TREE_PARENTS, TREE_TOKENS, TREE_SCORES, lambda b, r: probs[r], lazy)


# --------------------------------------------------------------------------- end to end


def decoder(models, drafter, draft="perturbed", **options):
    """γ 5 (a tree's depth bounds it), ssd at layer 1; ``options``: the tree settings, sampling, ..."""
    return speculative_decoder(models["target"], drafter, models[draft], gamma=5, build=dict(ssd_layer=1), **options)


@pytest.mark.parametrize("settings", [VISPEC, EAGLE2], ids=["vispec", "eagle2"])
@pytest.mark.parametrize("drafter", ["m", "t", "tabed", "mtp", "ssd"])
def test_greedy_equals_target_generate(tiny_models, drafter, settings):
    target = tiny_models["target"]
    generation = decoder(tiny_models, drafter, **settings).generate(tiny.images(1), [QUESTION, FOLLOW_UP])
    first = generation.turns[0]
    assert first.token_ids == reference(target, [QUESTION], [], 1)
    assert generation.turns[1].token_ids == reference(target, [QUESTION, FOLLOW_UP], [first.text], 1)
    levels = settings["tree_depth"] + 1
    for block in first.blocks:
        if block.tree:
            nodes = {tuple(b[:i]) for b in block.tree for i in range(1, len(b) + 1)}
            assert len(nodes) <= settings["tree_budget"] - 1 and max(map(len, block.tree)) <= levels
            assert block.tokens[: block.accepted] == block.draft[: block.accepted]


@pytest.mark.parametrize("n_images", [0, 2])
def test_greedy_with_images_eos_and_the_token_limit(tiny_models, n_images):
    target = tiny_models["target"]
    for max_new in (1, 2, 7):
        d = decoder(tiny_models, "m", draft="same", **VISPEC)
        turn = d.generate(tiny.images(n_images), [QUESTION], max_new_tokens=max_new).turns[0]
        assert turn.token_ids == reference(target, [QUESTION], [], n_images, max_new_tokens=max_new)


def test_dynamic_trees_raise_block_efficiency_over_chains(tiny_models):
    chain = decoder(tiny_models, "t").generate(tiny.images(1), [QUESTION]).stats.block_efficiency
    tree = decoder(tiny_models, "t", **VISPEC).generate(tiny.images(1), [QUESTION]).stats.block_efficiency
    assert tree > chain


def test_sampling_keeps_the_target_distribution(tiny_models, joint):
    """m drafting dynamic trees (budget 12, depth 3, top-k 3): ENGINE_RUNS runs against the target's exact
    distribution (tests/test_engine_sampling.py says how); the rule is tested alone above.

    What it can detect (measured when it was written, same seeds): the target's p rows shifted by one node,
    or accepting the best-scored child at every level, give p ≈ 0. (The order in which children are tried does
    not matter to the rule: reversed scores pass, p ≈ 0.8, as they should.)"""
    d = decoder(tiny_models, "m", sampling=PARAMS, **dict(VISPEC, tree_budget=12, tree_topk=3))
    counts, turns = sampled_pairs(d, ENGINE_RUNS)
    assert {turn.blocks[0].accepted for turn in turns} >= {0, 1, 2}
    assert chi_square_p_value(counts, joint, ENGINE_RUNS) > 1e-3


def test_cli_tree_flags(tiny_dirs, tmp_path):
    profile = write_profile(tmp_path / "p.yaml", tiny_dirs["target"], tiny_dirs["perturbed"], max_new_tokens=6)
    [image] = save_images(tmp_path, 1)
    args = ["generate", image, "-q", QUESTION, "--profile", profile]
    runner = CliRunner()
    assert_one_line_error(runner.invoke(app, [*args, "--tree", "bushy"]),
                          '--tree: expected one of chain, width, dynamic, got "bushy"')
    assert_one_line_error(runner.invoke(app, [*args, "--tree", "dynamic", "--tree-width", "2"]),
                          "--tree dynamic shapes its own tree")
    result = runner.invoke(app, [*args, "--tree", "dynamic", "--tree-budget", "10", "--tree-topk", "3", "--json"])
    assert result.exit_code == 0, result.stderr
    blocks = __import__("json").loads(result.stdout)["turns"][0]["blocks"]
    assert blocks[0]["tree"] and blocks[0]["draft"] in blocks[0]["tree"]



def test_every_kept_node_scores_its_path_as_the_draft_alone_would(tiny_models):
    """The tree is fed level by level through the draft's own cache: a node fed with the wrong ancestors
    would score its path otherwise than the draft run as a plain chain over that path."""
    from mmspec_cli.decoding.kv import CachedModel
    from mmspec_cli.decoding.sampling import SamplingParams, TokenPicker
    from mmspec_cli.models.prompts import render_prompt

    target, draft = tiny_models["target"], tiny_models["perturbed"]
    from mmspec_cli.decoding.drafter import DraftShape
    from mmspec_cli.decoding.engine import SpeculativeDecoder
    from tests.helpers import begin_turn

    decoder = SpeculativeDecoder(target, build_drafter("m", target, draft))
    drafter = decoder.drafter
    begin_turn(decoder, render_prompt(target.processor, [QUESTION], [], 1), tiny.images(1))
    tree = drafter.propose([], DraftShape(4, "dynamic", budget=40, topk=3), TokenPicker(SamplingParams()))
    prompt = drafter.prompt
    assert max(tree.topology.depths) >= 2  # nodes fed below other fed nodes exist
    for node in range(len(tree.tokens)):
        path = [tree.tokens[n] for n in tree.topology.path(node)]
        alone = CachedModel(draft.model, "draft", draft.image_token_id)
        logits = alone.logits(prompt.ids + path, keep=len(path) + 1, vision=prompt.vision,
                              prompt_len=len(prompt.ids))  # (len + 1, V)
        log_q = torch.log_softmax(logits[:-1].to(torch.float64), dim=-1)
        expected = float(log_q[torch.arange(len(path)), torch.tensor(path)].sum())
        assert abs(tree.scores[node] - expected) < 1e-8, (node, tree.topology.depths[node])
    # keeping an accepted path leaves exactly its fed nodes in the draft's cache, in order
    deepest = max(range(len(tree.tokens)), key=lambda n: tree.topology.depths[n])
    path = tree.topology.path(deepest)
    drafter.trees.keep_path(path)
    kept = drafter.cached.ids[len(prompt.ids):]
    assert kept == [tree.tokens[n] for n in path[: len(kept)]] and len(kept) >= len(path) - 1
    fresh = CachedModel(draft.model, "draft", draft.image_token_id)
    ids = prompt.ids + kept
    torch.testing.assert_close(drafter.cached.logits(ids, keep=1, vision=prompt.vision, prompt_len=len(prompt.ids)),
                               fresh.logits(ids, keep=1, vision=prompt.vision, prompt_len=len(prompt.ids)),
                               rtol=0, atol=1e-10)


# --------------------------------------------------------------------------- dynamic-tree flags


runner = CliRunner()
BASE = {"target": {"model": "x"}}


@pytest.mark.parametrize("decoding, overrides, fragment", [
    ({}, {"tree_budget": 10}, "--tree-budget shapes dynamic trees only, and this run drafts a chain; add --tree "
                              "dynamic, or drop it"),
    ({}, {"tree_width": 3, "tree_depth": 2}, "--tree-depth shapes dynamic trees only, and this run drafts a width "
                                             "tree; add --tree dynamic, or drop it"),
    ({"tree": "dynamic"}, {"tree": "chain", "tree_topk": 4, "tree_budget": 9},
     "--tree-budget/--tree-topk shape dynamic trees only, and this run drafts a chain; add --tree dynamic, or drop them"),
    ({"tree": "width", "tree_width": 2}, {"tree_topk": 4}, "this run drafts a width tree"),
])
def test_dynamic_tree_flags_without_a_dynamic_tree_are_refused(decoding, overrides, fragment):
    with pytest.raises(InputError) as info:
        apply_overrides(profile_from_dict({**BASE, "decoding": decoding}), **overrides)
    assert fragment in str(info.value)


def test_dynamic_tree_flags_with_a_dynamic_tree_and_a_profiles_own_settings_are_kept():
    dynamic = apply_overrides(profile_from_dict(BASE), tree="dynamic", tree_budget=10, tree_depth=2, tree_topk=3)
    assert (dynamic.decoding.tree, dynamic.decoding.tree_budget, dynamic.decoding.tree_depth,
            dynamic.decoding.tree_topk) == ("dynamic", 10, 2, 3)
    in_profile = profile_from_dict({**BASE, "decoding": {"tree": "dynamic", "tree_budget": 12}})
    assert apply_overrides(in_profile, tree_topk=4).decoding.tree_topk == 4  # the profile's tree is dynamic
    # a profile holding dynamic settings, run with --tree chain: only flags the user gave are refused
    chain = apply_overrides(in_profile, tree="chain")
    assert chain.decoding.tree == "chain" and chain.decoding.tree_budget == 12


@pytest.mark.parametrize("command", ["generate", "compare", "bench"])
def test_the_commands_refuse_them_in_one_line_before_loading(command, tiny_dirs, tmp_path, no_model_loading):
    profile = write_profile(tmp_path / "p.yaml", tiny_dirs["target"], tiny_dirs["perturbed"], max_new_tokens=4)
    [image] = save_images(tmp_path, 1)
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps({"id": "a", "images": [image], "turns": [QUESTION], "category": "c"}) + "\n")
    head = {"generate": ["generate", image, "-q", QUESTION], "compare": ["compare", image, "-q", QUESTION],
            "bench": ["bench", str(manifest), "--out", str(tmp_path / "out.jsonl")]}[command]
    result = runner.invoke(app, [*head, "--profile", profile, "--tree-depth", "2"])
    assert_one_line_error(result, "--tree-depth shapes dynamic trees only, and this run drafts a chain; add --tree "
                                  "dynamic, or drop it")
    assert not (tmp_path / "out.jsonl").exists()


def test_load_decoder_refuses_the_same_keywords(tiny_dirs, tmp_path, no_model_loading):
    from mmspec_cli.api import load_decoder

    profile = write_profile(tmp_path / "p.yaml", tiny_dirs["target"], tiny_dirs["perturbed"])
    with pytest.raises(InputError, match="--tree-topk shapes dynamic trees only"):
        load_decoder(profile, tree_topk=4)
