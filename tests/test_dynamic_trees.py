"""EAGLE-2 dynamic draft trees (``--tree dynamic``): the selection maths, the rules for trees of any shape,
and losslessness end to end for every drafter that drafts trees."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from typer.testing import CliRunner

from mmspec_cli.cli.app import app
from mmspec_cli.decoding import step as step_module
from mmspec_cli.decoding.engine import SpeculativeDecoder
from mmspec_cli.decoding.tree import ROOT, TreeSettings, TreeTopology, best, rerank, top_children
from mmspec_cli.decoding.verify import PathVerdict, verify_any_tree_greedy, verify_any_tree_sampling
from mmspec_cli.drafters import build_drafter
from mmspec_cli.errors import InputError
from tests import tiny
from tests.helpers import save_images, write_profile
from tests.helpers import assert_one_line_error
from tests.test_engine_greedy import FOLLOW_UP, MAX_NEW, QUESTION, reference
from tests.test_engine_sampling import PARAMS, chi_square_p_value, exact_joint

VISPEC = dict(tree="dynamic", tree_budget=30, tree_depth=3, tree_topk=8)
EAGLE2 = dict(tree="dynamic", tree_budget=60, tree_depth=5, tree_topk=10)


# --------------------------------------------------------------------------- selection (pure)


def test_top_children_score_whole_paths():
    log_q = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]], dtype=torch.float64))
    rows, tokens, scores = top_children(log_q, torch.tensor([0.0, -1.0], dtype=torch.float64), k=2)
    assert rows == [0, 0, 1, 1] and tokens == [0, 1, 2, 0]
    torch.testing.assert_close(torch.tensor(scores), torch.tensor([0.5, 0.3, 0.8, 0.1]).log()
                               + torch.tensor([0.0, 0.0, -1.0, -1.0]), rtol=0, atol=1e-12)
    assert best([-1.0, -0.5, -0.5, -2.0], 2) == [1, 2]  # ties: the earlier first


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


def one_hot(ids, vocab=8):
    logits = torch.full((len(ids), vocab), -5.0)
    logits[torch.arange(len(ids)), torch.tensor(ids)] = 5.0
    return logits


def test_greedy_follows_the_longest_matching_path():
    # rows: 0 root; 1 '4' and 2 '5' off the root; 3 '6' and 4 '7' under row 1; 5 '1' under row 4
    parents = [-1, 0, 0, 1, 1, 4]
    tokens = [9, 4, 5, 6, 7, 1]
    logits = one_hot([4, 7, 0, 0, 1, 2])  # the target wants 4, then 7, then 1, then 2
    assert verify_any_tree_greedy(parents, tokens, logits) == PathVerdict([1, 4, 5], 2)
    assert verify_any_tree_greedy(parents, tokens, one_hot([3, 0, 0, 0, 0, 0])) == PathVerdict([], 3)


def test_deterministic_candidates_keep_the_target_distribution():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.05, 0.4, 0.25, 0.2, 0.1], dtype=torch.float64)
    parents, tokens = [-1, 0, 0, 0], [9, 2, 1, 4]  # three candidates off the root, tried by score
    scores = [0.0, -0.2, -0.5, -1.0]
    counts: Counter = Counter()
    for _ in range(20000):
        verdict = verify_any_tree_sampling(parents, tokens, scores, p[None].expand(4, -1), g)
        counts[(tokens[verdict.rows[0]],) if verdict.rows else (verdict.next_token,)] += 1
    expected = {(i,): float(v) for i, v in enumerate(p)}
    assert chi_square_p_value(counts, expected, 20000) > 1e-3


# --------------------------------------------------------------------------- end to end


def decoder(models, drafter, draft="perturbed", sampling=None, **tree):
    target = models["target"]
    kwargs = {} if sampling is None else {"sampling": sampling}
    made = build_drafter(drafter, target, None if drafter == "ssd" else models[draft], ssd_layer=1)
    return SpeculativeDecoder(target, made, gamma=5, max_new_tokens=MAX_NEW, **kwargs, **tree)


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


DYNAMIC_RUNS = 1000  # fewer runs than the chain tests: a dynamic tree block costs more here


def sampled_pairs(models, drafter):
    d = decoder(models, drafter, sampling=PARAMS, **dict(VISPEC, tree_budget=12, tree_topk=3))
    counts: Counter = Counter()
    for seed in range(DYNAMIC_RUNS):
        counts[tuple(d.generate(tiny.images(1), [QUESTION], max_new_tokens=3, seed=seed).turns[0].token_ids[:2])] += 1
    return counts


@pytest.fixture(scope="module")
def joint(tiny_models):
    return exact_joint(tiny_models["target"])


def test_sampling_keeps_the_target_distribution(tiny_models, joint):
    assert chi_square_p_value(sampled_pairs(tiny_models, "m"), joint, DYNAMIC_RUNS) > 1e-3


def test_the_distribution_test_catches_a_wrong_tree_rule(tiny_models, joint, monkeypatch):
    """Accept the best-scored child at every level: the output then follows the draft's top-k."""
    def always_first(parents, tokens, scores, probs, generator):
        rows, row = [], 0
        while children := [r for r, p in enumerate(parents) if p == row]:
            row = max(children, key=lambda r: scores[r])
            rows.append(row)
        return PathVerdict(rows, int(torch.multinomial(probs[row].cpu(), 1, generator=generator)))

    monkeypatch.setattr(step_module, "verify_any_tree_sampling", always_first)
    assert chi_square_p_value(sampled_pairs(tiny_models, "m"), joint, DYNAMIC_RUNS) < 1e-6


def test_cli_tree_flags(tiny_dirs, tmp_path):
    profile = write_profile(tmp_path / "p.yaml", tiny_dirs["target"], tiny_dirs["perturbed"], max_new_tokens=6)
    [image] = save_images(tmp_path, 1)
    args = ["generate", image, "-q", QUESTION, "--profile", profile]
    runner = CliRunner()
    assert_one_line_error(runner.invoke(app, [*args, "--tree", "bushy"]),
                          '--tree: expected one of null, chain, width, dynamic, got "bushy"')
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
    drafter = build_drafter("m", target, draft)
    drafter.begin_turn(render_prompt(target.processor, [QUESTION], [], 1), tiny.images(1))
    tree = drafter.propose_dynamic_tree([], levels=4, budget=40, topk=3, picker=TokenPicker(SamplingParams()))
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
    drafter.keep_path(path)
    kept = drafter.runner.ids[len(prompt.ids):]
    assert kept == [tree.tokens[n] for n in path[: len(kept)]] and len(kept) >= len(path) - 1
    fresh = CachedModel(draft.model, "draft", draft.image_token_id)
    ids = prompt.ids + kept
    torch.testing.assert_close(drafter.runner.logits(ids, keep=1, vision=prompt.vision, prompt_len=len(prompt.ids)),
                               fresh.logits(ids, keep=1, vision=prompt.vision, prompt_len=len(prompt.ids)),
                               rtol=0, atol=1e-10)
