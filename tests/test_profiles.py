"""Tests for mmspec_cli.models.profiles: parsing, defaults, refusals, overrides, round trip."""

import json
import os
import resource
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from mmspec_cli.models import profiles
from mmspec_cli.errors import ProfileError
from mmspec_cli.cli.app import app
from mmspec_cli.decoding.sampling import SamplingParams, TokenPicker
from mmspec_cli.models.profiles import (MAX_SEED, DecodingSpec, ModelSpec, Profile, _show, apply_overrides,
                                        builtin_profiles_dir, list_profiles, load_profile, profile_from_dict,
                                        profile_to_dict)

from tests.helpers import assert_one_line_error, cli
from tests.test_latency import made_records, summary_profile, write_records

BUILTINS = {
    "llava15-7b": "llava-hf/llava-1.5-7b-hf",
    "llava15-13b": "llava-hf/llava-1.5-13b-hf",
    "llava-next-7b": "llava-hf/llava-v1.6-vicuna-7b-hf",
}

GOOD = {
    "target": {"model": "llava-hf/llava-1.5-7b-hf", "dtype": "bfloat16", "device": "cuda:1"},
    "draft": {"model": "mjbooo/lvlm68m", "quantization": "4bit", "revision": "main"},
    "decoding": {"gamma": 3, "max_new_tokens": 64, "temperature": 1, "top_p": 0.9, "top_k": 50, "seed": 7},
    "drafter": "ar",
}


def refused(data, fragment):
    """Assert that ``data`` is refused with a message containing ``fragment``, one line."""
    with pytest.raises(ProfileError) as info:
        profile_from_dict(data)
    message = str(info.value)
    assert fragment in message
    assert "\n" not in message
    return message


def with_decoding(**values):
    return {"target": {"model": "t"}, "decoding": values}


def with_target(**values):
    return {"target": {"model": "t", **values}}


# --------------------------------------------------------------------------- built-ins


def test_builtin_dir_and_names():
    assert builtin_profiles_dir() == Path(profiles.__file__).resolve().parents[2] / "profiles"  # the repo root
    assert set(BUILTINS) <= set(list_profiles())
    assert list_profiles() == sorted(list_profiles())


def test_the_readmes_profile_table_names_every_shipped_profile_with_its_models():
    """A row per file in profiles/ (not 4 of 10), giving the target and the draft or head the profile loads."""
    readme = (builtin_profiles_dir().parent / "README.md").read_text()
    rows = {line.split("|")[1].strip().split()[0].strip("`"): line for line in readme.splitlines()
            if line.startswith("| `") and line.count("|") == 4}
    assert set(list_profiles()) <= set(rows)
    for name in list_profiles():
        profile = load_profile(name)
        models = [profile.target.model, *([profile.draft.model] if profile.draft else []),
                  *(head.model for head in profile.head)]
        assert all(model in rows[name] for model in models[:2]), (name, rows[name])


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_builtin_profiles_parse(name):
    profile = load_profile(name)
    assert profile.name == name
    assert profile.source.endswith(f"{name}.yaml")
    assert profile.target == ModelSpec(model=BUILTINS[name], dtype="float16")
    assert profile.draft == ModelSpec(model="mjbooo/lvlm68m", dtype="float16")
    assert profile.decoding == DecodingSpec(gamma=5, max_new_tokens=128, temperature=0.0)
    assert profile.drafter == "m"
    first_line = (builtin_profiles_dir() / f"{name}.yaml").read_text().splitlines()[0]
    assert first_line.startswith("# ")


@pytest.mark.parametrize("name,target,draft,dtype", [
    ("qwen25-vl-7b", "Qwen/Qwen2.5-VL-7B-Instruct", "Qwen/Qwen2.5-VL-3B-Instruct", "bfloat16"),
    ("qwen2-vl-7b", "Qwen/Qwen2-VL-7B-Instruct", "Qwen/Qwen2-VL-2B-Instruct", "bfloat16"),
    ("qwen3-vl-8b", "Qwen/Qwen3-VL-8B-Instruct", "Qwen/Qwen3-VL-2B-Instruct", "bfloat16"),
    ("llava-onevision-7b", "llava-hf/llava-onevision-qwen2-7b-ov-hf", "mjbooo/lvlm68m-ov", "float16"),
])
def test_the_qwen_and_onevision_profiles_parse(name, target, draft, dtype):
    profile = load_profile(name)
    assert profile.target == ModelSpec(model=target, dtype=dtype)
    assert profile.draft == ModelSpec(model=draft, dtype=dtype)
    assert profile.drafter == "m" and profile.decoding == DecodingSpec(gamma=5, max_new_tokens=128, temperature=0.0)
    assert (builtin_profiles_dir() / f"{name}.yaml").read_text().startswith("# ")


