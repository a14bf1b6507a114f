"""The batched ensemble inside the engine: rows equal members run alone, and decoding stays lossless."""

from __future__ import annotations


import pytest
import torch

from tests import tiny
from mmspec_cli.drafters.captioner import Captioner
from mmspec_cli.drafters import build_drafter
from mmspec_cli.drafters.weights import mixture
from mmspec_cli.drafters.rows import BatchedRows, Row
from mmspec_cli.drafters.single import SingleModelDrafter, multimodal_view, text_only_view
from mmspec_cli.drafters.views import caption_row, pooled_row
from mmspec_cli.decoding.drafter import TurnStart
from mmspec_cli.decoding.engine import SpeculativeDecoder
from mmspec_cli.models.profiles import EnsembleSpec
from mmspec_cli.models.loading import load_model
from mmspec_cli.models.profiles import ModelSpec
from mmspec_cli.models.prompts import process, render_prompt

from tests.helpers import MAX_NEW, QUESTION, speculative_decoder
from tests.helpers import reference
from tests.distributions import ENGINE_RUNS, PARAMS, chi_square_p_value, sampled_pairs


@pytest.fixture(scope="module")
def captioner(tiny_models):
    return Captioner(tiny_models["perturbed"], max_new_tokens=6)


def decoder(models, name, captioner, policy=EnsembleSpec(), draft="perturbed", target="target", **options):
    """``name`` drafted over the perturbed draft (pooling kernel 2); ``options``: γ, sampling, ..."""
    return speculative_decoder(models[target], name, models[draft],
                               build=dict(ensemble=policy, captioner=captioner, pool_kernel=2), **options)


@pytest.fixture(scope="module")
def refs(tiny_models):
    return {n: reference(tiny_models["target"], [QUESTION], [], n) for n in (0, 1, 2)}


@pytest.mark.parametrize("name", ["c", "p", "mt", "mtcp", "tabed", "tabed:mtcp"])
@pytest.mark.parametrize("gamma", [1, 5])
@pytest.mark.parametrize("n_images", [0, 1, 2])
def test_greedy_equals_target_generate(tiny_models, refs, captioner, name, gamma, n_images):
    generation = decoder(tiny_models, name, captioner, gamma=gamma).generate(tiny.images(n_images), [QUESTION])
    assert generation.turns[0].token_ids == refs[n_images]


@pytest.mark.parametrize("policy", [
    EnsembleSpec(policy="grid"), EnsembleSpec(policy="grid", labels="hard", distance="tvd", window=3),
    EnsembleSpec(policy="softmax"), EnsembleSpec(policy="softmax", labels="hard", tau=0.5),
    EnsembleSpec(policy="adaboost"), EnsembleSpec(policy="random"), EnsembleSpec(policy="static"),
], ids=lambda p: f"{p.policy}-{p.labels}-{p.distance}")
def test_every_tabed_policy_is_lossless(tiny_models, refs, captioner, policy):
    generation = decoder(tiny_models, "tabed:mtp", captioner, policy=policy, gamma=4).generate(tiny.images(1), [QUESTION])
    turn = generation.turns[0]
    assert turn.token_ids == refs[1]
    weights = [b.weights for b in turn.blocks if b.weights is not None]
    assert weights[0] == pytest.approx([1 / 3] * 3)  # the first block uses equal weights
    assert all(sum(w) == pytest.approx(1.0) for w in weights)


def test_two_turns_keep_the_batched_heads(tiny_models, captioner):
    t = tiny_models["target"]
    dec = decoder(tiny_models, "tabed", captioner)
    prefills = []
    original = BatchedRows._prefill
    dec.drafter.rows._prefill = lambda rows: (prefills.append(len(rows)), original(dec.drafter.rows, rows))
    first, second = dec.generate(tiny.images(1), [QUESTION, "and then?"]).turns
    assert second.token_ids == reference(t, [QUESTION, "and then?"], [first.text], 1)
    assert prefills == [2]  # the second turn extended the rows instead of prefilling again


