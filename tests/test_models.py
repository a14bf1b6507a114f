"""Loading through from_pretrained, and the refusals checked before any decoding starts."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from mmspec_cli.api import decoder_from_profile
from mmspec_cli.errors import InputError, ModelLoadError
from mmspec_cli.models import check_compatible, load_model
from mmspec_cli.profiles import ModelSpec, profile_from_dict


def spec(path, **kw):
    return ModelSpec(model=str(path), dtype="float64", device="cpu", **kw)


def test_local_directory_loads_as_image_text_to_text(tiny_dirs):
    loaded = load_model(spec(tiny_dirs["target"]), "target")
    assert type(loaded.model).__name__ == "LlavaForConditionalGeneration"
    assert loaded.image_token_id == 4 and loaded.model.dtype.is_floating_point


def test_mismatched_tokenizers_are_refused(tiny_models):
    with pytest.raises(ModelLoadError, match="tokenizers differ"):
        check_compatible(tiny_models["target"], tiny_models["other_tokenizer"])


def test_text_only_model_class_is_refused(tmp_path):
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2)).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="not an image-text-to-text model"):
        load_model(spec(tmp_path), "draft")


def test_unreachable_hub_id_says_to_pass_a_local_path(monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read at import: set the constant
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(ModelLoadError, match="pass a local path"):
        load_model(spec("nobody-here/no-such-model"), "target")


def test_quantization_without_bitsandbytes_names_the_key(tiny_dirs):
    try:
        import bitsandbytes  # noqa: F401
        pytest.skip("bitsandbytes is importable here")
    except Exception:
        pass
    with pytest.raises(ModelLoadError, match="target.quantization"):
        load_model(spec(tiny_dirs["target"], quantization="4bit"), "target")


def test_profile_with_mismatched_draft_is_refused_before_decoding(tiny_dirs):
    profile = profile_from_dict({"target": {"model": tiny_dirs["target"], "dtype": "float64", "device": "cpu"},
                                 "draft": {"model": tiny_dirs["other_tokenizer"], "dtype": "float64", "device": "cpu"}})
    with pytest.raises(ModelLoadError, match="tokenizers differ"):
        decoder_from_profile(profile)


def test_drafter_without_a_draft_model_is_refused(tiny_dirs):
    profile = profile_from_dict({"target": {"model": tiny_dirs["target"], "dtype": "float64", "device": "cpu"},
                                 "drafter": "t"})
    with pytest.raises(InputError, match="needs a draft model"):
        decoder_from_profile(profile)


def test_cuda_out_of_memory_names_the_model_and_suggests_a_fix(tiny_models, monkeypatch):
    import torch

    from mmspec_cli.errors import MmspecError
    from mmspec_cli.runner import CachedModel

    runner = CachedModel(tiny_models["target"].model, role="target", image_token_id=4)

    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(tiny_models["target"].model, "forward", out_of_memory)
    with pytest.raises(MmspecError, match="out of memory in the target model; set target.quantization: 4bit"):
        runner.logits([1, 5, 6], keep=1)
