"""Draft heads over the target's own features (``eagle``, ``vispec``): what they draft, that decoding with them
is lossless, and how their checkpoints load (strictly, in ViSpec's published layout too)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from mmspec_cli.decoding.features import tap_for
from mmspec_cli.decoding.kv_state import StaticKV
from mmspec_cli.decoding.sampling import SamplingParams, TokenPicker
from mmspec_cli.drafters import build_drafter
from mmspec_cli.drafters.head import HeadDrafter, entries_mask
from mmspec_cli.errors import InputError, ModelLoadError
from mmspec_cli.models.head import DraftHead, causal_mask, head_sequence, image_runs
from mmspec_cli.models.head_files import head_config, load_head, save_head
from mmspec_cli.models.profiles import profile_from_dict
from mmspec_cli.models.prompts import process, render_prompt
from tests import tiny
from tests.helpers import FOLLOW_UP, QUESTION, after_block, begin_turn, chain, speculative_decoder, uncached_forward
from mmspec_cli.decoding.drafter import DraftShape, Kept
from tests.helpers import reference
from tests.distributions import ENGINE_RUNS, PARAMS, chi_square_p_value, sampled_pairs

KINDS = ["eagle", "vispec"]
DYNAMIC = dict(tree="dynamic", tree_budget=12, tree_depth=3, tree_topk=3)
TREES = {"chain": {}, "width": dict(tree_width=2), "dynamic": DYNAMIC}


def random_head(target, kind: str, seed: int = 0) -> DraftHead:
    """A head with random weights for ``target`` (its embedding table copied, as training starts)."""
    torch.manual_seed(seed)
    head = DraftHead(head_config(target), kind).to(device=target.model.device, dtype=torch.float64)
    with torch.no_grad():
        head.embed_tokens.weight.copy_(target.model.get_input_embeddings().weight)
        if kind == "vispec":
            head.img_fc.weight.add_(0.1 * torch.randn_like(head.img_fc.weight))  # g must matter in these tests
    return head.eval()


@pytest.fixture(scope="module")
def head_dirs(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    target = tiny_models["target"]
    dirs = {}
    for kind in KINDS:
        dirs[kind] = root / kind
        save_head(random_head(target, kind), dirs[kind], target="tiny-target", dtype=torch.float64)
    return dirs


@pytest.fixture(scope="module")
def heads(tiny_models, head_dirs):
    return {kind: load_head(str(path), kind, None, tiny_models["target"]) for kind, path in head_dirs.items()}


def head_decoder(target, head, **options):
    return speculative_decoder(target, HeadDrafter(target, head), **options)


# --------------------------------------------------------------------------- what the head drafts


def full_features(target, ids, vision):
    """(input embeddings, last hidden states) of ``ids`` from ONE forward without a cache."""
    tap = tap_for(target.model)
    with torch.no_grad():
        uncached_forward(target.model, ids, vision)
    return tap.take()


def reference_chain(head, target, prompt, generated, tokens):
    """The head's distributions (γ, V) along the drafted ``tokens``, recomputed from scratch at every step:
    no head cache, no feature track; the head's own output stands for the target's feature of each drafted token."""
    verified = prompt.ids + generated
    embeds, hidden = full_features(target, verified, prompt.vision)
    feats, ids, dists = hidden[:-1], list(verified), []
    lm_head, device = target.model.get_output_embeddings(), head.fc.weight.device
    for token in tokens:
        drafted = torch.tensor(ids[len(verified):], dtype=torch.long, device=device)
        e = torch.cat([embeds[: len(verified)], head.embed_tokens(drafted)])
        seq = head_sequence(head, ids, feats, e, 0, target.image_token_id, len(prompt.ids))
        out = head.body(seq.inputs[None], torch.tensor([seq.positions], device=device),
                        causal_mask(len(seq.positions), 0, torch.float64, device))[0]
        dists.append(torch.softmax(lm_head(out[-1]), dim=-1))
        ids.append(token)
        feats = torch.cat([feats, out[-1:]])
    return torch.stack(dists)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n_images", [0, 2])
def test_the_cached_draft_is_the_head_run_from_scratch(tiny_models, heads, kind, n_images):
    target, head = tiny_models["target"], heads[kind]
    text = render_prompt(target.processor, [QUESTION], [], n_images)
    prompt = process(target.processor, text, tiny.images(n_images))
    decoder = head_decoder(target, head)
    drafter = decoder.drafter
    begin_turn(decoder, text, tiny.images(n_images))
    picker = TokenPicker(SamplingParams(temperature=1.0), seed=0)  # sampling: the draft carries its distributions
    generated = reference(target, [QUESTION], [], n_images, max_new_tokens=3)  # the target's own next tokens
    for verified in ([], generated):  # the first block of a turn, then one after the target accepted 3 tokens
        if verified:
            after_block(decoder, prompt, verified)
        draft = drafter.propose(verified, chain(4), picker)
        torch.testing.assert_close(draft.probs, reference_chain(head, target, prompt, verified, draft.tokens),
                                   rtol=0, atol=1e-10)
    drafter.roll_back(Kept(0))
    assert drafter.cache.get_seq_length() == drafter.entries  # drafted entries were cropped again


@pytest.mark.parametrize("kind", KINDS)
def test_every_dynamic_tree_node_scores_its_path_as_the_head_alone_would(tiny_models, heads, kind):
    target, head = tiny_models["target"], heads[kind]
    text = render_prompt(target.processor, [QUESTION], [], 1)
    prompt = process(target.processor, text, tiny.images(1))
    decoder = head_decoder(target, head)
    drafter = decoder.drafter
    begin_turn(decoder, text, tiny.images(1))
    tree = drafter.propose([], DraftShape(4, "dynamic", budget=30, topk=3), TokenPicker(SamplingParams()))
    assert max(tree.topology.depths) >= 2
    for node in range(len(tree.tokens)):
        path = [tree.tokens[n] for n in tree.topology.path(node)]
        dists = reference_chain(head, target, prompt, [], path)  # (len, V)
        expected = float(torch.log(dists[torch.arange(len(path)), torch.tensor(path)]).sum())
        assert abs(tree.scores[node] - expected) < 1e-8, node
    assert drafter.cache.get_seq_length() == drafter.entries  # the tree's entries were dropped


def test_vispec_lays_each_image_out_as_compressed_tokens(tiny_models, heads):
    target, head = tiny_models["target"], heads["vispec"]
    text = render_prompt(target.processor, [QUESTION], [], 2)
    prompt = process(target.processor, text, tiny.images(2))
    runs = image_runs(prompt.ids, target.image_token_id, len(prompt.ids))
    assert len(runs) == 2
    embeds, hidden = full_features(target, prompt.ids, prompt.vision)
    seq = head_sequence(head, prompt.ids, hidden[:-1], embeds, 0, target.image_token_id, len(prompt.ids))
    slots = sum(t - s for s, t in runs)
    assert len(seq.positions) == len(prompt.ids) - 1 - slots + 2 * (head.num_q - 1)
    for s, t in runs:  # the compressed token sits at the image's last slot and predicts nothing; no other slot stays
        assert not seq.predicts[seq.positions.index(t - 1)]
        assert not set(range(s, t - 1)) & set(seq.positions)
    eagle = head_sequence(heads["eagle"], prompt.ids, hidden[:-1], embeds, 0, target.image_token_id, len(prompt.ids))
    assert eagle.positions == list(range(len(prompt.ids) - 1)) and all(eagle.predicts)
    # g changes what follows an image: the same pairs with g zeroed give other inputs after the first image
    plain = head.fuse(embeds[runs[0][1] + 1:runs[0][1] + 2], hidden[runs[0][1]:runs[0][1] + 1], None)
    after = seq.inputs[seq.positions.index(runs[0][1])]
    assert not torch.allclose(plain[0], after)


# --------------------------------------------------------------------------- losslessness


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tree", list(TREES))
@pytest.mark.parametrize("n_images", [0, 1, 2])
def test_greedy_equals_target_generate_over_two_turns(tiny_models, heads, kind, tree, n_images):
    target = tiny_models["target"]
    generation = head_decoder(target, heads[kind], **TREES[tree]).generate(tiny.images(n_images), [QUESTION, FOLLOW_UP])
    first = generation.turns[0]
    assert first.token_ids == reference(target, [QUESTION], [], n_images)
    assert generation.turns[1].token_ids == reference(target, [QUESTION, FOLLOW_UP], [first.text], n_images)


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_at_the_token_limit(tiny_models, heads, kind):
    target = tiny_models["target"]
    for max_new in (1, 2, 7):
        for tree in ("chain", "dynamic"):
            turn = head_decoder(target, heads[kind], **TREES[tree]).generate(
                tiny.images(1), [QUESTION], max_new_tokens=max_new).turns[0]
            assert turn.token_ids == reference(target, [QUESTION], [], 1, max_new_tokens=max_new)


def test_a_reused_decoder_sees_new_images(tiny_models, heads):
    target = tiny_models["target"]
    decoder = head_decoder(target, heads["vispec"])
    for n_images in (1, 2, 0, 1):
        turn = decoder.generate(tiny.images(n_images), [QUESTION]).turns[0]
        assert turn.token_ids == reference(target, [QUESTION], [], n_images)


def guessing_head(target, kind: str) -> DraftHead:
    """A vispec/eagle head that drafts something the target might say: a random head whose output is, all but
    a tenth, half the target's feature before its first answer token. Its q then shares the target's top
    tokens (a random head's almost never does, and a rule's q would not matter), yet differs from p."""
    head = random_head(target, kind)
    prompt = process(target.processor, render_prompt(target.processor, [QUESTION], [], 1), tiny.images(1))
    _, hidden = full_features(target, prompt.ids, prompt.vision)
    with torch.no_grad():
        head.fc.weight.mul_(0.1)
        head.fc.bias.copy_(0.5 * hidden[-1])
        head.layers[0].self_attn.o_proj.weight.mul_(0.1)
        head.layers[0].mlp.down_proj.weight.mul_(0.1)
    return head


def test_sampling_keeps_the_target_distribution(tiny_models, joint):
    """vispec chains of γ = 2 from :func:`guessing_head`: ENGINE_RUNS runs against the target's exact
    distribution (tests/test_engine_sampling.py says how); the rule is tested alone in test_verify.py.

    What it can detect (measured when it was written, same seeds): handing the rule the head's q rows in
    reverse order gives p ≈ 7e-22; the target's p rows shifted by one, or accepting every draft token, p ≈ 0.
    (With :func:`random_head` no draft token is ever accepted, and no mistake in q could show.)"""
    target = tiny_models["target"]
    decoder = head_decoder(target, guessing_head(target, "vispec"), gamma=2, max_new_tokens=3, sampling=PARAMS)
    counts, turns = sampled_pairs(decoder, ENGINE_RUNS)
    assert {turn.blocks[0].accepted for turn in turns} == {0, 1, 2}
    assert chi_square_p_value(counts, joint, ENGINE_RUNS) > 1e-3


# --------------------------------------------------------------------------- checkpoints


def test_a_saved_head_loads_back_identical(tiny_models, heads, head_dirs):
    config = json.loads((head_dirs["vispec"] / "config.json").read_text())
    assert config["mmspec"] == {"kind": "vispec", "num_q": 2, "target": "tiny-target"}
    again = load_head(str(head_dirs["vispec"]), None, None, tiny_models["target"])
    assert again.kind == "vispec" and again.num_q == 2
    for (name, a), (_, b) in zip(heads["vispec"].state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name


def published_layout(head: DraftHead, folder: Path, weights_file: str = "model.safetensors") -> Path:
    """``head`` written as ViSpec's published heads are: Llama keys only in config.json, no mmspec block."""
    folder.mkdir(parents=True)
    c = head.config
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": c.hidden_size,
              "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
              "num_key_value_heads": c.num_key_value_heads, "num_hidden_layers": 1, "vocab_size": c.vocab_size,
              "rms_norm_eps": c.rms_norm_eps, "max_position_embeddings": c.max_position_embeddings,
              "head_dim": c.head_dim, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2}
    (folder / "config.json").write_text(json.dumps(config))
    state = {k: v.clone().contiguous() for k, v in head.state_dict().items()}
    if weights_file.endswith(".bin"):
        torch.save(state, folder / weights_file)
    else:
        save_file(state, str(folder / weights_file))
    return folder