@pytest.mark.parametrize("size", ["7b", "13b"])
def test_the_vispec_profiles_name_the_published_heads(size):
    profile = load_profile(f"llava16-{size}-vispec")
    assert profile.target == ModelSpec(model=f"llava-hf/llava-v1.6-vicuna-{size}-hf", dtype="float16")
    [head] = profile.head
    assert (head.model, head.kind, head.num_q) == (f"JLKang/ViSpec-llava-v1.6-vicuna-{size}-hf", "vispec", 2)
    assert profile.drafter == "vispec" and profile.draft is None
    d = profile.decoding
    assert (d.tree, d.tree_budget, d.tree_depth, d.tree_topk) == ("dynamic", 30, 3, 8)


def test_the_qwen25_vispec_profile_names_the_published_qwen_head():
    profile = load_profile("qwen25-vl-7b-vispec")
    assert profile.target == ModelSpec(model="Qwen/Qwen2.5-VL-7B-Instruct", dtype="bfloat16")
    [head] = profile.head
    assert (head.model, head.kind, head.num_q) == ("JLKang/ViSpec-Qwen2.5-VL-7B-Instruct", "vispec", 2)
    assert profile.drafter == "vispec" and profile.draft is None
    d = profile.decoding
    assert (d.tree, d.tree_budget, d.tree_depth, d.tree_topk, d.temperature) == ("dynamic", 30, 3, 8, 0.0)
    assert profile_from_dict(profile_to_dict(profile), name=profile.name, source=profile.source) == profile
    assert (builtin_profiles_dir() / "qwen25-vl-7b-vispec.yaml").read_text().startswith("# ")


# --------------------------------------------------------------------------- good input


def test_good_dict():
    profile = profile_from_dict(GOOD, name="mine", source="x.yaml")
    assert profile.name == "mine" and profile.source == "x.yaml"
    assert profile.target == ModelSpec("llava-hf/llava-1.5-7b-hf", "bfloat16", "cuda:1")
    assert profile.draft.quantization == "4bit" and profile.draft.revision == "main"
    assert profile.decoding == DecodingSpec(3, 64, 1.0, 0.9, 50, 7)
    assert isinstance(profile.decoding.temperature, float)  # int accepted, stored as float
    assert profile.drafter == "ar"


def test_defaults():
    profile = profile_from_dict({"target": {"model": "t"}})
    assert profile.name == "<dict>" and profile.source == "<dict>"
    assert profile.target == ModelSpec(
        model="t", dtype="float16", device="auto", quantization=None, trust_remote_code=False, revision=None
    )
    assert profile.draft is None
    assert profile.decoding == DecodingSpec(
        gamma=5, max_new_tokens=128, temperature=0.0, top_p=None, top_k=None, seed=None
    )
    assert profile.drafter == "m"


def test_null_sections():
    profile = profile_from_dict({"target": {"model": "t"}, "draft": None, "decoding": None})
    assert profile.draft is None
    assert profile.decoding == DecodingSpec()


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:0", "cuda:12", "mps"])
def test_devices_accepted(device):
    assert profile_from_dict(with_target(device=device)).target.device == device


def test_frozen():
    profile = profile_from_dict(GOOD)
    with pytest.raises(AttributeError):
        profile.drafter = "x"
    with pytest.raises(AttributeError):
        profile.decoding.gamma = 9


# --------------------------------------------------------------------------- refusals


def test_exact_wrong_type_message():
    message = refused(with_decoding(gamma="five"), 'decoding.gamma: expected an integer between 1 and 64, got "five"')
    assert message == 'decoding.gamma: expected an integer between 1 and 64, got "five"'