def test_batched_rows_equal_each_member_run_alone(tmp_path_factory, tiny_dirs, captioner):
    """float32 draft; ≥ 10 blocks with rollbacks; every step's per-member q compared with that member alone."""
    draft = load_model(ModelSpec(model=tiny_dirs["perturbed"], dtype="float32", device="cpu"), "draft")
    target = load_model(ModelSpec(model=tiny_dirs["target"], dtype="float64", device="cpu"), "target")
    drafter = build_drafter("mtcp", target, draft, captioner=captioner, pool_kernel=2)
    images = tiny.images(2)
    text = render_prompt(target.processor, [QUESTION], [], 2)
    blocks = []
    propose = drafter.propose

    def recording(generated, shape, picker):
        out = propose(generated, shape, picker)
        blocks.append((list(generated), list(out.tokens), drafter._block_q.clone()))
        return out

    drafter.propose = recording
    turn = SpeculativeDecoder(target, drafter, gamma=3, max_new_tokens=48).generate(images, [QUESTION]).turns[0]
    assert len(blocks) >= 10 and any(b.accepted < len(b.draft) for b in turn.blocks)  # rollbacks happened

    vocab = target.vocab_size
    alone = {
        "m": SingleModelDrafter("m", draft, multimodal_view(draft), vocab),
        "t": SingleModelDrafter("t", draft, text_only_view(draft), vocab),
    }
    single_rows = {"c": caption_row(draft, captioner), "p": pooled_row(draft, 2)}
    for d in alone.values():
        d.begin_turn(TurnStart(text, images, SpeculativeDecoder(target, d).cached_target, 0,
                               process(target.processor, text, images)))
    rows = {k: BatchedRows(draft.model, draft.image_token_id) for k in single_rows}
    prefixes = {k: rows[k].begin([view(text, images)]) for k, view in single_rows.items()}
    for generated, tokens, block_q in blocks:
        for step in range(len(tokens)):
            context = generated + tokens[:step]
            for k, member in enumerate(drafter.traits.members):
                if member in alone:
                    d = alone[member]
                    logits = d.cached.logits(d.prompt.ids + context, 1, d.prompt.vision)[-1]
                else:
                    logits = rows[member].logits(prefixes[member] + context)[0]
                expected = torch.softmax(logits.float(), -1)
                assert torch.allclose(block_q[step, k], expected, atol=1e-6), (member, step)


@pytest.mark.parametrize("kv", ["dynamic", "static"])
def test_rows_rolled_back_see_only_what_they_hold(kv):
    """After a rollback the rows' keys hide the columns that went: a static state keeps their entries, which the next
    step must not see (a rollback that left them shown changes these logits by far more than 1e-9). Rolling back to more
    than is held, with a tree pending, keeps what is held."""
    model = tiny.make_model(400, seed=0).eval()
    prefixes = [Row(ids=[10, 11, 12, 13, 14]), Row(ids=[20, 21, 22])]  # left-padded by two
    rows = BatchedRows(model, 4, kv=kv)
    rows.begin(prefixes)
    rows.reserve(16)
    rows.logits([30, 31])
    rows.extend([40, 41, 42])
    rows.rollback(2)  # keep [30, 31]
    after = rows.extend([50])
    fresh = BatchedRows(model, 4)  # dynamic, fed straight
    fresh.begin(prefixes)
    torch.testing.assert_close(after, fresh.logits([30, 31, 50]), rtol=0, atol=1e-9)
    rows.tree_logits([60, 61], [-1, -1])
    held = (rows.held, rows.mask.shape[1])
    rows.rollback(rows.held + 3)
    assert (rows.held, rows.mask.shape[1]) == held
    torch.testing.assert_close(rows.extend([70]), fresh.logits([30, 31, 50, 70]), rtol=0, atol=1e-9)


