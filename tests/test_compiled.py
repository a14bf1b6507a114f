"""One KV state, static or dynamic, and the compiled path (``decoding.compile``, ``--compile``).

- Over the static state (preallocated, rolled back by moving a pointer), eager: every drafter and
  every tree kind gives the dynamic state's tokens, which are the target's own ``generate``'s.
- The static state is really used: the target's and the draft's caches are allocated once and
  never cropped; a decoder that finds its state used by another since starts it over.
- Compiled with inductor (the C++ wrapper): greedy output is the target's own, for chains, width
  and dynamic trees and a draft head; sampling passes the chi-square test, and a wrong rule fails it.
- Bad input: ``--compile`` where it can't compile is one line; a compile failure falls back to eager.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

from mmspec_cli.errors import MmspecError
import torch
from transformers import DynamicCache, LlamaConfig, MistralConfig, StaticCache
from typer.testing import CliRunner

from mmspec_cli.cli.app import app
from mmspec_cli.decoding import compiled as compiled_module
from mmspec_cli.decoding import step as step_module
from mmspec_cli.decoding.events import BlockVerified
from mmspec_cli.decoding.features import FeatureTrack
from mmspec_cli.decoding.kv_state import StaticKV
from mmspec_cli.drafters.head import HeadDrafter, compiled_head_step
from mmspec_cli.models.head import causal_mask
from tests import tiny
from tests.conftest import load
from tests.distributions import ENGINE_RUNS, PARAMS, chi_square_p_value, sampled_pairs
from tests.helpers import (
    FOLLOW_UP,
    QUESTION,
    assert_one_line_error,
    speculative_decoder,
    tiny_files,
)
from tests.helpers import reference
from tests.test_eagle3 import random_eagle3
from tests.test_heads import random_head

runner = CliRunner()
TURNS = [QUESTION, FOLLOW_UP]
TREES = {"chain": {}, "width": {"tree_width": 2}, "dynamic": {"tree": "dynamic", "tree_budget": 12, "tree_topk": 3}}


def run(target, drafter, draft=None, kv="dynamic", n_images=1, heads=None, **options):
    """Token ids of each of two turns; ``heads``: the head of each kind to draft with (a new random one otherwise)."""
    if drafter in ("eagle", "vispec", "eagle3"):
        drafter = HeadDrafter(target, heads[drafter] if heads else random_head(target, drafter))
    build = {"ssd_layer": 1} if drafter == "ssd" else None
    decoder = speculative_decoder(target, drafter, draft, gamma=3, kv=kv, build=build, **options)
    return [turn.token_ids for turn in decoder.generate(tiny.images(n_images), TURNS).turns]


@pytest.fixture(scope="module")
def first_turn(tiny_models):
    return reference(tiny_models["target"], [QUESTION], [], 1)


# --------------------------------------------------------------------------- the static state, eager


@pytest.mark.parametrize("tree", list(TREES))
@pytest.mark.parametrize("drafter", ["ar", "m", "t", "tabed", "ssd", "eagle"])
def test_the_static_state_gives_the_targets_own_tokens(tiny_models, first_turn, drafter, tree):
    target, draft = tiny_models["target"], tiny_models["perturbed"]
    static = run(target, drafter, draft, kv="static", **TREES[tree])
    assert static[0] == first_turn
    assert static == run(target, drafter, draft, kv="dynamic", **TREES[tree])


def caches(decoder) -> dict[str, object]:
    """Every KV cache a decoder's target and drafter hold, by owner."""
    drafter = decoder.drafter
    found = {"target": decoder.cached_target.cache}
    if hasattr(drafter, "rows"):
        found["rows"] = drafter.rows.state.cache
    elif isinstance(drafter, HeadDrafter):
        found["head"] = drafter.state.cache
    elif hasattr(drafter, "cached") and drafter.cached is not decoder.cached_target:
        found["draft"] = drafter.cached.cache
    return found


@pytest.mark.parametrize("drafter", ["m", "tabed", "eagle"])
def test_the_static_state_is_allocated_once_and_never_cropped(tiny_models, monkeypatch, drafter):
    """Every block of two turns and of a second decoder finds the same preallocated tensors; nothing is cropped."""
    target, draft = tiny_models["target"], tiny_models["perturbed"]

    def refuse(*args, **kwargs):
        raise AssertionError("a cache was cropped")

    monkeypatch.setattr(DynamicCache, "crop", refuse)
    seen = set()
    head = random_head(target, "eagle")
    for _ in range(2):
        chosen = HeadDrafter(target, head) if drafter == "eagle" else drafter
        decoder = speculative_decoder(target, chosen, draft, gamma=3, kv="static", tree_width=2)
        rejected = False
        for event in decoder.stream(tiny.images(1), TURNS):
            if not isinstance(event, BlockVerified):
                continue
            rejected = rejected or event.accepted < len(event.draft)
            for owner, cache in caches(decoder).items():
                assert isinstance(cache, StaticCache), owner
                seen.add((owner, cache.layers[0].keys.data_ptr()))
        assert rejected  # rollbacks happened
    assert len(seen) == 2  # one target state, one drafter state, for both decoders and every block
    with pytest.raises(AssertionError, match="cropped"):  # the check can fail: the dynamic state crops
        run(target, "m", draft, kv="dynamic")