@pytest.mark.parametrize(
    "key, value, fragment",
    [
        ("gamma", 0, "decoding.gamma: expected an integer between 1 and 64, got 0"),
        ("gamma", 65, "decoding.gamma: expected an integer between 1 and 64, got 65"),
        ("gamma", 2.5, "decoding.gamma: expected an integer between 1 and 64, got 2.5"),
        ("gamma", True, "decoding.gamma: expected an integer between 1 and 64, got true"),
        ("max_new_tokens", 0, "decoding.max_new_tokens: expected an integer >= 1, got 0"),
        ("max_new_tokens", "10", 'decoding.max_new_tokens: expected an integer >= 1, got "10"'),
        ("max_new_tokens", False, "decoding.max_new_tokens: expected an integer >= 1, got false"),
        ("temperature", -0.1, "decoding.temperature: expected a number >= 0, got -0.1"),
        ("temperature", "hot", 'decoding.temperature: expected a number >= 0, got "hot"'),
        ("temperature", True, "decoding.temperature: expected a number >= 0, got true"),
        ("temperature", float("nan"), "decoding.temperature: expected a number >= 0, got nan"),
        ("top_p", 0, "decoding.top_p: expected a number in (0, 1], got 0"),
        ("top_p", 1.5, "decoding.top_p: expected a number in (0, 1], got 1.5"),
        ("top_p", "high", 'decoding.top_p: expected a number in (0, 1], got "high"'),
        ("top_k", 0, "decoding.top_k: expected an integer >= 1, got 0"),
        ("top_k", 1.0, "decoding.top_k: expected an integer >= 1, got 1.0"),
        ("top_k", True, "decoding.top_k: expected an integer >= 1, got true"),
        ("seed", -1, "decoding.seed: expected an integer >= 0, got -1"),
        ("seed", "42", 'decoding.seed: expected an integer >= 0, got "42"'),
        ("seed", [1], "decoding.seed: expected an integer >= 0, got [1]"),
    ],
)
def test_decoding_refusals(key, value, fragment):
    refused(with_decoding(**{key: value}), fragment)


@pytest.mark.parametrize(
    "key, value, fragment",
    [
        ("model", "", 'target.model: expected a non-empty string, got ""'),
        ("model", 7, "target.model: expected a non-empty string, got 7"),
        ("dtype", "fp16", 'target.dtype: expected one of float32, float16, bfloat16, float64, got "fp16"'),
        ("device", "gpu", 'target.device: expected one of auto, cpu, cuda, cuda:N, mps, got "gpu"'),
        ("device", "cuda:x", 'target.device: expected one of auto, cpu, cuda, cuda:N, mps, got "cuda:x"'),
        ("quantization", "3bit", 'target.quantization: expected one of null, 8bit, 4bit, got "3bit"'),
        ("quantization", 8, "target.quantization: expected one of null, 8bit, 4bit, got 8"),
        ("trust_remote_code", "yes", 'target.trust_remote_code: expected true or false, got "yes"'),
        ("trust_remote_code", 1, "target.trust_remote_code: expected true or false, got 1"),
        ("revision", 3, "target.revision: expected a non-empty string, got 3"),
        ("min_pixels", 0, "target.min_pixels: expected an integer >= 1, got 0"),
        ("max_pixels", "1e6", 'target.max_pixels: expected an integer >= 1, got "1e6"'),
    ],
)
def test_model_refusals(key, value, fragment):
    refused(with_target(**{key: value}), fragment)


def test_pixel_bounds_parse_and_min_above_max_is_refused():
    assert profile_from_dict(with_target(min_pixels=3136, max_pixels=1003520)).target.max_pixels == 1003520
    assert profile_from_dict(with_target()).target.min_pixels is None  # the model's own defaults
    refused(with_target(min_pixels=5000, max_pixels=4000),
            "target.min_pixels (5000) is larger than max_pixels (4000); set min_pixels to at most max_pixels")


def test_draft_section_checked_too():
    refused({"target": {"model": "t"}, "draft": {"model": "d", "dtype": "int8"}}, "draft.dtype: expected one of")
    refused({"target": {"model": "t"}, "draft": {"dtype": "float16"}}, "draft.model: required key is missing")


def test_drafter_must_be_nonempty_string():
    refused({"target": {"model": "t"}, "drafter": ""}, 'drafter: expected a non-empty string, got ""')
    refused({"target": {"model": "t"}, "drafter": 3}, "drafter: expected a non-empty string, got 3")