@pytest.mark.parametrize("weights_file", ["model.safetensors", "pytorch_model.bin"])
def test_the_published_vispec_layout_loads_strictly_and_decodes_losslessly(tiny_models, tmp_path, weights_file):
    target = tiny_models["target"]
    folder = published_layout(random_head(target, "vispec", seed=3), tmp_path / "published", weights_file)
    weights = torch.load(folder / weights_file) if weights_file.endswith(".bin") else load_file(folder / weights_file)
    assert len(weights) == 17 and tuple(weights["imadpt.q"].shape) == (2, 4, 8)
    head = load_head(str(folder), "vispec", None, target)
    assert head.kind == "vispec" and head.num_q == 2
    generation = head_decoder(target, head, **DYNAMIC).generate(tiny.images(1), [QUESTION])
    assert generation.turns[0].token_ids == reference(target, [QUESTION], [], 1)


def rewrite(folder: Path, tmp_path: Path, change) -> str:
    out = tmp_path / "changed"
    out.mkdir()
    (out / "config.json").write_text((folder / "config.json").read_text())
    weights = load_file(folder / "model.safetensors")
    change(weights, out)
    save_file(weights, str(out / "model.safetensors"))
    return str(out)


@pytest.mark.parametrize("change, message", [
    (lambda w, out: w.pop("imadpt.o_proj.weight"), r"doesn't have the tensors of a vispec head \(17 expected\): "
                                                  r"missing imadpt.o_proj.weight"),
    (lambda w, out: w.__setitem__("extra.weight", torch.zeros(2)), "unexpected extra.weight"),
    (lambda w, out: w.__setitem__("fc.bias", torch.zeros(3)), r"fc.bias has shape \(3,\), expected \(32,\)"),
])
def test_a_checkpoint_missing_or_adding_a_tensor_is_refused(tiny_models, head_dirs, tmp_path, change, message):
    with pytest.raises(ModelLoadError, match=message):
        load_head(rewrite(head_dirs["vispec"], tmp_path, change), None, None, tiny_models["target"])