def test_a_decoder_whose_state_another_used_starts_it_over(tiny_models, first_turn):
    target = tiny_models["target"]
    first = speculative_decoder(target, "ar", kv="static")
    second = speculative_decoder(target, "ar", kv="static")
    assert first.generate(tiny.images(1), [QUESTION]).turns[0].token_ids == first_turn
    assert second.generate(tiny.images(2), [QUESTION]).turns[0].token_ids  # fills the same state
    assert first.generate(tiny.images(1), [QUESTION]).turns[0].token_ids == first_turn


def test_a_head_drafter_can_be_bound_to_a_used_static_state_outside_inference_mode(tiny_models, first_turn):
    """A head's decoder resets the target's state when it binds (features from the start); the state's
    pointers were made under inference mode, where decoding grows a state."""
    target = tiny_models["target"]
    state = speculative_decoder(target, "ar", kv="static").cached_target.state
    with torch.inference_mode():
        state.room_for(state.capacity + 1)
    for _ in range(2):
        decoder = speculative_decoder(target, HeadDrafter(target, random_head(target, "eagle")), gamma=3, kv="static")
        assert decoder.generate(tiny.images(1), [QUESTION]).turns[0].token_ids == first_turn


def test_ssd_drafts_a_large_tree_near_the_end_of_a_static_state(tiny_dirs):
    """ssd drafts in a view of the target's state; a tree of many nodes near the end of its room grows the
    target's state through the view (it once raised instead). A target of its own, whose state starts at the
    smallest capacity (the session's target grew its state in the tests above, and then nothing grew here), and a
    long question: the turn's reserved room fills the smallest state, and a few blocks come near its end."""
    from mmspec_cli.decoding.engine import STATIC_SLACK
    from mmspec_cli.decoding.kv_state import MIN_CAPACITY
    from mmspec_cli.models.prompts import process, render_prompt

    target = load(tiny_dirs["target"], "target")
    question = " ".join([QUESTION] * 40)
    prompt = process(target.processor, render_prompt(target.processor, [question], [], 1), tiny.images(1)).ids
    max_new_tokens = MIN_CAPACITY - STATIC_SLACK - len(prompt)  # what the turn reserves fills the state exactly
    decoders = {kv: speculative_decoder(target, "ssd", None, gamma=3, kv=kv, build={"ssd_layer": 1}, tree="dynamic",
                                        tree_budget=10, tree_depth=3, tree_topk=64, max_new_tokens=max_new_tokens)
                for kv in ("static", "dynamic")}
    outputs = {kv: d.generate(tiny.images(1), [question]).turns[0].token_ids for kv, d in decoders.items()}
    assert outputs["static"] == outputs["dynamic"] and len(outputs["static"]) == max_new_tokens
    assert decoders["static"].cached_target.state.capacity > MIN_CAPACITY  # it grew, through the view


def test_every_owner_holds_its_state_one_way():
    """HeldState, the one type every owner keeps its KV state in: a dynamic state is its own; a static pool's one
    state is claimed at a turn's start (whether the holder's entries are still there) and must still be the holder's
    in a block (LOST_STATE, one line); moving to another pool, or to none, gives that pool's state or a fresh one."""
    from mmspec_cli.decoding.kv_state import LOST_STATE, HeldState, StaticPool
    from mmspec_cli.decoding.kv_state import DynamicKV

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=64)
    mine, theirs = HeldState(config, None, "draft"), HeldState(config, None, "draft")
    assert isinstance(mine.state, DynamicKV) and mine.state is not theirs.state and not mine.static
    assert mine.at_turn_start(10) and theirs.at_turn_start(10) and mine.in_block(10) is mine.state

    pool = StaticPool(config)
    target, other = HeldState(config, pool, "target"), HeldState(config, pool, "draft")
    assert target.state is other.state is pool.state and target.static  # one state per pool
    assert not target.at_turn_start(10)  # `other` claimed the pool last, when it was built
    assert target.at_turn_start(600) and target.state.capacity >= 600  # room made at a turn's start
    assert target.in_block(20) is pool.state
    assert not other.at_turn_start(10)  # another decoder's turn: it feeds what it needs again
    with pytest.raises(MmspecError) as raised:
        target.in_block(20)  # ... in the middle of the target's turn: said, never re-encoded in silence
    assert str(raised.value) == LOST_STATE.format(role="target")

    elsewhere = StaticPool(config)
    other.use(elsewhere)
    assert other.state is elsewhere.state and other.at_turn_start(5)
    other.use(None)
    assert isinstance(other.state, DynamicKV) and not other.static