def test_unknown_key_nested():
    message = refused(with_decoding(gama=3), "decoding.gama: unknown key; known keys: gamma, max_new_tokens, ")
    assert message.endswith("known keys: gamma, max_new_tokens, temperature, top_p, top_k, seed, gamma_schedule, "
                            "tree_width, tree, tree_budget, tree_depth, tree_topk, repetition_penalty, compile")
    refused(with_target(dtpye="float16"), "target.dtpye: unknown key; known keys: model, dtype, device")


def test_unknown_key_top_level():
    refused(
        {"target": {"model": "t"}, "decode": {}},
        "decode: unknown key; known keys: target, draft, decoding, drafter",
    )
    # name/source are not profile keys
    refused({"target": {"model": "t"}, "name": "x"}, "name: unknown key")


@pytest.mark.parametrize("data", [[1, 2], "target", 3, None])
def test_top_level_not_a_mapping(data):
    refused(data, "profile: expected a mapping with keys target, draft, decoding, drafter, ensemble, captioner, pooling, ssd, head, got")


def test_section_not_a_mapping():
    refused({"target": "llava"}, 'target: expected a mapping with keys model, dtype, device')
    refused({"target": {"model": "t"}, "decoding": [5]}, "decoding: expected a mapping with keys gamma")


def test_missing_target():
    refused({"decoding": {"gamma": 3}}, 'target: required key is missing; add "target:" at the top level')


def test_missing_target_model():
    refused({"target": {"dtype": "float16"}}, 'target.model: required key is missing; add "model:" under "target"')
    refused({"target": None}, "target.model: required key is missing")


# --------------------------------------------------------------------------- one_image_files


def write(tmp_path, text, name="my-profile.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_load_by_path(tmp_path):
    path = write(tmp_path, yaml.safe_dump(GOOD))
    profile = load_profile(str(path))
    assert profile.name == "my-profile"
    assert profile.source == str(path)
    assert profile == profile_from_dict(GOOD, name="my-profile", source=str(path))


def test_load_by_path_without_suffix_or_separator(tmp_path, monkeypatch):
    write(tmp_path, "target: {model: t}\n", name="plainfile")
    monkeypatch.chdir(tmp_path)
    assert load_profile("plainfile").target.model == "t"


def test_load_yml_suffix(tmp_path):
    assert load_profile(str(write(tmp_path, "target: {model: t}\n", name="p.yml"))).name == "p"


def test_validation_error_names_the_file(tmp_path):
    path = write(tmp_path, "target: {model: t}\ndecoding: {gamma: five}\n")
    with pytest.raises(ProfileError) as info:
        load_profile(str(path))
    assert str(info.value) == f'decoding.gamma: expected an integer between 1 and 64, got "five" (in profile {path})'


def test_malformed_yaml(tmp_path):
    path = write(tmp_path, "target:\n  model: t\n  dtype: [float16\n")
    with pytest.raises(ProfileError) as info:
        load_profile(str(path))
    message = str(info.value)
    assert f"profile {path} is not valid YAML at line" in message
    assert "column" in message
    assert "\n" not in message


def test_malformed_yaml_line_column(tmp_path):
    path = write(tmp_path, "target:\n  model: t\n bad: : x\n")
    with pytest.raises(ProfileError, match=r"at line 3, column \d+"):
        load_profile(str(path))


def test_non_mapping_file(tmp_path):
    path = write(tmp_path, "- a\n- b\n")
    with pytest.raises(ProfileError, match=r"profile: expected a mapping .*got \[\"a\", \"b\"\] \(in profile "):
        load_profile(str(path))


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ProfileError, match=f"profile file {missing} doesn't exist"):
        load_profile(str(missing))
    with pytest.raises(ProfileError, match="doesn't exist"):
        load_profile("some/dir/profile")


def test_directory_is_refused(tmp_path):
    with pytest.raises(ProfileError, match="is not a file"):
        load_profile(str(tmp_path) + "/")


def test_unknown_name_lists_names():
    with pytest.raises(ProfileError) as info:
        load_profile("llava99")
    message = str(info.value)
    assert 'unknown profile "llava99"' in message
    for name in BUILTINS:
        assert name in message


def test_none_is_the_shipped_demo_profile():
    assert profiles.DEFAULT_PROFILE == "demo"
    assert load_profile(None).name == "demo"


