"""FastVLM's imitation network (IN) in ``ssd``: what the draft is with it, losslessness, and how it loads."""

from __future__ import annotations

import json
import pytest
import torch
import yaml
from typer.testing import CliRunner

from mmspec_cli.cli.app import app
from mmspec_cli.decoding.engine import SpeculativeDecoder
from mmspec_cli.decoding.sampling import SamplingParams, TokenPicker
from mmspec_cli.drafters import build_drafter
from mmspec_cli.errors import InputError, ModelLoadError, ProfileError
from mmspec_cli.models.imitation import ImitationNetwork, load_imitation, save_imitation
from mmspec_cli.models.profiles import load_profile, profile_from_dict
from mmspec_cli.models.prompts import process, render_prompt
from tests import tiny
from tests.helpers import begin_turn, chain, save_images, uncached_forward
from tests.helpers import assert_one_line_error
from tests.helpers import FOLLOW_UP, QUESTION, reference
from tests.test_ssd import LAYERS, deep  # noqa: F401  (the 4-layer target fixture)


def random_imitation(hidden: int, seed: int = 0, scale: float = 0.5, device="cpu") -> ImitationNetwork:
    """An IN whose residual branch is not zero, so it changes the draft (built on the CPU, then moved to
    ``device``: the same weights wherever it runs)."""
    torch.manual_seed(seed)
    network = ImitationNetwork(hidden).to(torch.float64)
    with torch.no_grad():
        network.fc2.weight.normal_(0, scale / hidden ** 0.5)
    return network.to(device).eval()


def hidden_size(target) -> int:
    return target.model.config.text_config.hidden_size


def draft_with(target, layer, ids, vision, steps, network=None):
    """Reference draft: argmax of LM head(final norm(IN(hidden state after `layer`))), full forward per step."""
    tokens = []
    norm, lm_head = target.model.get_decoder().norm, target.model.get_output_embeddings()
    for _ in range(steps):
        with torch.no_grad():
            out = uncached_forward(target.model, ids + tokens, vision, output_hidden_states=True)
            hidden = out.hidden_states[layer][0, -1]
            if network is not None:
                hidden = network(hidden)
            tokens.append(int(lm_head(norm(hidden)).argmax()))
    return tokens


def test_an_untrained_network_is_the_draft_without_imitation(deep):
    network = ImitationNetwork(hidden_size(deep)).to(torch.float64)
    x = torch.randn(3, hidden_size(deep), dtype=torch.float64)
    assert torch.equal(network(x), x)


@pytest.mark.parametrize("layer", [1, 2])
def test_the_draft_goes_through_the_network(deep, layer):
    network = random_imitation(hidden_size(deep), device=deep.model.device)
    text = render_prompt(deep.processor, [QUESTION], [], 1)
    prompt = process(deep.processor, text, tiny.images(1))
    decoder = SpeculativeDecoder(deep, build_drafter("ssd", deep, None, ssd_layer=layer, imitation=network))
    begin_turn(decoder, text, tiny.images(1))
    draft = decoder.drafter.propose([], chain(4), TokenPicker(SamplingParams()))
    assert draft.tokens == draft_with(deep, layer, prompt.ids, prompt.vision, 4, network)
    assert draft.tokens != draft_with(deep, layer, prompt.ids, prompt.vision, 4)  # the network changed what is drafted
    plain = build_drafter("ssd:plain", deep, None, ssd_layer=layer, imitation=network)
    assert plain.imitation is None and plain.name == "ssd:plain"


@pytest.mark.parametrize("tree", [{}, {"tree": "dynamic", "tree_budget": 12, "tree_topk": 3}])
@pytest.mark.parametrize("n_images", [0, 1, 2])
def test_greedy_equals_target_generate(deep, tree, n_images):
    drafter = build_drafter("ssd", deep, None, ssd_layer=2, imitation=random_imitation(hidden_size(deep),
                                                                                 device=deep.model.device))
    generation = SpeculativeDecoder(deep, drafter, gamma=3, max_new_tokens=24, **tree).generate(
        tiny.images(n_images), [QUESTION, FOLLOW_UP])
    first = generation.turns[0]
    assert first.token_ids == reference(deep, [QUESTION], [], n_images)
    assert generation.turns[1].token_ids == reference(deep, [QUESTION, FOLLOW_UP], [first.text], n_images)