def test_a_decoder_that_loses_its_static_state_in_a_turn_says_so(tiny_models):
    """Two decoders of one target stepped block by block would take the one static state from each other in the
    middle of a turn: the one that finds it taken stops with one line, instead of re-encoding its prompt in silence;
    turns run one after another share the state as before."""
    import itertools

    from mmspec_cli.decoding.kv_state import LOST_STATE

    target, draft = tiny_models["target"], tiny_models["perturbed"]
    ssd = {"build": {"ssd_layer": 1}}
    mine = speculative_decoder(target, "ssd", draft, gamma=3, kv="static", **ssd).stream(tiny.images(1), TURNS)
    other = speculative_decoder(target, "ar", draft, kv="static").stream(tiny.images(2), TURNS)
    with pytest.raises(MmspecError, match="used by another decoder in the middle of this turn") as raised:
        list(itertools.chain.from_iterable(itertools.zip_longest(mine, other)))
    assert str(raised.value) == LOST_STATE.format(role="target") and "\n" not in str(raised.value)


def test_a_dropped_model_is_not_kept_alive_by_its_static_state(tmp_path):
    import gc
    import weakref

    tokenizer = tiny.train_tokenizer()
    path = tiny.save(tiny.make_model(len(tokenizer), seed=5), tiny.make_processor(tokenizer), tmp_path / "m")
    target = load(path, "target")
    model = weakref.ref(target.model)
    for kv in ("static", "compiled"):
        speculative_decoder(target, "ar", kv=kv, max_new_tokens=2).generate(tiny.images(1), [QUESTION])
    del target
    gc.collect()
    assert model() is None


def test_a_static_state_grows_when_a_turn_needs_more(tiny_models, first_turn):
    target = tiny_models["target"]
    decoder = speculative_decoder(target, "ar", kv="static")
    state = decoder.cached_target.state
    state.rollback(0)
    state.room_for(state.capacity + 1)  # forces the next claim to copy what it holds into a bigger one
    assert decoder.generate(tiny.images(1), [QUESTION]).turns[0].token_ids == first_turn


def test_a_rollback_moves_every_layers_write_pointer_with_one_op_and_each_layer_still_moves_its_own():
    """On the CPU, once a static state's layers are allocated, their write pointers are the elements of one tensor
    (a rollback fills it: one op, not one per layer); a layer's write still moves its own pointer only, and a view
    over the first layers (ssd's) moves those only."""
    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
                         vocab_size=32)
    state = StaticKV(config, 16)
    entry = torch.zeros(1, 2, 1, 8)  # (batch, heads, one position, head size)
    with torch.inference_mode():
        for layer in state.cache.layers:
            layer.update(entry, entry)  # each layer's first write allocates it and moves its pointer to 1
        state.wrote(1)
        state.rollback(1)  # shares the pointers
        pointers = [layer.cumulative_length for layer in state.cache.layers]
        assert len({p.untyped_storage().data_ptr() for p in pointers}) == 1  # one tensor's elements
        state.cache.layers[1].update(entry, entry)
        assert [int(p) for p in pointers] == [1, 2, 1]
        state.rollback(0)
        assert [int(p) for p in pointers] == [0, 0, 0]
        view = state.view(2)
        view.cache.layers[0].update(entry, entry)
        view.rollback(0)
        assert [int(p) for p in pointers] == [0, 0, 0]
        for layer in view.cache.layers:
            layer.update(entry, entry)
        assert [int(p) for p in pointers] == [1, 1, 0]


def test_only_plain_static_layers_can_be_rolled_back_by_a_pointer():
    llama = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2)
    window = MistralConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                           sliding_window=4)
    assert StaticKV.supports(llama) and not StaticKV.supports(window)


def test_compiling_is_left_out_of_block_and_turn_times(monkeypatch):
    import time

    from mmspec_cli.decoding import timing

    log = compiled_module.CompileLog()
    monkeypatch.setattr(timing, "COMPILE_LOG", log)
    laps, clock = timing.Laps(), timing.TurnClock(SimpleNamespace(traits=SimpleNamespace(caption_seconds=0.0)))
    time.sleep(0.05)
    log.add("target", (8, False, 512, 1), 0.04)  # 40 of the 50 ms went to compiling
    assert 0.0 < laps.lap() < 0.03 and 0.0 < clock.decoding_s < 0.03
    assert "the target's steps (1 shape) in 0.0 s" in log.summary()


def test_what_cannot_be_compiled_is_named(tiny_models):
    from transformers import GemmaConfig, LlavaConfig

    from mmspec_cli.decoding.compiled import compile_blocker

    target = tiny_models["target"].model
    assert compile_blocker(target) is None
    gemma = LlavaConfig(text_config=GemmaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                 num_attention_heads=2, num_key_value_heads=1, head_dim=8))
    assert "its language model is gemma" in compile_blocker(SimpleNamespace(device=target.device, config=gemma))
    assert "CPU and CUDA, not meta" in compile_blocker(SimpleNamespace(device=torch.device("meta"), config=gemma))
    window = LlavaConfig(text_config=MistralConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                   num_attention_heads=2, sliding_window=4))
    assert "sliding-window" in compile_blocker(SimpleNamespace(device=target.device, config=window))


