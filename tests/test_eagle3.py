"""EAGLE-3 heads (``eagle3``): the network's rules on their pure functions, what the cached head drafts against the
head run from scratch, and lossless decoding with it (chains, both trees, M-RoPE targets, compiled)."""

from __future__ import annotations

import pytest
import torch

from mmspec_cli.decoding.sampling import SamplingParams, TokenPicker
from mmspec_cli.drafters.head import HeadDrafter
from mmspec_cli.models.eagle3 import (Eagle3Head, default_layers, draft_vocabulary, full_vocabulary, head_config,
                                      mrope_rows, rotary_angles)
from mmspec_cli.models.head import causal_mask
from mmspec_cli.models.prompts import process, render_prompt
from mmspec_cli.decoding.drafter import DraftShape, Kept
from tests import tiny
from tests.helpers import FOLLOW_UP, QUESTION, after_block, begin_turn, chain, reference, speculative_decoder, uncached_forward

DYNAMIC = dict(tree="dynamic", tree_budget=12, tree_depth=3, tree_topk=3)
TREES = {"chain": {}, "width": dict(tree_width=2), "dynamic": DYNAMIC}


def random_eagle3(target, draft_vocab: int | None = None, seed: int = 0, device=None) -> Eagle3Head:
    """An EAGLE-3 head with random weights for ``target``, on ``device`` (default: the target's): its embedding
    copied, the draft vocabulary every other token id (so that the map from draft to target ids is not the
    identity)."""
    torch.manual_seed(seed)
    text = target.model.config.get_text_config()
    vocab = target.vocab_size
    draft_vocab = draft_vocab or vocab // 2
    head = Eagle3Head(head_config(text, vocab), default_layers(text.num_hidden_layers), draft_vocab).to(
        device=device or target.model.device, dtype=torch.float64)
    with torch.no_grad():
        head.embed_tokens.weight.copy_(target.model.get_input_embeddings().weight)
        head.lm_head.weight.mul_(4.0)  # sharpened: its argmaxes are far from ties
    head.set_vocabulary(list(range(0, 2 * draft_vocab, 2)) if 2 * draft_vocab <= vocab else range(draft_vocab))
    return head.eval()


@pytest.fixture(scope="module")
def head(tiny_models):
    return random_eagle3(tiny_models["target"])


@pytest.fixture(scope="module")
def cpu_head(tiny_models):
    """The same head on the CPU, for the rules checked on tensors made here (whatever device the engine's tests use)."""
    return random_eagle3(tiny_models["target"], device="cpu")


# --------------------------------------------------------------------------- pure rules


def test_default_layers_are_eagles_and_clamped_on_small_targets():
    assert default_layers(28) == (2, 14, 25)  # Qwen2.5-VL-7B: vLLM's (2, 14, 25)
    assert default_layers(8) == (2, 4, 5)
    assert default_layers(2) == (1, 1, 0)


def test_the_draft_vocabulary_is_the_most_frequent_answer_tokens_ascending_with_their_share():
    kept, share = draft_vocabulary({7: 5, 3: 5, 9: 1, 4: 2}, 2, 20)
    assert kept == [3, 7] and share == pytest.approx(10 / 13)  # ties: the smaller id first
    kept, share = draft_vocabulary({5: 1}, 3, 20)
    assert kept == [0, 1, 5] and share == 1.0  # padded with the smallest unseen ids


def test_draft_logits_land_on_their_target_ids_and_nowhere_else():
    target_ids = torch.tensor([1, 4, 6])
    full = full_vocabulary(torch.tensor([[0.5, 2.0, -1.0]]), target_ids, 8)
    assert full[0, [1, 4, 6]].tolist() == [0.5, 2.0, -1.0]
    assert torch.isinf(full[0, [0, 2, 3, 5, 7]]).all()
    assert int(full.argmax()) == 4


def test_sectioned_mrope_matches_qwen25_vl():
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding

    text = Qwen2_5_VLConfig(text_config=dict(hidden_size=64, num_attention_heads=2, head_dim=32, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]})).get_text_config()
    positions = torch.randint(0, 50, (3, 1, 7))
    expected, _ = Qwen2_5_VLRotaryEmbedding(text)(torch.zeros(1, dtype=torch.float64), positions)  # sections picked
    rotary = Eagle3Head(head_config(text, 10), (0,), 10).rotary
    cos, _ = rotary(torch.zeros(1, dtype=torch.float64), positions)
    torch.testing.assert_close(cos, expected)