def test_a_head_for_another_target_is_refused_naming_both(tiny_models, tmp_path):
    target, other = tiny_models["target"], tiny_models["random"]  # hidden 32 vs 16
    save_head(random_head(other, "eagle"), tmp_path / "other", target="other", dtype=torch.float64)
    with pytest.raises(ModelLoadError, match=r"trained for another target \(hidden_size 16 vs 32 in .*\)"):
        load_head(str(tmp_path / "other"), None, None, target)


class LMHead:
    """What the target signature reads of a model: its LM head's weight."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight

    def get_output_embeddings(self):
        return self


def test_the_target_signature_tells_a_fine_tune_from_the_target_in_any_precision(tiny_models, capsys):
    from mmspec_cli.models.target_identity import other_target, signature, warn_if_other_target

    target = tiny_models["target"].model
    weight = target.get_output_embeddings().weight.detach()
    signed = signature(target)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert not other_target("t", signed, "t", LMHead(weight.to(dtype)))  # loaded in another precision
        assert not other_target("t", signature(LMHead(weight.to(dtype))), "t", target)  # trained on one
    torch.manual_seed(0)
    wide = torch.randn(1000, 512) * 0.02  # a real target's width (the tiny one's 32 lets norms tell a fine-tune)
    tuned = wide + 0.03 * wide.std() * torch.randn_like(wide)  # every weight moved by 3% of its spread
    assert other_target("t", signature(LMHead(wide)), "t", LMHead(tuned))
    warn_if_other_target("head", "h", "t", signature(LMHead(wide)), "t", LMHead(tuned), "mmspec train-head eagle")
    assert capsys.readouterr().err.startswith("warning: head h was trained for another version of it (a fine-tune, "
                                              "or other weights under that name), not t: its LM head differs")
    assert not other_target("t", signature(LMHead(wide)), "t", LMHead(wide.to(torch.bfloat16)))
    assert other_target("t", signed, "t", LMHead(weight[:-1]))  # fewer rows: the signature's last is not there
    assert other_target("t", {"rows": [0], "norms": None}, "t", target)  # unreadable: another target's


def test_heads_saved_with_the_norms_of_rows_still_load_without_a_warning(tiny_models, head_dirs, tmp_path, capsys):
    from mmspec_cli.models.target_identity import ROWS

    weight = tiny_models["target"].model.get_output_embeddings().weight
    norms = weight[torch.linspace(0, weight.shape[0] - 1, ROWS).round().long()].float().norm(dim=-1).tolist()
    config = json.loads((head_dirs["eagle"] / "config.json").read_text())
    config["mmspec"]["target_signature"] = [float(f"{x:.6g}") for x in norms]  # as they were saved
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes((head_dirs["eagle"] / "model.safetensors").read_bytes())
    load_head(str(tmp_path), None, None, tiny_models["target"])
    assert capsys.readouterr().err == ""
    load_head(str(tmp_path), None, None, tiny_models["perturbed"])  # another target of the same shape
    assert "warning: head" in capsys.readouterr().err


def test_kind_and_num_q_must_agree_with_the_checkpoint(tiny_models, head_dirs):
    target = tiny_models["target"]
    with pytest.raises(ModelLoadError, match="is a vispec head but the profile says kind: eagle"):
        load_head(str(head_dirs["vispec"]), "eagle", None, target)
    with pytest.raises(ModelLoadError, match="trained with num_q 2, the profile says 3"):
        load_head(str(head_dirs["vispec"]), "vispec", 3, target)
    with pytest.raises(ModelLoadError, match="has no config.json"):
        load_head(str(head_dirs["vispec"].parent), None, None, target)


def test_a_head_without_a_kind_for_a_drafter_of_another_kind_names_the_drafter(tiny_models, head_dirs):
    """The profile's head gives no kind, the drafter wants an eagle head: the fault is not a kind the profile says."""
    with pytest.raises(ModelLoadError) as info:
        load_head(str(head_dirs["vispec"]), None, None, tiny_models["target"], drafter="eagle")
    message = str(info.value)
    assert message.startswith("the eagle drafter needs an eagle head, and the profile's head ")
    assert "(which names no kind) is a vispec head; draft with vispec, or add an eagle head" in message
    assert "the profile says kind" not in message
    assert load_head(str(head_dirs["vispec"]), None, None, tiny_models["target"], drafter="vispec").kind == "vispec"