def test_the_feature_track_appends_into_a_preallocated_buffer(tiny_models):
    """Rows (embeddings, features, and the position ids they were fed at: (1, n), or M-RoPE's (3, 1, n) as rows)
    go into buffers that grow by doubling."""
    track = FeatureTrack(tiny_models["target"].model)
    rows = torch.arange(200 * 3, dtype=torch.float64).reshape(200, 3)
    at = torch.arange(200)[None, None, :].expand(3, 1, 200) + torch.tensor([0, 1, 2])[:, None, None]  # M-RoPE's rows
    track.append_rows(rows[:5], -rows[:5], at[..., :5])
    buffer = track._rows[1].data_ptr()
    for i in range(5, 60):
        track.append_rows(rows[i:i + 1], -rows[i:i + 1], at[..., i:i + 1])
    assert track._rows[1].data_ptr() == buffer  # no copy while it fits
    track.crop(40)
    track.append_rows(rows[40:200], -rows[40:200], at[..., 40:200])
    assert torch.equal(track.embeds, rows) and torch.equal(track.hidden, -rows) and len(track) == 200
    assert torch.equal(track.positions, at[:, 0, :].T)  # (200, 3): one row per position


# --------------------------------------------------------------------------- compiled (inductor)


#: Every compiled test drafts γ = 3 blocks (``run``'s): a graph is one step shape (a chain's length, a verification's
#: size), so tests at the same γ over the same models compile each graph once between them.
GAMMA = 3


def first_layer_copy(model):
    """``model`` cut to its first decoder layer (then its norm and LM head): a draft that agrees with the model often,
    not always, at half the layers of the tiny target, so half of what a graph of it costs to compile."""
    config = model.config.__class__.from_dict(model.config.to_dict())
    config.text_config.num_hidden_layers = 1
    draft = type(model)(config).to(model.dtype)
    missing, _ = draft.load_state_dict(model.state_dict(), strict=False)  # the second layer's weights are left out
    assert not missing, missing
    draft.generation_config = model.generation_config
    return draft


@pytest.fixture(scope="module")
def compiled(tiny_dirs, tmp_path_factory):
    """The compiled tests' models: the tiny target loaded again, a draft of its first layer, and a random head of
    each kind. A model's (or head's) compiled graphs and static state are its own for the process, so the tests
    below share these graphs (each takes seconds to compile here), and the states start at the smallest capacity,
    whatever the eager tests above did to the session's target (a grown state is another shape, so other graphs).
    The target keeps both layers: ``ssd`` drafts with its first."""
    target = load(tiny_dirs["target"], "target")
    path = tiny.save(first_layer_copy(target.model), target.processor, tmp_path_factory.mktemp("compiled") / "draft")
    return {"target": target, "draft": load(path, "draft"),
            "heads": {**{kind: random_head(target, kind) for kind in ("eagle", "vispec")},
                      "eagle3": random_eagle3(target)}}  # fuses the inputs of layers 1, 1 and 0


#: The greedy chains of m, t, tabed, eagle and vispec, compiled, are test_a_greedy_chain_is_one_compiled_graph_...'s.
COMPILED_CASES = [("ar", "chain"), ("m", "width"), ("eagle", "dynamic"), ("tabed", "width"), ("ssd", "chain"),
                  ("ssd", "dynamic")]
#: Compiled, a dynamic tree of 7 nodes: its verification is padded to 8, the size of the width tree's (7 nodes too),
#: so the two kinds share the target's graph.
COMPILED_TREES = {**TREES, "dynamic": {"tree": "dynamic", "tree_budget": 7, "tree_topk": 3}}


def test_compiled_greedy_is_the_targets_own_for_chains_trees_and_heads(compiled, first_turn):
    """Both turns of each case, compiled, are the dynamic state's, the first the target's own ``generate``'s. No
    graph dynamo compiles goes uncounted by the compile log (a step shape seen for the first time): nothing is
    compiled again block after block (a slice's strides once did that for the batched rows)."""
    from torch._dynamo.utils import counters

    target, draft, heads = compiled["target"], compiled["draft"], compiled["heads"]
    frames, compiles = counters["frames"]["ok"], compiled_module.LOG.compiles
    for drafter, tree in COMPILED_CASES:
        outputs = run(target, drafter, draft, kv="compiled", heads=heads, **COMPILED_TREES[tree])
        assert outputs[0] == first_turn, (drafter, tree)
        assert outputs == run(target, drafter, draft, kv="dynamic", heads=heads, **COMPILED_TREES[tree]), \
            (drafter, tree)
    step = compiled_module.compiled_forward(target.model, "target")
    assert step.failed is None
    # chains and trees: (padded size, whether a mask was passed), from each graph's trace key
    assert {(1, False), (4, False), (8, True)} <= {(key[0][1][1], key[2][0] == "tensor") for key in step.graphs.traced}
    assert {"draft", "head", "ssd draft"} <= set(compiled_module.LOG.sizes)
    assert counters["frames"]["ok"] - frames <= compiled_module.LOG.compiles - compiles