def test_a_sampled_draft_carries_the_distribution_it_was_drawn_from(deep):
    """Sampling stays exact if q is what each token was drawn from: the verification rule is the one every
    drafter shares (its chi-square tests are in test_engine_sampling.py and test_ssd.py)."""
    network = random_imitation(hidden_size(deep), device=deep.model.device)
    text = render_prompt(deep.processor, [QUESTION], [], 1)
    prompt = process(deep.processor, text, tiny.images(1))
    decoder = SpeculativeDecoder(deep, build_drafter("ssd", deep, None, ssd_layer=2, imitation=network))
    begin_turn(decoder, text, tiny.images(1))
    draft = decoder.drafter.propose([], chain(3), TokenPicker(SamplingParams(temperature=1.0), seed=3))
    norm, lm_head = deep.model.get_decoder().norm, deep.model.get_output_embeddings()
    for i, token in enumerate(draft.tokens):
        with torch.no_grad():
            out = uncached_forward(deep.model, prompt.ids + draft.tokens[:i], prompt.vision, output_hidden_states=True)
            expected = torch.softmax(lm_head(norm(network(out.hidden_states[2][0, -1]))), dim=-1)
        torch.testing.assert_close(draft.probs[i], expected, rtol=0, atol=1e-10)


# --------------------------------------------------------------------------- files and refusals


@pytest.fixture(scope="module")
def saved(deep, tmp_path_factory):
    folder = tmp_path_factory.mktemp("imitation") / "in2"
    save_imitation(random_imitation(hidden_size(deep)), folder, layer=2, target=deep, target_name="deep",
                   dtype=torch.float64)
    return folder


def test_a_saved_network_loads_back_for_its_layer_and_target(deep, saved, tiny_models):
    network = load_imitation(str(saved), 2, deep)
    assert next(network.parameters()).device == deep.model.device  # loaded where the target is
    x = torch.randn(2, hidden_size(deep), dtype=torch.float64)
    torch.testing.assert_close(network.cpu()(x), random_imitation(hidden_size(deep))(x), rtol=0, atol=0)
    with pytest.raises(InputError, match=r"was trained for layer 2, but ssd.layer is 1; set ssd.layer: 2"):
        load_imitation(str(saved), 1, deep)
    with pytest.raises(ModelLoadError, match=r"trained for another target \(num_hidden_layers 4 vs 2 in"):
        load_imitation(str(saved), 2, tiny_models["target"])
    with pytest.raises(ModelLoadError, match="has no config.json with an mmspec_imitation block"):
        load_imitation(str(saved.parent), 2, deep)


def test_a_network_on_another_device_than_the_target_is_refused_in_one_line(deep):
    """Refused when the drafter is made (as a draft head is), not deep in the first block."""
    network = random_imitation(hidden_size(deep)).to("meta")
    with pytest.raises(ValueError, match=r"^the imitation network is on meta and the target's final norm on \w+.*"
                                         r"\.to\(device\)\), as load_imitation does$"):
        build_drafter("ssd", deep, None, ssd_layer=2, imitation=network)


def test_imitation_without_a_layer_is_refused_in_the_profile():
    with pytest.raises(ProfileError, match="ssd.imitation names an imitation network .* but ssd.layer is not set"):
        profile_from_dict({"target": {"model": "x"}, "ssd": {"imitation": "somewhere"}})
    profile = profile_from_dict({"target": {"model": "x"}, "ssd": {"layer": 2, "imitation": "somewhere"}})
    assert profile.ssd.imitation == "somewhere"


def write_files(tmp_path, target, **sections) -> tuple[str, str, str]:
    """An image, a one-sample manifest of it, and a float64 CPU profile of ``target`` with ``sections``."""
    [image] = save_images(tmp_path, 1)
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps({"id": "a", "images": [image], "turns": [QUESTION], "category": "x"}) + "\n")
    profile = tmp_path / "p.yaml"
    profile.write_text(yaml.safe_dump({"target": {"model": target.name, "dtype": "float64", "device": "cpu"},
                                       **sections}))
    return image, str(manifest), str(profile)


def test_bench_runs_ssd_with_and_without_the_network_side_by_side(deep, saved, tmp_path):
    spec = {"dtype": "float64", "device": "cpu"}
    image, manifest, profile = write_files(tmp_path, deep, decoding={"max_new_tokens": 8},
                                           ssd={"layer": 2, "imitation": str(saved)})
    out = tmp_path / "run.jsonl"
    runner = CliRunner()
    result = runner.invoke(app, ["bench", str(manifest), "--profile", str(profile), "--drafters", "ar,ssd,ssd:plain",
                                 "--out", str(out), "--format", "json"])
    assert result.exit_code == 0, result.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["drafter"] for r in records] == ["ar", "ssd", "ssd:plain"]
    assert len({tuple(r["token_ids"]) for r in records}) == 1
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text(yaml.safe_dump({"target": {"model": deep.name, **spec}, "ssd": {"layer": 1, "imitation": str(saved)}}))
    assert_one_line_error(runner.invoke(app, ["generate", image, "-q", QUESTION, "--profile", str(wrong),
                                              "--drafter", "ssd"]), "was trained for layer 2, but ssd.layer is 1")