def test_interleaved_mrope_matches_qwen3_vl():
    from transformers import Qwen3VLConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    text = Qwen3VLConfig(text_config=dict(hidden_size=64, num_attention_heads=2, head_dim=32, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [6, 5, 5],
        "mrope_interleaved": True})).get_text_config()
    positions = torch.randint(0, 50, (3, 1, 7))
    expected, _ = Qwen3VLTextRotaryEmbedding(text)(torch.zeros(1, dtype=torch.float64), positions)
    cos, _ = Eagle3Head(head_config(text, 10), (0,), 10).rotary(torch.zeros(1, dtype=torch.float64), positions)
    torch.testing.assert_close(cos, expected)
    assert mrope_rows(16, [6, 5, 5], True).tolist()[:6] == [0, 1, 2, 0, 1, 2]


def test_text_positions_on_every_mrope_row_are_1d_rope():
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 8, 2) / 8)
    flat = torch.arange(5)[None]
    rows = mrope_rows(4, [2, 1, 1], False)
    torch.testing.assert_close(rotary_angles(inv_freq, flat[None].expand(3, 1, 5), rows),
                               rotary_angles(inv_freq, flat, None))


def test_the_layer_keeps_the_raw_hidden_stream_as_its_residual(cpu_head):
    """EAGLE-3's layer: attention reads cat(input_layernorm(e), hidden_norm(x)), the residual is x itself (vLLM's
    ``norm_before_residual: false``)."""
    head = cpu_head
    torch.manual_seed(1)
    hidden = head.config.hidden_size
    inputs = torch.randn(1, 3, 2 * hidden, dtype=torch.float64)
    layer = head.midlayer
    embeds, x = inputs[..., :hidden], inputs[..., hidden:]
    normed = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(x)], dim=-1)
    rope = head.rotary(inputs, torch.arange(3)[None])
    attended, _ = layer.self_attn(normed, position_embeddings=rope, attention_mask=causal_mask(3, 0, torch.float64,
                                                                                                "cpu"))
    after = x + attended
    expected = after + layer.mlp(layer.post_attention_layernorm(after))
    torch.testing.assert_close(head.body(inputs, torch.arange(3)[None], causal_mask(3, 0, torch.float64, "cpu")),
                               expected)


# --------------------------------------------------------------------------- what the head drafts


def reference_chain(head, target, prompt, generated, tokens):
    """The head's distributions (γ, V) along the drafted ``tokens``, from scratch at every step: the target's layer
    inputs from ONE uncached forward, no head cache; a drafted entry's feature is the head's own output at its
    parent, its position the last one + 1 (1-D positions: the LLaVA target's own)."""
    verified = prompt.ids + generated
    with torch.no_grad():
        out = uncached_forward(target.model, verified, prompt.vision, output_hidden_states=True)
    fused = head.fc(torch.cat([out.hidden_states[k][0] for k in head.layers_read], dim=-1))[:-1]  # pairs 0 .. n − 2
    ids, xs, dists, device = list(verified), fused, [], head.fc.weight.device
    for token in tokens:
        embeds = head.embed_tokens(torch.tensor(ids[1:], device=device))
        inputs = torch.cat([embeds, xs], dim=-1)
        n = inputs.shape[0]
        h = head.body(inputs[None], torch.arange(n, device=device)[None], causal_mask(n, 0, torch.float64, device))[0]
        dists.append(torch.softmax(head.logits(h[-1]), dim=-1))
        ids.append(token)
        xs = torch.cat([xs, h[-1:]])
    return torch.stack(dists)