@pytest.mark.parametrize("drafter", ["m", "t", "tabed", "eagle", "vispec", "eagle3"])
def test_a_greedy_chain_is_one_compiled_graph_that_drafts_what_the_eager_chain_does(compiled, first_turn, drafter):
    """Compiled, a draft model's greedy chain (``compiled_greedy_chain``), a batch of member rows' mixed chain
    (``rows.mixture_chain``, ``tabed``), each after its first token or feeding the one verified token it lacks
    first (its lead), and a head's whole greedy chain
    (``greedy_chain``) are ONE graph each: every block's draft (and ``tabed``'s weights, chosen from the member
    distributions the chain returns) equals the eager step-by-step chain's
    over the same static state, over two turns, and the keys the draft's state holds at the end (rotated by the
    positions each entry was fed at) are the eager chain's: so the graphs' masks, positions, vocabulary cut and
    the state they leave are the eager chain's. The target's output is its own: both turns are the dynamic state's."""
    target, draft = compiled["target"], compiled["draft"]
    head = compiled["heads"].get(drafter)
    drafts, keys, tokens = {}, {}, {}
    for kv in ("static", "compiled"):
        chosen = HeadDrafter(target, head) if head is not None else drafter
        decoder = speculative_decoder(target, chosen, draft, gamma=GAMMA, kv=kv)
        turns = decoder.generate(tiny.images(1), TURNS).turns
        assert turns[0].token_ids == first_turn, kv
        tokens[kv] = [turn.token_ids for turn in turns]
        drafts[kv] = [(block.draft, block.weights) for turn in turns for block in turn.blocks]
        holder = decoder.drafter if head is not None else getattr(decoder.drafter, "rows", None) or decoder.drafter.cached
        state = holder.state
        # the real entries: a batch of rows is left-padded, and a padding slot's keys are never attended to
        real = holder.mask.bool() if hasattr(holder, "mask") else torch.ones(1, state.length, dtype=torch.bool)
        keys[kv] = [layer.keys[..., :state.length, :].transpose(1, 2)[real].clone() for layer in state.cache.layers]
    assert drafts["compiled"] == drafts["static"]
    assert tokens["compiled"] == tokens["static"] == run(target, drafter, draft, heads=compiled["heads"])  # dynamic
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(keys["compiled"], keys["static"], strict=True))
    # the compiled decoder's chain of γ tokens ran as one graph (its length is the fifth argument's value)
    chain = holder.chain if hasattr(holder, "chain") else decoder.drafter.graphs
    assert any(key[4] == (int, GAMMA) for key in chain.traced)
    none = compiled_module.trace_key((None,))[0]
    if head is not None:  # a head's graph makes its first proposal too (no eager LM head call in a block)
        assert chain.traced and all(key[0] == none and key[1] == none for key in chain.traced)
        # its catch-up's step makes its causal mask inside the graph (none passed): the drafts above are its test
        assert any(key[2] == none for key in holder.compiled.graphs.traced)
    else:  # the verified tokens the draft lacks are fed in the graph (the lead): one after a rejected draft, two
        # after a block that accepted every draft (its last, never fed, and the target's token)
        leads = {key[1][1] for key in chain.traced if key[0] == none and key[1][0] == "tensor"}
        assert leads == {(1,), (2,)}
    if drafter == "m":  # plain positions are read from the state's write pointer inside the graphs, not passed (the
        # graphs are the process's: a head's target, which records its positions, traced others)
        assert any(key[3] == none for key in chain.traced)
        assert any(key[1] == none for key in decoder.cached_target.compiled.graphs.traced)


def test_a_chain_given_no_first_proposal_makes_it_from_the_carry_or_its_lead_or_says_it_cannot():
    """``draft_chain(step, None, carry, ...)``: the first proposal from ``DraftStep.first_of(carry)`` (a head's LM
    head over its last output), or from feeding its ``lead`` (``DraftStep.catch_up``); a step without the one it
    needs is refused in one line, not called as None."""
    from mmspec_cli.decoding.chain import DraftStep, draft_chain
    from mmspec_cli.decoding.sampling import SamplingParams, TokenPicker

    def feed(token, carry, i):  # the next proposal puts its mass one id below the token fed
        return torch.nn.functional.one_hot(torch.tensor(token - 1), 4).double(), carry

    greedy = TokenPicker(SamplingParams())
    tokens, _ = draft_chain(DraftStep(feed, first_of=lambda carry: carry), None, torch.tensor([0.0, 0, 0, 5]), 3,
                            greedy)
    assert tokens == [3, 2, 1]
    with pytest.raises(TypeError, match="^draft_chain was given no first proposal, and its DraftStep has no first_of"):
        draft_chain(DraftStep(feed), None, torch.tensor([0.0, 0, 0, 5]), 3, greedy)
    # a lead (the verified tokens the state lacks) is fed eagerly by the step's catch-up, in one call, first
    fed = []

    def catch_up(lead, carry):
        fed.append(list(lead))
        return feed(lead[-1], carry, -1)

    tokens, _ = draft_chain(DraftStep(feed, catch_up=catch_up), None, None, 2, greedy, lead=[1, 3])
    assert tokens == [2, 1] and fed == [[1, 3]]
    with pytest.raises(TypeError, match="^draft_chain was given a lead, and its DraftStep has no catch_up"):
        draft_chain(DraftStep(feed), None, None, 2, greedy, lead=[3])