# --------------------------------------------------------------------------- names, profiles, CLI


def test_a_head_is_no_ensemble_member(tiny_models, heads):
    target = tiny_models["target"]
    with pytest.raises(InputError, match=r"a draft head \(vispec\) can't be an ensemble member"):
        build_drafter("tabed:mv", target, tiny_models["perturbed"])
    with pytest.raises(InputError, match=r"a draft head \(eagle\) can't be an ensemble member"):
        build_drafter("me", target, tiny_models["perturbed"])
    with pytest.raises(InputError, match="drafter 'vispec' needs a vispec head"):
        build_drafter("vispec", target, None, head=heads["eagle"])
    assert build_drafter("vispec", target, None, head=heads["vispec"]).name == "vispec"


def test_a_head_on_another_device_than_the_targets_lm_head_is_refused_in_one_line(tiny_models):
    """The head's outputs go through the target's LM head; a head left elsewhere (built on the CPU for a GPU target)
    is refused when the drafter is made, not deep in the first block (found on a GPU)."""
    target = tiny_models["target"]
    with pytest.raises(ValueError, match=r"^the draft head is on meta and the target's LM head on \w+.*\.to\(device\)"):
        HeadDrafter(target, DraftHead(head_config(target), "eagle").to("meta"))


def test_profile_head_section():
    one = profile_from_dict({"target": {"model": "x"}, "head": {"model": "h", "kind": "vispec", "num_q": 2}})
    assert [(h.model, h.kind, h.num_q) for h in one.head] == [("h", "vispec", 2)]
    both = profile_from_dict({"target": {"model": "x"}, "head": [{"model": "v", "kind": "vispec"},
                                                                 {"model": "e", "kind": "eagle"}]})
    assert [h.kind for h in both.head] == ["vispec", "eagle"]
    with pytest.raises(Exception, match="one head per kind"):
        profile_from_dict({"target": {"model": "x"}, "head": [{"model": "v"}, {"model": "e"}]})