@pytest.mark.parametrize("n_images", [0, 2])
def test_the_cached_draft_is_the_head_run_from_scratch(tiny_models, head, n_images):
    target = tiny_models["target"]
    text = render_prompt(target.processor, [QUESTION], [], n_images)
    prompt = process(target.processor, text, tiny.images(n_images))
    decoder = speculative_decoder(target, HeadDrafter(target, head))
    drafter = decoder.drafter
    begin_turn(decoder, text, tiny.images(n_images))
    picker = TokenPicker(SamplingParams(temperature=1.0), seed=0)  # sampling: the draft carries its distributions
    generated = reference(target, [QUESTION], [], n_images, max_new_tokens=3)
    for verified in ([], generated):  # a turn's first block, then one after the target accepted 3 tokens
        if verified:
            after_block(decoder, prompt, verified)
        draft = drafter.propose(verified, chain(4), picker)
        torch.testing.assert_close(draft.probs, reference_chain(head, target, prompt, verified, draft.tokens),
                                   rtol=0, atol=1e-10)
        assert all(bool(head.t2d[t]) for t in draft.tokens)  # only draft-vocabulary tokens are proposed
    drafter.roll_back(Kept(0))
    assert drafter.cache.get_seq_length() == drafter.entries


def test_every_dynamic_tree_node_scores_its_path_as_the_head_alone_would(tiny_models, head):
    target = tiny_models["target"]
    text = render_prompt(target.processor, [QUESTION], [], 1)
    prompt = process(target.processor, text, tiny.images(1))
    decoder = speculative_decoder(target, HeadDrafter(target, head))
    begin_turn(decoder, text, tiny.images(1))
    tree = decoder.drafter.propose([], DraftShape(4, "dynamic", budget=30, topk=3), TokenPicker(SamplingParams()))
    assert max(tree.topology.depths) >= 2
    for node in range(len(tree.tokens)):
        path = [tree.tokens[n] for n in tree.topology.path(node)]
        dists = reference_chain(head, target, prompt, [], path)
        expected = float(torch.log(dists[torch.arange(len(path)), torch.tensor(path)]).sum())
        assert abs(tree.scores[node] - expected) < 1e-8, node


# --------------------------------------------------------------------------- losslessness


@pytest.mark.parametrize("tree", list(TREES))
@pytest.mark.parametrize("n_images", [0, 2])
def test_greedy_equals_target_generate_over_two_turns(tiny_models, head, tree, n_images):
    target = tiny_models["target"]
    decoder = speculative_decoder(target, HeadDrafter(target, head), **TREES[tree])
    generation = decoder.generate(tiny.images(n_images), [QUESTION, FOLLOW_UP])
    first = generation.turns[0]
    assert first.token_ids == reference(target, [QUESTION], [], n_images)
    assert generation.turns[1].token_ids == reference(target, [QUESTION, FOLLOW_UP], [first.text], n_images)


# --------------------------------------------------------------------------- training


def test_the_unroll_mask_is_causal_then_diagonal():
    from mmspec_cli.training.eagle3 import ttt_mask

    mask = ttt_mask(3, 2)
    assert mask.int().tolist() == [[1, 0, 0, 1, 0, 0, 1, 0, 0],
                                   [1, 1, 0, 0, 1, 0, 0, 1, 0],
                                   [1, 1, 1, 0, 0, 1, 0, 0, 1]]


def test_each_unrolled_step_is_what_drafting_feeds(cpu_head):
    """Step k at index p of the training-time test == the k-th drafted entry after token p, fed as drafting feeds it:
    step 0's entries ≤ p, then each drafted entry with its parent's output, the next token's embedding, the next
    position, seeing everything before it."""
    from mmspec_cli.training.eagle3 import Eagle3Sequence, unrolled

    head = cpu_head
    torch.manual_seed(3)
    hidden, width = head.config.hidden_size, head.fc.in_features
    n_ids = 9
    seq = Eagle3Sequence(ids=torch.randint(0, head.config.vocab_size, (n_ids,)).tolist(), prompt_len=3,
                         features=torch.randn(n_ids, width), hidden=torch.randn(n_ids, hidden),
                         positions=torch.arange(n_ids)[:, None] + 5)
    steps = [h.detach() for h in unrolled(head, seq, 3)]
    ids, fused = torch.tensor(seq.ids), head.fc(seq.features.to(torch.float64))
    for p in range(n_ids - 3):
        inputs = torch.cat([head.embed_tokens(ids[1:p + 2]), fused[:p + 1]], dim=-1)
        positions = torch.arange(p + 1) + 5
        x = head.body(inputs[None], positions[None], causal_mask(p + 1, 0, torch.float64, "cpu"))[0][-1]
        for k in (1, 2):  # the k-th drafted entry: its parent's output, the embedding of token p + 1 + k
            inputs = torch.cat([inputs, torch.cat([head.embed_tokens(ids[p + 1 + k:p + 2 + k]), x[None]], dim=-1)])
            positions = torch.cat([positions, positions[-1:] + 1])
            n = inputs.shape[0]
            x = head.body(inputs[None], positions[None], causal_mask(n, 0, torch.float64, "cpu"))[0][-1]
            torch.testing.assert_close(x, steps[k][p], rtol=0, atol=1e-10)