@pytest.mark.parametrize("drafter", ["m", "eagle"])
def test_every_static_buffer_a_compiled_decoder_writes_is_marked_static(compiled, drafter):
    """CUDA graphs replay only over buffers dynamo was told never move (``mark_static_address``). A static layer
    tells it when it allocates its buffers, unless that happens while dynamo traces: a head's first pair written
    by its compiled step made CUDA graphs skip every head step on an H100 ("mutated inputs"). The first write of
    a state runs eager, so every layer of every state is marked (on a CPU too, where this is checked). A new head:
    its state is first written here, by a compiled decoder (the shared ones' were written by the tests above)."""
    target, draft = compiled["target"], compiled["draft"]
    chosen = HeadDrafter(target, random_head(target, "eagle")) if drafter == "eagle" else drafter
    decoder = speculative_decoder(target, chosen, draft, gamma=GAMMA, max_new_tokens=6, kv="compiled")
    decoder.generate(tiny.images(1), [QUESTION])
    for owner, cache in caches(decoder).items():
        for layer in cache.layers:
            assert layer.is_initialized, owner
            assert getattr(layer.keys, "_dynamo_static_input_type", None) is not None, owner
            assert getattr(layer.cumulative_length, "_dynamo_static_input_type", None) is not None, owner


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_steps_graph_is_built_with_options_torch_compile_accepts(device):
    """``torch.compile`` refuses a ``mode`` given with ``options`` when it is called, which here is at a step's
    first call, inside the fall-back: on an H100 every CUDA step ran eager with a warning, and no CPU run showed
    it. torch checks the arguments when it is asked for the graph, which needs no GPU, so it is checked here."""
    graphs = compiled_module.CompiledGraphs(lambda x: x + 1, "target", torch.device(device))
    graphs._graph(("size", 1))  # asks torch.compile for the graph (nothing compiles yet): raises if it refuses
    options = compiled_module.compile_options(torch.device(device))
    assert options.get("triton.cudagraphs") is (True if device == "cuda" else None)
    assert options.get("cpp_wrapper") is (None if device == "cuda" else True)


def test_a_call_unlike_its_graphs_trace_gets_a_graph_of_its_own():
    """Graphs run without guards, so the key picks the graph: a call whose shape, dtype, strides or baked number
    differ from every trace so far is traced anew (its result is the eager one), never replayed on another's graph."""

    def scaled(x, times):
        return (x * times + x.sum(),)

    graphs = compiled_module.CompiledGraphs(scaled, "target", torch.device("cpu"))
    calls = [(torch.arange(4.0), 2), (torch.arange(3.0), 2), (torch.arange(4, dtype=torch.float64), 2),
             (torch.arange(8.0)[::2], 2), (torch.arange(4.0), 3), (torch.arange(4.0) + 1, 2)]
    for x, times in calls:
        torch.testing.assert_close(graphs(x, times)[0], scaled(x, times)[0], rtol=0, atol=0)
    assert len(graphs.traced) == len(calls) - 1  # the last call is like the first: its graph is replayed
    with pytest.raises(TypeError, match="no key"):
        compiled_module.trace_key((object(),))


class FirstWriteState:
    """A state whose buffers are not allocated yet: a compiled step runs its function eagerly (the same function)."""

    allocated = False
    length = 0
    cache = None

    def room_for(self, fed: int) -> None:
        pass

    def wrote(self, fed: int, kept: int | None = None) -> None:
        self.length += fed if kept is None else kept


def test_a_heads_compiled_step_given_no_mask_attends_as_the_eager_layer_does_padding_included(compiled):
    """A head's compiled step called with no mask (a catch-up's and a sampled chain step's case) makes its causal mask
    inside the graph from the write pointer: 7 entries, padded to 8, and then one entry give the outputs of the eager
    layer over a dynamic cache given the host's causal mask, and the state holds the real entries only."""
    head = compiled["heads"]["eagle"]
    device, width = head.fc.weight.device, head.input_width
    step = compiled_head_step(head, device)
    generator = torch.Generator().manual_seed(0)

    def rows(n):
        return torch.randn(1, n, width, generator=generator, dtype=torch.float64).to(device)

    state, reference = StaticKV(head.config, 256), DynamicCache(config=head.config)
    prefix = rows(5)
    with torch.inference_mode():
        head.body(prefix, torch.arange(5, device=device)[None], state.fit_mask(causal_mask(5, 0, torch.float64, device)),
                  state.cache)  # the first write allocates the state: eager
        state.wrote(5)
        head.body(prefix, torch.arange(5, device=device)[None], causal_mask(5, 0, torch.float64, device), reference)
        for n in (7, 1):
            seen, inputs = state.length, rows(n)
            positions = torch.arange(seen, seen + n, device=device)[None]
            got = step(state, inputs, positions, None)
            assert got is not None, step.failed
            expected = head.body(inputs, positions, causal_mask(n, seen, torch.float64, device), reference)
            torch.testing.assert_close(got[0], expected)
            assert state.length == seen + n == int(state.cache.layers[0].cumulative_length)
    assert {key[0][1][1] for key in step.graphs.traced if key[2] == compiled_module.trace_key((None,))[0]} >= {8, 1}