def test_sampled_pairs_follow_the_target_distribution(tiny_models, captioner, joint):
    """tabed (members m and t mixed, weights re-chosen from the second block on), chains of γ = 2: ENGINE_RUNS
    runs against the target's exact distribution (tests/test_engine_sampling.py says how).

    What it can detect (measured when it was written, same seeds): handing the rule the mixture's rows in
    reverse order gives p ≈ 2e-15, accepting every draft token p ≈ 0. One member's q instead of the mixture
    would pass the chi-square here (p ≈ 0.06: m and t draft much alike), so every block's q is also checked
    to be the mixture of the members' distributions with the block's weights (the members' distributions
    are checked against each member run alone in test_batched_rows_equal_each_member_run_alone)."""
    dec = decoder(tiny_models, "tabed", captioner, gamma=2, max_new_tokens=3, sampling=PARAMS)
    drafts = []
    propose = dec.drafter.propose

    def recording(generated, shape, picker):
        draft = propose(generated, shape, picker)
        drafts.append((draft, dec.drafter._block_q))
        return draft

    dec.drafter.propose = recording
    counts, turns = sampled_pairs(dec, ENGINE_RUNS)
    for draft, member_q in drafts:  # (γ, V) handed to the rule == Σ_k w_k q_k, (γ, m, V) mixed by (m,)
        torch.testing.assert_close(draft.probs, mixture(member_q, torch.tensor(draft.weights)), rtol=0, atol=1e-12)
    assert {turn.blocks[0].accepted for turn in turns} == {0, 1, 2}
    assert any(b.weights != pytest.approx([0.5, 0.5]) for turn in turns for b in turn.blocks)  # adapted weights
    assert chi_square_p_value(counts, joint, ENGINE_RUNS) > 1e-3


def test_captions_are_computed_once_per_image(tiny_models):
    cap = Captioner(tiny_models["perturbed"], prompt="Caption this.", max_new_tokens=4)
    calls = []
    original = cap._generate
    cap._generate = lambda image: (calls.append(1), original(image))[1]
    img = tiny.images(1)[0]
    first = cap.caption(img)
    assert cap.caption(img.copy()) == first and len(calls) == 1  # same pixels, new object: cached
    cap.caption(tiny.images(2)[1])
    assert len(calls) == 2 and cap.seconds > 0


def test_captioning_beside_the_target_prefill_changes_nothing_and_is_timed(tiny_models, refs):
    """The CUDA path (captions in a thread while the target prefills), forced on CPU."""
    target = tiny_models["target"]
    cap = Captioner(tiny_models["perturbed"], prompt="Name the colours.", max_new_tokens=5)
    drafter = build_drafter("tabed:mc", target, tiny_models["perturbed"], captioner=cap)
    decoder = SpeculativeDecoder(target, drafter, gamma=3, max_new_tokens=MAX_NEW, overlap_prefill=True)
    first = decoder.generate(tiny.images(1), [QUESTION]).turns[0]
    assert first.token_ids == refs[1]
    assert first.caption_s > 0  # reported apart from decoding
    again = decoder.generate(tiny.images(1), [QUESTION]).turns[0]
    assert again.token_ids == refs[1] and again.caption_s == 0.0  # cached caption: no captioning time


def test_a_decode_steps_row_mask_is_the_last_row_of_a_longer_steps():
    """Batched rows' additive mask for one fresh position hides the left padding only: the last row of the mask of
    two fresh positions, whose first row also hides the last key."""
    from mmspec_cli.drafters.rows import additive_step_mask

    padded = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1]])
    for dtype in (torch.float32, torch.float64):
        two = additive_step_mask(padded, 2, dtype)  # (B, 1, 2, L)
        torch.testing.assert_close(additive_step_mask(padded, 1, dtype), two[:, :, -1:, :], rtol=0, atol=0)
        assert (two[:, 0, 0, -1] == torch.finfo(dtype).min).all()