def test_none_without_default_profile(monkeypatch):
    monkeypatch.setattr(profiles, "DEFAULT_PROFILE", None)
    with pytest.raises(ProfileError) as info:
        load_profile(None)
    message = str(info.value)
    assert "no profile given; pass --profile NAME|PATH" in message
    assert all(name in message for name in BUILTINS)


def test_none_uses_default_profile_when_set(monkeypatch):
    monkeypatch.setattr(profiles, "DEFAULT_PROFILE", "llava15-7b")
    assert load_profile(None).name == "llava15-7b"


# --------------------------------------------------------------------------- overrides


def test_apply_overrides():
    base = profile_from_dict(GOOD)
    new = apply_overrides(base, gamma=7, max_new_tokens=16, temperature=0, top_p=1, top_k=5, seed=0, drafter="t")
    assert new.decoding == DecodingSpec(7, 16, 0.0, 1.0, 5, 0)
    assert isinstance(new.decoding.temperature, float)
    assert new.drafter == "t"
    assert new.target == base.target and new.draft == base.draft and new.name == base.name
    assert base.decoding.gamma == 3  # original untouched


def test_apply_overrides_ignores_none():
    base = profile_from_dict(GOOD)
    assert apply_overrides(base, gamma=None, temperature=None, drafter=None) == base
    assert apply_overrides(base) == base


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"gamma": 0}, "--gamma: expected an integer between 1 and 64, got 0"),
        ({"gamma": True}, "--gamma: expected an integer between 1 and 64, got true"),
        ({"max_new_tokens": 0}, "--max-new-tokens: expected an integer >= 1, got 0"),
        ({"temperature": -1}, "--temperature: expected a number >= 0, got -1"),
        ({"top_p": 0.0}, "--top-p: expected a number in (0, 1], got 0.0"),
        ({"top_k": 0}, "--top-k: expected an integer >= 1, got 0"),
        ({"seed": "x"}, '--seed: expected an integer >= 0, got "x"'),
        ({"drafter": ""}, '--drafter: expected a non-empty string, got ""'),
    ],
)
def test_apply_overrides_refuses_bad_values(overrides, message):
    with pytest.raises(ProfileError) as info:
        apply_overrides(profile_from_dict(GOOD), **overrides)
    assert str(info.value) == message


def test_apply_overrides_unknown_name_is_a_programming_error():
    with pytest.raises(TypeError, match="gama"):
        apply_overrides(profile_from_dict(GOOD), gama=3)


# --------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("data", [GOOD, {"target": {"model": "t"}}])
def test_round_trip(data):
    profile = profile_from_dict(data, name="n", source="s")
    plain = profile_to_dict(profile)
    assert set(plain) == {"target", "draft", "decoding", "drafter", "ensemble", "captioner", "pooling", "ssd", "head"}
    dumped = yaml.safe_load(yaml.safe_dump(plain))
    assert profile_from_dict(dumped, name="n", source="s") == profile


def test_builtin_round_trip():
    for name in BUILTINS:
        profile = load_profile(name)
        assert profile_from_dict(profile_to_dict(profile), name=profile.name, source=profile.source) == profile


def test_profile_is_a_dataclass_with_expected_fields():
    import dataclasses

    assert [f.name for f in dataclasses.fields(Profile)] == ["name", "source", "target", "draft", "decoding", "drafter", "ensemble",
                                                        "captioner", "pooling", "ssd", "head"]