def test_a_step_returns_its_own_outputs_unless_padding_is_cut_off():
    """After a forward every op costs more than it would warm, so a step that was not padded hands back what its
    function returned, not a view of each output; a padded one cuts the padding off."""
    made = []

    def step(inputs, positions, mask, cache):
        made[:] = [inputs * 2, positions + 1]
        return tuple(made)

    compiled_step = compiled_module.CompiledStep(step, "target", torch.device("cpu"))
    unpadded = compiled_step(FirstWriteState(), torch.ones(1, 4), torch.arange(4)[None], None)
    assert all(out is mine for out, mine in zip(unpadded, made))
    padded = compiled_step(FirstWriteState(), torch.ones(1, 7), torch.arange(7)[None], None)  # padded to 8
    assert [tuple(out.shape) for out in padded] == [(1, 7), (1, 7)]
    assert padded[1].tolist() == [list(range(1, 8))]


def test_a_cpu_graph_is_traced_with_grouped_query_attention_and_keeps_it(monkeypatch):
    """transformers' SDPA attention decides at trace time whether to pass ``enable_gqa`` or to copy the key/value
    heads once per query head (a copy of the whole static cache of each layer, every step). A CPU graph is traced
    with ``enable_gqa`` and keeps it after the switch is put back; the environment is left as it was, also when two
    holders overlap and leave in either order."""
    from transformers.integrations.sdpa_attention import use_gqa_in_sdpa

    mask, key = torch.ones(1, 1, 1, 4, dtype=torch.bool), torch.zeros(1, 2, 4, 8)
    monkeypatch.setenv(compiled_module.FORCE_GQA, "1")
    if not use_gqa_in_sdpa(mask, key, key):
        pytest.skip("this transformers does not read the switch (it came in 5.23): its graphs repeat the heads")
    monkeypatch.delenv(compiled_module.FORCE_GQA)
    assert not use_gqa_in_sdpa(mask, key, key)  # what an eager forward with a mask does

    def attends_groups(x):
        return x + 1 if use_gqa_in_sdpa(mask, key, key) else x

    graphs = compiled_module.CompiledGraphs(attends_groups, "target", torch.device("cpu"))
    assert graphs.grouped_query
    assert graphs(torch.zeros(2))[0].item() == 1  # traced with the switch on
    assert compiled_module.FORCE_GQA not in os.environ
    assert graphs(torch.zeros(2))[0].item() == 1  # the graph kept it
    repeated = compiled_module.CompiledGraphs(attends_groups, "target", torch.device("cpu"))
    repeated.grouped_query = False  # what a CUDA graph does
    assert repeated(torch.zeros(2))[0].item() == 0
    monkeypatch.setenv(compiled_module.FORCE_GQA, "0")
    first, second = compiled_module.grouped_query_attention(), compiled_module.grouped_query_attention()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)  # the first leaves while the second is still inside: still on
    assert use_gqa_in_sdpa(mask, key, key)
    second.__exit__(None, None, None)
    assert os.environ[compiled_module.FORCE_GQA] == "0"


def test_compiled_sampling_keeps_the_target_distribution_and_a_wrong_rule_fails(compiled, joint, monkeypatch):
    """``t``, γ = 2, compiled: the first two tokens of ENGINE_RUNS seeded runs against the target's exact joint.
    Accepting every draft token (a wrong rule) on the same path must fail the same test."""
    target, draft = compiled["target"], compiled["draft"]  # the session's target and draft, loaded again
    decoder = speculative_decoder(target, "t", draft, gamma=2, max_new_tokens=3, sampling=PARAMS, kv="compiled")
    counts, _ = sampled_pairs(decoder, ENGINE_RUNS)
    assert chi_square_p_value(counts, joint, ENGINE_RUNS) > 1e-3

    real = step_module.verify_sampling

    def accept_all(tokens, q, p, generator):
        verdict = real(tokens, q, p, generator)
        return type(verdict)(len(tokens), verdict.next_token)

    monkeypatch.setattr(step_module, "verify_sampling", accept_all)
    counts, _ = sampled_pairs(decoder, ENGINE_RUNS)
    assert chi_square_p_value(counts, joint, ENGINE_RUNS) < 1e-3


# --------------------------------------------------------------------------- bad input and fallbacks