def head_profile(path: Path, tiny_dirs, heads: list[dict] | None) -> str:
    spec = {"dtype": "float64", "device": "cpu"}
    data = {"target": {"model": tiny_dirs["target"], **spec}, "decoding": {"max_new_tokens": 8, "gamma": 3}}
    if heads is not None:
        data["head"] = heads
    path.write_text(__import__("yaml").safe_dump(data))
    return str(path)


def test_cli_generate_and_bench_with_heads(tiny_models, tiny_dirs, head_dirs, tmp_path):
    from typer.testing import CliRunner

    from mmspec_cli.cli.app import app
    from tests.helpers import save_images
    from tests.helpers import assert_one_line_error

    runner = CliRunner()
    [image] = save_images(tmp_path, 1)
    heads = [{"model": str(head_dirs["vispec"]), "kind": "vispec"}, {"model": str(head_dirs["eagle"]), "kind": "eagle"}]
    profile = head_profile(tmp_path / "heads.yaml", tiny_dirs, heads)
    for drafter in KINDS:
        result = runner.invoke(app, ["generate", image, "-q", QUESTION, "--profile", profile, "--drafter", drafter,
                                     "--tree", "dynamic", "--json"])
        assert result.exit_code == 0, result.stderr
        turn = json.loads(result.stdout)["turns"][0]
        assert turn["token_ids"] == reference(tiny_models["target"], [QUESTION], [], 1, max_new_tokens=8)
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps({"id": "a", "images": [image], "turns": [QUESTION], "category": "x"}) + "\n")
    out = tmp_path / "run.jsonl"
    result = runner.invoke(app, ["bench", str(manifest), "--profile", profile, "--drafters", "ar,eagle,vispec",
                                 "--out", str(out), "--format", "json"])
    assert result.exit_code == 0, result.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["drafter"] for r in records] == ["ar", "eagle", "vispec"]
    assert len({tuple(r["token_ids"]) for r in records}) == 1
    only_vispec = head_profile(tmp_path / "v.yaml", tiny_dirs, {"model": str(head_dirs["vispec"]), "kind": "vispec"})
    assert_one_line_error(runner.invoke(app, ["generate", image, "-q", QUESTION, "--profile", only_vispec,
                                              "--drafter", "eagle"]),
                          "drafter 'eagle' needs an eagle head and the profile names only vispec")
    no_kind = head_profile(tmp_path / "k.yaml", tiny_dirs, {"model": str(head_dirs["vispec"])})  # the head's kind: its own
    assert_one_line_error(runner.invoke(app, ["generate", image, "-q", QUESTION, "--profile", no_kind,
                                              "--drafter", "eagle"]), "the eagle drafter needs an eagle head")
    assert_one_line_error(runner.invoke(app, ["bench", str(manifest), "--profile", head_profile(
        tmp_path / "none.yaml", tiny_dirs, None), "--drafters", "ar,vispec", "--out", str(tmp_path / "x.jsonl")]),
                          "drafter 'vispec' needs a vispec head and the profile names no head")
    assert_one_line_error(runner.invoke(app, ["generate", image, "-q", QUESTION, "--profile", profile,
                                              "--drafter", "tabed:mv"]), "can't be an ensemble member")