@pytest.mark.parametrize("ensemble, fragment", [
    ({"policy": "greedy"}, "ensemble.policy: expected one of grid, softmax, adaboost, random, static"),
    ({"grid_steps": 0}, "ensemble.grid_steps: expected an integer >= 1, got 0"),
    ({"tau": 0}, "ensemble.tau: expected a number > 0, got 0"),
    ({"tau": -1.5}, "ensemble.tau: expected a number > 0"),
    ({"window": 0}, 'ensemble.window: expected an integer >= 1 or "all", got 0'),
    ({"window": "some"}, "ensemble.window"),
    ({"members": ["m"]}, "ensemble.members: expected a list of at least two distinct letters"),
    ({"members": ["m", "m"]}, "ensemble.members"),
    ({"members": ["m", "x"]}, "ensemble.members"),
    ({"distance": "l2"}, "ensemble.distance: expected one of kl, tvd"),
    ({"labels": "fuzzy"}, "ensemble.labels: expected one of soft, hard"),
])
def test_bad_ensemble_settings_name_the_key(ensemble, fragment):
    with pytest.raises(ProfileError) as info:
        profile_from_dict({"target": {"model": "x"}, "ensemble": ensemble})
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_ensemble_captioner_and_pooling_sections():
    profile = profile_from_dict({"target": {"model": "x"},
                                 "ensemble": {"members": ["m", "t", "p"], "policy": "softmax", "tau": 0.5, "window": 4},
                                 "captioner": {"model": "cap", "prompt": "<CAPTION>", "max_new_tokens": 20},
                                 "pooling": {"kernel": 3}})
    assert profile.ensemble.members == ("m", "t", "p") and profile.ensemble.window == 4
    assert profile.captioner.model == "cap" and profile.captioner.max_new_tokens == 20
    assert profile.pooling.kernel == 3
    assert profile_from_dict({"target": {"model": "x"}, "ensemble": {"window": "all"}}).ensemble.window is None
    with pytest.raises(ProfileError, match="captioner.model: required key is missing"):
        profile_from_dict({"target": {"model": "x"}, "captioner": {"prompt": "hi"}})
    with pytest.raises(ProfileError, match="pooling.kernel: expected an integer between 1 and 16"):
        profile_from_dict({"target": {"model": "x"}, "pooling": {"kernel": 0}})

REPO = Path(__file__).resolve().parents[1]
QUESTION = "what is in the image?"
MAX_NEW = 5
runner = CliRunner()


# --------------------------------------------------------------------------- profile values


def test_a_seed_torch_cannot_take_is_refused_by_the_key_check(one_image_files, no_model_loading, tmp_path):
    too_big = str(MAX_SEED + 1)
    expected = f"expected an integer between 0 and {MAX_SEED} (the range torch's manual_seed takes), got {too_big}"
    assert_one_line_error(cli("generate", *one_image_files["images"], "-q", QUESTION, "--profile", one_image_files["profile"],
                              "--seed", too_big), f"--seed: {expected}")
    profile = tmp_path / "seed.yaml"
    profile.write_text(Path(one_image_files["profile"]).read_text().replace("decoding:", f"decoding:\n  seed: {too_big}"))
    assert_one_line_error(cli("generate", *one_image_files["images"], "-q", QUESTION, "--profile", str(profile)),
                          f"decoding.seed: {expected}")
    assert TokenPicker(SamplingParams(), MAX_SEED)  # the largest accepted seed is one torch takes


def test_unhashable_ensemble_members_are_the_usual_key_path_error():
    with pytest.raises(ProfileError, match=r'^ensemble.members: expected a list of at least two distinct letters '
                                           r'from m, t, c, p \(e.g. \[m, t\]\), got \[\["m"\], "t"\]$'):
        profile_from_dict({"target": {"model": "x"}, "ensemble": {"members": [["m"], "t"]}})


def billion_laughs(levels: int = 10, width: int = 10) -> str:
    """A profile whose target.dtype expands to width**levels strings (10**10: tens of gigabytes)."""
    lines = ["x0: &a0 [" + ", ".join(["lol"] * width) + "]"]
    lines += [f"x{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]" for i in range(1, levels)]
    return "bomb:\n" + "".join(f"  {line}\n" for line in lines) + f"target: {{model: x, dtype: *a{levels - 1}}}\n"