@pytest.fixture(scope="module")
def files(tiny_dirs, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("compiled")
    found = tiny_files(root, tiny_dirs, max_new_tokens=12)
    manifest = root / "manifest.jsonl"
    manifest.write_text("".join(json.dumps({"id": f"s{i}", "images": [found["images"][i % 2]], "turns": [QUESTION],
                                            "category": "demo"}) + "\n" for i in range(3)))
    return {**found, "manifest": str(manifest)}


def test_compile_without_a_cpp_compiler_is_one_line(files):
    import torch._inductor.config as inductor

    with inductor.patch({"cpp.cxx": ("/nonexistent/c++",)}):  # where inductor looks for its C++ compiler
        result = runner.invoke(app, ["generate", files["images"][0], "-q", QUESTION, "--profile", files["profile"],
                                     "--drafter", "m", "--compile"])
    assert_one_line_error(result, "--compile: the target model can't be compiled here: no C++ compiler")


def test_a_max_new_tokens_past_the_context_is_one_line_before_any_forward(files):
    result = runner.invoke(app, ["generate", files["images"][0], "-q", QUESTION, "--profile", files["profile"],
                                 "--drafter", "m", "--compile", "--max-new-tokens", "5000"])
    assert_one_line_error(result, "more than the target's context of 1024")
    assert "compiled" not in result.stderr


def test_profile_latency_times_the_compiled_steps_and_bench_reads_them_for_compiled_records(files, tmp_path,
                                                                                              monkeypatch):
    """``profile-latency --compile`` times the steps a compiled loop runs (they compile, once each, in the warm-up)
    and caches them apart from the eager ones; ``bench --summarize`` of records made with ``--compile`` reads that
    cache for Eq. (1), and asks for it by name while it is missing."""
    monkeypatch.setenv("MMSPEC_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "records.jsonl"
    made = runner.invoke(app, ["bench", files["manifest"], "--profile", files["profile"], "--drafters", "m",
                               "--limit", "1", "--no-warmup", "--out", str(out), "--format", "json"])
    assert made.exit_code == 0, made.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    for record in records:  # as bench --compile writes them (its compiled decoding is tested above)
        record["ensemble"] = json.dumps({**json.loads(record.get("ensemble") or "{}"), "compile": True})
    out.write_text("".join(json.dumps(record) + "\n" for record in records))
    threads = records[0]["threads"]
    missing = runner.invoke(app, ["bench", "--summarize", str(out), "--profile", files["profile"]])
    assert "no latency ratio is cached" in missing.output and "--compile`" in missing.output
    grid = ["--profile", files["profile"], "--seq", "24", "--batch", "1", "--gammas", "3", "--repeat", "3",
            "--threads", str(threads), "--json"]
    compiled_step = compiled_module.CompiledStep.__call__
    calls = []
    monkeypatch.setattr(compiled_module.CompiledStep, "__call__",
                        lambda self, *args: calls.append(self.role) or compiled_step(self, *args))
    timed = runner.invoke(app, ["profile-latency", *grid, "--compile"])
    assert timed.exit_code == 0, timed.stderr
    result = json.loads(timed.stdout)
    assert result["compiled"] and result["cache"].endswith("__compiled.json")
    assert set(result["draft_chain_ms"]) == {"1,24,2"}  # the greedy chain of γ = 3 − 1 drafted in one graph
    assert {"target", "draft"} <= set(calls) and "compiled the target's steps" in timed.stderr
    notice = timed.stderr.index("note: --compile: each step shape compiles in its warm-up")  # said before compiling
    assert notice < timed.stderr.index("compiled the target's steps")
    calls.clear()
    eager = json.loads(runner.invoke(app, ["profile-latency", *grid]).stdout)
    assert not eager["compiled"] and eager["cache"] != result["cache"] and not calls and not eager["draft_chain_ms"]
    summary = runner.invoke(app, ["bench", "--summarize", str(out), "--profile", files["profile"], "--format", "json"])
    eq1 = {row["drafter"]: row for row in json.loads(summary.stdout)["rows"] if row["category"] == "all"}
    assert eq1["m"]["latency_ratio"] == pytest.approx(result["draft_ms"]["1,24"] / result["target_ms"]["24,3"],
                                                      rel=1e-3)


def test_profile_latency_compile_that_fails_is_one_line(files, monkeypatch):
    def broken(function, **options):
        def fail(*args, **kwargs):
            raise RuntimeError("inductor could not build the graph")
        return fail

    monkeypatch.setattr(torch, "compile", broken)
    result = runner.invoke(app, ["profile-latency", "--profile", files["profile"], "--seq", "24", "--batch", "1",
                                 "--gammas", "3", "--repeat", "2", "--compile"])
    assert_one_line_error(result, "--compile: compiling the target's step failed (RuntimeError: inductor could not "
                                  "build the graph); nothing compiled is left to time, so run without --compile")


def test_a_compile_failure_in_bench_falls_back_to_eager_and_keeps_every_record(files, tmp_path, monkeypatch):
    def broken(function, **options):
        def fail(*args, **kwargs):
            raise RuntimeError("inductor could not build the graph")
        return fail

    monkeypatch.setattr(torch, "compile", broken)
    out = tmp_path / "records.jsonl"
    common = ["bench", files["manifest"], "--profile", files["profile"], "--drafters", "ar,m", "--no-warmup",
              "--format", "json"]
    result = runner.invoke(app, common + ["--compile", "--out", str(out)])
    assert result.exit_code == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if "compiling the" in line]
    assert warnings and "it runs eager from now on" in warnings[0] and len(warnings) == 2  # target, draft: once each
    compiled = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(compiled) == 6
    eager_out = tmp_path / "eager.jsonl"
    assert runner.invoke(app, common + ["--out", str(eager_out)]).exit_code == 0
    eager = [json.loads(line) for line in eager_out.read_text().splitlines()]
    key = lambda r: (r["id"], r["drafter"])  # noqa: E731
    assert sorted((key(r), r["token_ids"]) for r in compiled) == sorted((key(r), r["token_ids"]) for r in eager)
    summary = runner.invoke(app, ["bench", "--summarize", str(out), "--profile", files["profile"]])
    assert "profile-latency" in summary.output and "--compile`" in summary.output  # the compiled latencies asked for