def test_a_single_entrys_mask_is_the_last_row_of_a_longer_ones():
    """One new entry (a draft step) sees every cached entry and itself: the last row of the mask of two new ones."""
    for seen in (0, 1, 9):
        torch.testing.assert_close(causal_mask(1, seen, torch.float32, "cpu"),
                                   causal_mask(2, seen - 1, torch.float32, "cpu")[..., -1:, :] if seen else
                                   causal_mask(1, 0, torch.float32, "cpu"), rtol=0, atol=0)
    assert causal_mask(2, 3, torch.float32, "cpu")[0, 0, 0, -1] == torch.finfo(torch.float32).min  # not yet seen


def test_the_mask_a_compiled_head_step_makes_from_the_write_pointer_is_the_causal_mask_widened():
    """A compiled head step given no mask makes it from its static cache's write pointer (``entries_mask``): for n new
    entries after ``seen`` written ones, the causal mask widened to the state's capacity with the extra slots
    hidden, as an eager step is given it."""
    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=32)
    state = StaticKV(config, 256)  # room for a padded step after every entry: fit_mask does not grow it

    def check(seen):
        for new in (1, 2, 5):
            torch.testing.assert_close(entries_mask(state.cache, new, torch.float32),
                                       state.fit_mask(causal_mask(new, seen, torch.float32, "cpu")), rtol=0, atol=0)

    with torch.inference_mode():
        for seen in (1, 3, 7):  # entries written (the first write allocates the layer)
            entry = torch.zeros(1, 2, seen - state.length, 8)  # (batch, heads, positions, head size)
            state.cache.layers[0].update(entry, entry)
            state.wrote(entry.shape[2])
            check(seen)
        state.rollback(0)
        check(0)