def run_capped(*args: str) -> subprocess.CompletedProcess:
    """``python *args`` in a process capped at 2 GiB of address space: a value built or printed whole
    (tens of gigabytes) kills that process with a MemoryError, not the machine."""

    def cap_memory():
        resource.setrlimit(resource.RLIMIT_AS, (2 * 2**30, 2 * 2**30))

    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120,
                          preexec_fn=cap_memory, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_a_yaml_alias_bomb_is_refused_before_it_is_built(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(billion_laughs())
    code = "import sys; from mmspec_cli.cli.app import main; sys.argv[0] = 'mmspec'; main()"
    result = run_capped("-c", code, "generate", "-q", QUESTION, "--profile", str(bomb))
    assert result.returncode == 2, result.stderr[-2000:]
    [line] = result.stderr.splitlines()
    assert line.startswith("error: profile ") and "expands, through its aliases, to more than 10,000 values" in line


def test_a_value_built_from_aliases_is_quoted_short_without_being_serialised_whole(tmp_path):
    """What ``yaml.safe_load`` builds from a bomb (10**10 strings, shared) handed to ``profile_from_dict``."""
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(billion_laughs())
    code = ("import sys, yaml; from mmspec_cli.models.profiles import profile_from_dict\n"
            "data = yaml.safe_load(open(sys.argv[1]).read()); del data['bomb']\n"
            "try:\n    profile_from_dict(data)\nexcept Exception as exc:\n    print(exc)")
    result = run_capped("-c", code, str(bomb))
    assert result.returncode == 0, result.stderr[-2000:]
    [line] = result.stdout.splitlines()
    assert line.startswith("target.dtype: expected one of float32, float16, bfloat16, float64, got [[[[")
    assert len(line) < 200


def test_a_self_containing_yaml_value_is_one_line(tmp_path):
    loop = tmp_path / "loop.yaml"
    loop.write_text("target: {model: x, dtype: &a [*a]}\n")
    with pytest.raises(ProfileError, match="has an alias inside its own anchor"):
        load_profile(str(loop))


def test_bad_values_are_quoted_short_without_being_serialised_whole():
    loop: list = []
    loop.append(loop)
    for value in (loop, 10**5000, "x" * 10**6, {"k" * 10**6: 1}):
        with pytest.raises(ProfileError) as caught:
            profile_from_dict({"target": {"model": "x", "dtype": value}})
        assert len(str(caught.value)) < 200
    assert _show({"a": [1, None, True, 1.5]}) == '{"a": [1, null, true, 1.5]}'


def test_yaml_too_deep_or_with_unreadable_numbers_is_one_line(tmp_path):
    deep = tmp_path / "deep.yaml"
    deep.write_text("target: {model: x, dtype: " + "[" * 5000 + "]" * 5000 + "}\n")
    with pytest.raises(ProfileError, match="nested too deeply"):
        load_profile(str(deep))
    digits = tmp_path / "digits.yaml"
    digits.write_text("target: {model: x}\ndecoding: {seed: " + "1" * 5000 + "}\n")
    with pytest.raises(ProfileError, match="holds a value that can't be read"):
        load_profile(str(digits))
    with pytest.raises(ProfileError, match="decoding.temperature: expected a number >= 0, got an integer of about"):
        profile_from_dict({"target": {"model": "x"}, "decoding": {"temperature": 10**400}})


# --------------------------------------------------------------------------- --profile <(...)


def feed(path: str, text: str) -> threading.Thread:
    """Write ``text`` into the pipe at ``path`` from another thread (opening a FIFO blocks until it is read)."""
    def write() -> None:
        with open(path, "w") as pipe:
            pipe.write(text)

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    return thread


def test_a_profile_from_a_fifo_is_read_like_a_file(tmp_path):
    fifo = tmp_path / "profile.fifo"
    os.mkfifo(fifo)
    writer = feed(str(fifo), "target: {model: some/target}\ndecoding: {gamma: 7}\n")
    profile = load_profile(str(fifo))
    writer.join(timeout=10)
    assert profile.target.model == "some/target" and profile.decoding.gamma == 7


def test_process_substitution_dev_fd_works_on_the_command_line(tmp_path):
    """``--profile <(...)`` hands the command /dev/fd/N, the read end of a pipe."""
    records = write_records(tmp_path / "r.jsonl", made_records(("ar", "m")))
    read, write = os.pipe()
    os.set_inheritable(read, True)
    try:
        with os.fdopen(write, "w") as pipe:
            pipe.write(Path(summary_profile(tmp_path)).read_text())
        result = runner.invoke(app, ["bench", "--summarize", str(records), "--profile", f"/dev/fd/{read}",
                                     "--format", "json"])
    finally:
        os.close(read)
    assert result.exit_code == 0, result.stderr
    assert {r["drafter"] for r in json.loads(result.stdout)["rows"]} == {"ar", "m"}


def test_a_device_or_a_folder_is_still_refused(tmp_path):
    with pytest.raises(ProfileError, match="profile /dev/zero is not a file or a pipe; pass a YAML file"):
        load_profile("/dev/zero")
    with pytest.raises(ProfileError, match="is not a file but a folder"):
        load_profile(str(tmp_path) + "/")