def test_select_layer_scores_the_network_and_measures_both_ways(deep, saved, tmp_path):
    spec = {"dtype": "float64", "device": "cpu"}
    image, _, profile = write_files(tmp_path, deep, decoding={"max_new_tokens": 6},
                                    ssd={"layer": 2, "imitation": str(saved)})
    written = tmp_path / "chosen.yaml"
    runner = CliRunner()
    result = runner.invoke(app, ["select-layer", image, "-q", QUESTION, "--profile", str(profile), "--imitation",
                                 "--empirical", "1", "--lambda", "0", "--write", str(written), "--json"])
    assert result.exit_code == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["imitation"]["layer"] == 2 and 0 < out["imitation"]["confidence"] <= 1
    plain = {row["layer"]: row["confidence"] for row in out["layers"]}
    assert out["imitation"]["confidence"] != plain[2]  # the network is in place
    runs = {(m["layer"], m["imitation"]) for m in out["empirical"]}
    assert {(2, True), (2, False)} <= runs  # both ways at the network's layer
    chosen = load_profile(str(written))
    assert chosen.ssd.layer == out["chosen"]
    assert chosen.ssd.imitation == (str(saved) if out["chosen_imitation"] else None)
    no_network = tmp_path / "none.yaml"
    no_network.write_text(yaml.safe_dump({"target": {"model": deep.name, **spec}}))
    assert_one_line_error(runner.invoke(app, ["select-layer", image, "-q", QUESTION, "--profile", str(no_network),
                                              "--imitation"]), "--imitation scores the profile's imitation network")


# --------------------------------------------------------------------------- training (train-head imitation)


def test_imitation_losses_by_hand():
    from mmspec_cli.training import losses

    a, b = torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 1.0]])
    assert losses.cosine_distance(a, b).item() == pytest.approx(1 - 1 / 2 ** 0.5)
    assert losses.cosine_distance(b, 3 * b).item() == pytest.approx(0.0, abs=1e-7)
    target, draft = torch.tensor([[0.0, 0.0]]), torch.tensor([[torch.log(torch.tensor(3.0)).item(), 0.0]])
    # KL(p ‖ q) with p = (1/2, 1/2), q = (3/4, 1/4)
    expected = 0.5 * torch.log(torch.tensor(0.5 / 0.75)) + 0.5 * torch.log(torch.tensor(0.5 / 0.25))
    assert losses.distillation(draft, target).item() == pytest.approx(expected.item())
    assert losses.distillation(target, target).item() == pytest.approx(0.0)


def test_train_head_imitation_learns_loads_and_decodes_losslessly(tiny_models, tmp_path):
    from mmspec_cli.models.profiles import load_profile as load
    from mmspec_cli.training.run import train_head
    from tests.test_train_head import QUESTIONS, settings

    target = tiny_models["target"]
    [image] = save_images(tmp_path, 1)
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps({"id": f"s{i}", "images": ["img0.png"], "turns": [q], "category": "x"})
                                + "\n" for i, q in enumerate(QUESTIONS * 2)))
    profile = tmp_path / "p.yaml"
    profile.write_text(yaml.safe_dump({"target": {"model": target.name, "dtype": "float64", "device": "cpu"},
                                       "decoding": {"max_new_tokens": 12}}))
    out = tmp_path / "in"
    losses_seen = []
    report = train_head(load(str(profile)), settings(out, kind="imitation", ssd_layer=1, source=str(manifest),
                                                     steps=12, held_out=2, measure_before=True),
                        progress=False, on_step=lambda step, total, stats: losses_seen.append(stats[0]["loss"]))
    assert losses_seen[-1] < losses_seen[0]
    assert report["layer"] == 1 and report["acceptance"]["after"]["turns"] == 2
    assert report["acceptance"]["before"]["block_efficiency"] >= 1.0
    config = json.loads((out / "config.json").read_text())["mmspec_imitation"]
    assert config["layer"] == 1 and config["target"] == target.name
    network = load_imitation(str(out), 1, target)
    assert float(network.fc2.weight.abs().sum()) > 0  # trained away from the identity
    drafter = build_drafter("ssd", target, None, ssd_layer=1, imitation=network)
    for n_images in (0, 1):
        turn = SpeculativeDecoder(target, drafter, gamma=3, max_new_tokens=24).generate(
            tiny.images(n_images), [QUESTION]).turns[0]
        assert turn.token_ids == reference(target, [QUESTION], [], n_images)


def test_train_head_imitation_refuses_bad_layers_in_one_line(tiny_models, tmp_path):
    _, manifest, profile = write_files(tmp_path, tiny_models["target"])
    base = ["train-head", "imitation", manifest, "--profile", profile, "--out", str(tmp_path / "o"),
            "--steps", "1", "--answer-tokens", "4"]
    runner = CliRunner()
    assert_one_line_error(runner.invoke(app, base), "train-head imitation needs --ssd-layer N")
    assert_one_line_error(runner.invoke(app, [*base, "--ssd-layer", "5"]), "ssd.layer 5 is outside [1, 1]")
    assert_one_line_error(runner.invoke(app, ["train-head", "eagle", manifest, "--profile", profile, "--out",
                                              str(tmp_path / "e"), "--ssd-layer", "1"]),
                          "--ssd-layer is for train-head imitation")
