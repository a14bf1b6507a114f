"""Loading through from_pretrained, and the refusals checked before any decoding starts."""

from __future__ import annotations

import http.server
import sys
import threading
import time
import urllib.error
import urllib.request
from functools import partial
from pathlib import Path

import pytest
import torch
import yaml
from transformers import LlamaConfig, LlamaForCausalLM
from typer.testing import CliRunner

from mmspec_cli.api import decoder_from_profile
from mmspec_cli.cli.app import app
from mmspec_cli.models import loading
from mmspec_cli.errors import InputError, ModelLoadError
from mmspec_cli.models.loading import check_compatible, load_model
from mmspec_cli.models.profiles import ModelSpec, profile_from_dict

from tests import helpers
from tests.helpers import own_generate, tiny_files, write_profile


def spec(path, **kw):
    return ModelSpec(model=str(path), dtype="float64", device="cpu", **kw)


def test_local_directory_loads_as_image_text_to_text(tiny_dirs):
    loaded = load_model(spec(tiny_dirs["target"]), "target")
    assert type(loaded.model).__name__ == "LlavaForConditionalGeneration"
    assert loaded.image_token_id == 4 and loaded.model.dtype.is_floating_point


def test_mismatched_tokenizers_are_refused(tiny_models):
    with pytest.raises(ModelLoadError, match="another tokenizer than the target"):
        check_compatible(tiny_models["target"], tiny_models["other_tokenizer"])


def test_text_only_model_class_is_refused_as_a_target(tmp_path):
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2)).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="not an image-text-to-text model"):
        load_model(spec(tmp_path), "target")