# --------------------------------------------------------------------------- sampling


def guessing_eagle3(target) -> Eagle3Head:
    """A random EAGLE-3 head whose draft vocabulary is the target's 4 likeliest tokens after the test prompt: its q then
    puts all its mass on tokens the target (sampling with top-k 4) may say, yet differs from p, and is 0 at every
    other id: a q read at the wrong ids, or drawn from over the wrong tokens, shows in the counts."""
    prompt = process(target.processor, render_prompt(target.processor, [QUESTION], [], 1), tiny.images(1))
    with torch.no_grad():
        logits = uncached_forward(target.model, prompt.ids, prompt.vision).logits[0, -1]
    head = random_eagle3(target, draft_vocab=4)
    head.set_vocabulary(logits.topk(4).indices.tolist())
    return head


def test_sampling_keeps_the_target_distribution(tiny_models, joint):
    """eagle3 chains of γ = 2 from :func:`guessing_eagle3`: ENGINE_RUNS runs against the target's exact distribution
    of its first two tokens (tests/test_engine_sampling.py says how). The head's q is over its four draft tokens,
    scattered into the target's vocabulary with zeros everywhere else, which the rule's residual must handle. It
    checks the whole path end to end; it is too weak to see a swap of the two drafted tokens' q rows (both are over
    the same four tokens: measured, it still passes), which the rule's own tests in test_verify.py catch."""
    from tests.distributions import ENGINE_RUNS, PARAMS, chi_square_p_value, sampled_pairs

    target = tiny_models["target"]
    decoder = speculative_decoder(target, HeadDrafter(target, guessing_eagle3(target)), gamma=2, max_new_tokens=3,
                                  sampling=PARAMS)
    counts, turns = sampled_pairs(decoder, ENGINE_RUNS)
    assert {turn.blocks[0].accepted for turn in turns} == {0, 1, 2}
    assert chi_square_p_value(counts, joint, ENGINE_RUNS) > 1e-3


def test_each_unrolled_step_is_scored_against_the_token_it_drafts():
    """Step k's entry at index p is scored against the target's distribution of token p + k + 2 (the target's logits
    at p + k + 1) over the draft vocabulary, only on answer tokens whose target argmax lies in it; the steps'
    means weighted 0.8^k: the objective against a sum written out entry by entry."""
    from transformers import LlamaConfig

    from mmspec_cli.training.eagle3 import Eagle3Objective, Eagle3Sequence, unrolled

    torch.manual_seed(0)
    vocab, hidden, n_ids, prompt_len, steps = 50, 32, 10, 4, 3
    text = LlamaConfig(hidden_size=hidden, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=vocab)
    head = Eagle3Head(head_config(text, vocab), (1, 2, 3), 20).double()
    head.set_vocabulary(range(0, 40, 2))
    lm_head = torch.nn.Linear(hidden, vocab, bias=False).double()
    seq = Eagle3Sequence(ids=torch.randint(0, vocab, (n_ids,)).tolist(), prompt_len=prompt_len,
                         features=torch.randn(n_ids, 3 * hidden), hidden=torch.randn(n_ids, hidden),
                         positions=torch.arange(n_ids)[:, None])
    loss, stats = Eagle3Objective(head, lm_head, steps)([seq])
    expected, scored = 0.0, []
    for k, h in enumerate(unrolled(head, seq, steps)):
        terms = []
        for p in range(n_ids - 1):
            token = p + k + 2
            if not prompt_len <= token < n_ids:
                continue
            logits = lm_head(seq.hidden[token - 1].double())
            if not bool(head.t2d[logits.argmax()]):
                continue
            wanted = torch.softmax(logits[head.target_ids], dim=-1)
            terms.append(-(wanted * torch.log_softmax(head.lm_head(head.norm(h[p])), dim=-1)).sum())
        scored.append(len(terms))
        if terms:
            expected = expected + 0.8 ** k * torch.stack(terms).mean()
    assert [s["positions"] for s in stats] == scored and min(scored) > 0
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-12)