def test_unreachable_hub_id_says_to_pass_a_local_path(monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read at import: set the constant
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(ModelLoadError, match="pass a local path"):
        load_model(spec("nobody-here/no-such-model"), "target")


def test_quantization_without_bitsandbytes_names_the_key(tiny_dirs, monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as where it is not installed: importing it fails
    with pytest.raises(ModelLoadError, match="target.quantization"):
        load_model(spec(tiny_dirs["target"], quantization="4bit"), "target")


def test_profile_with_mismatched_draft_is_refused_before_decoding(tiny_dirs):
    profile = profile_from_dict({"target": {"model": tiny_dirs["target"], "dtype": "float64", "device": "cpu"},
                                 "draft": {"model": tiny_dirs["other_tokenizer"], "dtype": "float64", "device": "cpu"}})
    with pytest.raises(ModelLoadError, match="another tokenizer than the target"):
        decoder_from_profile(profile)


def test_drafter_without_a_draft_model_is_refused(tiny_dirs):
    profile = profile_from_dict({"target": {"model": tiny_dirs["target"], "dtype": "float64", "device": "cpu"},
                                 "drafter": "t"})
    with pytest.raises(InputError, match="needs a draft model"):
        decoder_from_profile(profile)


def test_cuda_out_of_memory_names_the_model_and_suggests_a_fix(tiny_models, monkeypatch):
    import torch

    from mmspec_cli.errors import MmspecError
    from mmspec_cli.decoding.kv import CachedModel

    runner = CachedModel(tiny_models["target"].model, role="target", image_token_id=4)

    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(tiny_models["target"].model, "forward", out_of_memory)
    with pytest.raises(MmspecError, match="out of memory in the target model; set target.quantization: 4bit"):
        runner.logits([1, 5, 6], keep=1)


def test_a_draft_without_processor_files_shares_the_targets(tiny_dirs, tiny_models, tmp_path):
    """Drafts are often saved as weights only; they then use the target's tokenizer and image processor."""
    from tests import tiny
    from mmspec_cli.api import ModelSet
    from mmspec_cli.models.prompts import render_prompt

    tiny_models["perturbed"].model.save_pretrained(tmp_path / "weights_only")  # no tokenizer, no image processor
    with pytest.raises(ModelLoadError, match="has no usable processor files"):
        load_model(spec(tmp_path / "weights_only"), "draft")
    profile = profile_from_dict({"target": {"model": tiny_dirs["target"], "dtype": "float64", "device": "cpu"},
                                 "draft": {"model": str(tmp_path / "weights_only"), "dtype": "float64", "device": "cpu"},
                                 "decoding": {"max_new_tokens": 12}})
    models = ModelSet.load(profile, ["m", "mt"])
    assert models.draft.processor is models.target.processor
    target = models.target
    ref = own_generate(target, ["what is in the image?"], [], 1, tiny.images(1), 12)
    for name in ("m", "mt"):
        turn = models.decoder(name).generate(tiny.images(1), ["what is in the image?"]).turns[0]
        assert turn.token_ids == ref and turn.stats.accepted > 0


def test_shipped_model_ids_resolve_inside_the_package_and_unknown_ones_are_refused():
    from mmspec_cli.models.loading import model_location, shipped_models_dir

    assert model_location("mmspec:demo-target") == str(shipped_models_dir() / "demo-target")
    assert model_location("llava-hf/llava-1.5-7b-hf") == "llava-hf/llava-1.5-7b-hf"  # hub ids pass through
    with pytest.raises(ModelLoadError, match="not a model shipped with mmspec.*mmspec:demo-draft"):
        load_model(spec("mmspec:no-such-model"), "draft")


# --------------------------------------------------------------------------- damaged or empty model folders


DAMAGES = {"cut": lambda data: data[: len(data) // 2], "a few bytes": lambda data: b"abcd", "empty": lambda data: b""}


def damaged_copy(source: str, folder, damage: str, weights: str = "model.safetensors") -> str:
    """A copy of the model folder ``source`` whose weights file is cut in half, a few bytes, or empty."""
    import shutil

    shutil.copytree(source, folder)
    path = folder / weights
    path.write_bytes(DAMAGES[damage](path.read_bytes()))
    return str(folder)


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_safetensors_file_is_named_in_one_line(tiny_dirs, tmp_path, damage):
    folder = damaged_copy(tiny_dirs["target"], tmp_path / "target", damage)
    with pytest.raises(ModelLoadError) as info:
        load_model(spec(folder), "draft")
    message = str(info.value)
    assert message.startswith(f"draft.model: the weights file {folder}/model.safetensors is damaged")
    assert "save_pretrained" in message and "\n" not in message


@pytest.mark.parametrize("damage", ["cut", "empty"])
def test_a_damaged_pytorch_bin_file_is_named_in_one_line(tiny_models, tmp_path, damage):
    import torch

    folder = tmp_path / "bin"
    tiny_models["target"].model.save_pretrained(folder)
    tiny_models["target"].processor.save_pretrained(folder)
    state = {k: v for k, v in tiny_models["target"].model.state_dict().items()}
    (folder / "model.safetensors").unlink()
    torch.save(state, folder / "pytorch_model.bin")
    path = folder / "pytorch_model.bin"
    path.write_bytes(DAMAGES[damage](path.read_bytes()))
    with pytest.raises(ModelLoadError, match=r"target.model: the weights file .*pytorch_model.bin is damaged"):
        load_model(spec(folder), "target")


@pytest.mark.parametrize("role, command", [
    ("target", ["generate", "{image}", "-q", "what is it?"]),
    ("draft", ["bench", "{manifest}", "--drafters", "m", "--out", "{out}"]),
    ("target", ["select-layer", "{image}", "-q", "what is it?"]),
    ("draft", ["profile-latency", "--batch", "1", "--seq", "8", "--repeat", "1"]),
    ("target", ["train-head", "eagle", "{manifest}", "--out", "{out}", "--steps", "1"]),
])
def test_every_command_refuses_a_cut_weights_file_in_one_line(tiny_dirs, tmp_path, role, command):
    """Refused as the model loads, so this is quick; the files the commands would write are not made."""
    import json

    from typer.testing import CliRunner

    from mmspec_cli.cli.app import app
    from tests.helpers import assert_one_line_error, save_images, write_profile

    [image] = save_images(tmp_path, 1)
    manifest = tmp_path / "manifest.jsonl"
    sample = {"id": "s", "images": ["img0.png"], "turns": ["what is it?"], "category": "x"}
    manifest.write_text(json.dumps(sample) + "\n")
    models = {"target": tiny_dirs["target"], "draft": tiny_dirs["perturbed"]}
    models[role] = damaged_copy(models[role], tmp_path / role, "cut")
    profile = write_profile(tmp_path / "p.yaml", models["target"], models["draft"], max_new_tokens=4)
    args = [a.format(image=image, manifest=manifest, out=tmp_path / "out") for a in command]
    result = CliRunner().invoke(app, [*args, "--profile", profile])
    assert_one_line_error(result, f"{role}.model: the weights file {models[role]}/model.safetensors is damaged",
                          stdout_allowed=True)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("files", [[], ["tokenizer.json"]])
def test_a_folder_without_a_model_says_what_it_lacks(tmp_path, files):
    for name in files:
        (tmp_path / name).write_text("{}")
    with pytest.raises(ModelLoadError) as info:
        load_model(spec(tmp_path), "draft")
    message = str(info.value)
    assert message.startswith(f"draft.model: '{tmp_path}' holds no model: ")
    assert ("the folder is empty" if not files else "no config.json and no weights file") in message
    assert "trust_remote_code" not in message


# these commands may print their results before the error line, and nothing here shows loading bars
assert_one_line_error = partial(helpers.assert_one_line_error, stdout_allowed=True, loading_bars=False)
QUESTION = "what is in the image?"
runner = CliRunner()


@pytest.fixture(scope="module")
def files(tiny_dirs, tmp_path_factory) -> dict:
    return tiny_files(tmp_path_factory.mktemp("models"), tiny_dirs, images=1, max_new_tokens=4)


# --------------------------------------------------------------------------- devices this machine lacks


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_a_cuda_device_without_cuda_is_one_line_naming_the_entry(files, tiny_dirs, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    profile = tmp_path / "gpu.yaml"
    profile.write_text(yaml.safe_dump({"target": {"model": tiny_dirs["target"], "dtype": "float64", "device": "cpu"},
                                       "draft": {"model": tiny_dirs["perturbed"], "dtype": "float64",
                                                 "device": "cuda:7"}}))
    result = runner.invoke(app, ["generate", *files["images"], "-q", QUESTION, "--profile", str(profile)])
    assert_one_line_error(result, "draft.device: cuda:7 does not exist on this machine (devices here: cpu)")


def test_a_gpu_beyond_the_count_names_the_devices_there_are(tiny_dirs, two_gpus):
    with pytest.raises(ModelLoadError, match=r"captioner.device: cuda:7 .*devices here: cpu, cuda:0, cuda:1\)"):
        load_model(ModelSpec(model=tiny_dirs["target"], dtype="float64", device="cuda:7"), "captioner")
    loading.check_device("cuda:1", "target")  # exists here
    loading.check_device("cuda", "target")


def test_cuda_without_any_gpu_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ModelLoadError, match="target.device: cuda does not exist"):
        loading.check_device("cuda", "target")


# --------------------------------------------------------------------------- the hub without network


@pytest.fixture
def online_mode(monkeypatch):
    """Neither HF_HUB_OFFLINE nor TRANSFORMERS_OFFLINE: the hub is tried (and, on this machine, unreachable)."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)


def hub_answers() -> bool:
    """Whether huggingface.co answers here at all (not on the machine this project is developed on)."""
    try:
        urllib.request.urlopen(urllib.request.Request("https://huggingface.co", method="HEAD"), timeout=3).close()
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False
    return True


def test_an_unreachable_hub_id_is_refused_at_once_in_one_line(files, tiny_dirs, tmp_path, online_mode, monkeypatch):
    if hub_answers():
        pytest.skip("the hub answers here")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    profile = write_profile(tmp_path / "hub.yaml", "nobody-here/no-such-model", tiny_dirs["perturbed"])
    start = time.monotonic()
    result = runner.invoke(app, ["generate", *files["images"], "-q", QUESTION, "--profile", profile])
    assert time.monotonic() - start < 5
    line = assert_one_line_error(result, "target.model: 'nobody-here/no-such-model' is not in the local Hugging Face")
    assert "can't be reached" in line and "hf download" in line and "pass a local path" in line


def test_offline_mode_refuses_an_uncached_hub_id_saying_so(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(loading, "hub_reachable", lambda: pytest.fail("probed the hub in offline mode"))
    with pytest.raises(ModelLoadError, match=r"HF_HUB_OFFLINE \(or TRANSFORMERS_OFFLINE\) is set"):
        load_model(ModelSpec(model="nobody-here/no-such-model", device="cpu"), "draft")


def hub_cache_with(model_dir: str, repo: str, root: Path) -> Path:
    """A Hugging Face cache holding ``model_dir``'s files as the snapshot of ``repo`` at main."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    entry = root / f"models--{repo.replace('/', '--')}"
    snapshot = entry / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for file in Path(model_dir).iterdir():
        (snapshot / file.name).write_bytes(file.read_bytes())
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text(commit)
    return root


@pytest.mark.parametrize("offline", [False, True])
def test_a_cached_hub_model_loads_without_network(tiny_dirs, tmp_path, online_mode, monkeypatch, capfd, offline):
    import huggingface_hub.constants

    cache = hub_cache_with(tiny_dirs["target"], "mmspec-test/tiny-target", tmp_path / "hub")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    loaded = load_model(ModelSpec(model="mmspec-test/tiny-target", dtype="float64", device="cpu"), "target")
    assert time.monotonic() - start < 5
    assert type(loaded.model).__name__ == "LlavaForConditionalGeneration" and loaded.image_token_id == 4
    assert "Retrying" not in capfd.readouterr().err


class _NotFound(http.server.BaseHTTPRequestHandler):
    def do_HEAD(self):  # noqa: N802 (the http.server name)
        self.send_response(404)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_the_probe_counts_any_answer_and_fails_fast_without_one(monkeypatch):
    import huggingface_hub.constants

    server = http.server.HTTPServer(("127.0.0.1", 0), _NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{server.server_port}")
        assert loading.hub_reachable()
    finally:
        server.shutdown()
        server.server_close()
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    start = time.monotonic()
    assert not loading.hub_reachable()  # nothing listens there now: refused
    assert time.monotonic() - start < 2


def test_loading_prints_the_rows_caveat_of_its_quantization_and_device(tiny_dirs, capsys, monkeypatch):
    """The one warning line of ``loading.rows_caveat`` (a 4-bit target on CUDA, tested on its rule in
    tests/test_quantization.py) is printed by every load, on stderr; none when the rule gives none."""
    monkeypatch.setattr(loading, "rows_caveat", lambda quantization, role, device: f"warning: {role}, {quantization}, {device}")
    load_model(ModelSpec(model=tiny_dirs["target"], dtype="float64", device="cpu"), "target")
    assert capsys.readouterr().err.strip().splitlines()[-1] == "warning: target, None, cpu"
    monkeypatch.undo()
    load_model(ModelSpec(model=tiny_dirs["target"], dtype="float64", device="cpu"), "target")
    assert "warning" not in capsys.readouterr().err
