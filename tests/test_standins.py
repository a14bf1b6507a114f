"""The shipped profiles run on stand-ins of their hub models (``tests/standins``: each model's own published files,
its sizes shrunk, random weights), loaded by the profile's own hub ids from a Hugging Face cache with the hub offline.

Each profile runs as shipped but for three settings, the same for every profile: float64 (so that a near-tie can't
flip an argmax: the profiles' half precision is checked to run, not to match), 12 new tokens, and for Qwen-VL targets
MMSpec's pixel bound (1280 merged patches an image; the published default, 16,384 for a 4000×3000 photo, needs a GPU's
attention in the vision tower). Images are of the sizes users send: a 4000×3000 photo, a chart, a 1×2000 strip.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from mmspec_cli.api import ModelSet
from mmspec_cli.models.profiles import load_profile
from tests.helpers import assert_one_line_error, cli, own_generate, speculative_decoder
from tests.standins import STANDINS, build_hub_cache

QUESTION = "What does the image show?"
MAX_NEW = 12
#: MMSpec's upper pixel bound (1280 merged patches), per patch size of the family
QWEN_MAX_PIXELS = {14: 1280 * 28 * 28, 16: 1280 * 32 * 32}
#: profile -> the drafter its stand-ins run besides ar; "PROFILE+DRAFT": the profile with another draft model
PROFILES = {"llava15-7b": "m", "qwen25-vl-7b": "m", "qwen25-vl-7b-text": "t", "qwen3-vl-8b": "m",
            "qwen25-vl-7b-vispec": "vispec", "llava15-7b+double7/vicuna-68m": "t",
            "qwen3-vl-8b+Qwen/Qwen3-0.6B": "t"}


def photo() -> Image.Image:
    return Image.fromarray((np.random.default_rng(0).random((3000, 4000, 3)) * 255).astype("uint8"))


def chart() -> Image.Image:
    image = Image.new("RGB", (800, 600), "white")
    draw = ImageDraw.Draw(image)
    for i, height in enumerate((120, 300, 220, 450)):
        draw.rectangle([100 + i * 150, 550 - height, 200 + i * 150, 550], fill=(40 * i, 100, 200))
    return image


def strip() -> Image.Image:
    return Image.new("RGB", (1, 2000), (30, 60, 90))


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """The stand-ins as a Hugging Face cache, the hub offline: a profile's hub ids load from it."""
    import huggingface_hub.constants

    cache = build_hub_cache(tmp_path_factory.mktemp("hub"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
        patch.setenv("HF_HUB_CACHE", str(cache))
        patch.setenv("HF_HUB_OFFLINE", "1")
        yield cache


def profile_as_tested(name: str):
    """The shipped profile ``name`` with the module docstring's three settings (``PROFILE+DRAFT``: another draft)."""
    name, _, draft = name.partition("+")
    profile = load_profile(name)
    if draft:
        profile = dataclasses.replace(profile, draft=dataclasses.replace(profile.draft, model=draft),
                                      drafter=PROFILES[f"{name}+{draft}"])
    qwen = "Qwen" in profile.target.model and "VL" in profile.target.model
    bound = QWEN_MAX_PIXELS[16 if "Qwen3" in profile.target.model else 14] if qwen else None

    def model(spec, vision=True):
        return dataclasses.replace(spec, dtype="float64", device="cpu", max_pixels=bound if vision else None)

    draft = None if profile.draft is None else model(profile.draft, vision=profile.drafter != "t")
    return dataclasses.replace(profile, target=model(profile.target), draft=draft,
                               decoding=dataclasses.replace(profile.decoding, max_new_tokens=MAX_NEW))


@pytest.fixture(scope="module")
def loaded(hub):
    return {name: ModelSet.load(profile_as_tested(name), ["ar", drafter], threads=None) for name, drafter in PROFILES.items()}


def images_for(name: str, count: int) -> list:
    """0, 1 or 2 images; a Qwen-VL target refuses the strip (checked apart), so its second image is a chart."""
    second = chart() if name.startswith("qwen") else strip()
    return [photo(), second][:count] if count < 2 else [second, chart()]


@pytest.mark.parametrize("name", list(PROFILES))
@pytest.mark.parametrize("count", [0, 1, 2])
def test_every_drafter_of_a_profile_gives_its_standins_own_generate(loaded, name, count):
    models = loaded[name]
    images = images_for(name, count)
    own = own_generate(models.target, [QUESTION], [], count, images, MAX_NEW)
    for drafter in ("ar", PROFILES[name]):
        turn = models.decoder(drafter).generate(images, [QUESTION]).turns[0]
        assert turn.token_ids == own, (name, drafter, count)


def test_qwen25_05b_reads_the_7bs_extra_rows_as_its_newline(loaded):
    """Qwen2.5-0.5B-Instruct has Qwen2.5-VL-7B's tokenizer but 128 embedding rows fewer: those target ids are read
    as its newline token (it has no unk), every other id as itself."""
    from mmspec_cli.models.vocabulary import TargetIdEmbedding

    models = loaded["qwen25-vl-7b-text"]
    embedding = models.draft.model.get_input_embeddings()
    newline = models.draft.tokenizer("\n", add_special_tokens=False)["input_ids"][-1]
    assert isinstance(embedding, TargetIdEmbedding) and len(embedding.draft_ids) == 152064
    assert (embedding.draft_ids[151936:] == newline).all()
    assert (embedding.draft_ids[:151936] == torch.arange(151936)).all()


def test_a_vicuna_drafts_for_llava_through_the_table_of_ids(loaded):
    """Vicuna's tokenizer lacks LLaVA's <image> and <pad>, and its embedding LLaVA's 64 padding rows: the draft reads
    those target ids as its unk token (the decoding test above gives the target's own output)."""
    from mmspec_cli.models.vocabulary import TargetIdEmbedding

    models = loaded["llava15-7b+double7/vicuna-68m"]
    embedding = models.draft.model.get_input_embeddings()
    assert models.draft.language_only and isinstance(embedding, TargetIdEmbedding)
    assert embedding.draft_ids[32000] == embedding.draft_ids[32063] == models.draft.tokenizer.unk_token_id
    assert (embedding.draft_ids[:32000] == torch.arange(32000)).all()


def test_the_standins_keep_every_published_key(hub):
    """Shrinking changes sizes only: every key of every published config is still there."""
    import json

    from tests.standins import FILES, shrink_config

    for standin in STANDINS:
        published = json.loads((FILES / standin.folder / "config.json").read_text())
        shrunk = shrink_config(published)
        for section in (None, "text_config", "vision_config"):
            before = published.get(section, {}) if section else published
            after = shrunk.get(section, {}) if section else shrunk
            assert set(before) <= set(after), (standin.repo, section)


@pytest.mark.parametrize("name", ["llava15-7b", "qwen25-vl-7b-text"])
def test_a_profile_runs_at_its_own_precision(hub, tmp_path, name):
    """As shipped (half precision), through the CLI: the profile loads and decodes on the CPU."""
    path = tmp_path / "chart.png"
    chart().save(path)
    result = cli("generate", str(path), "-q", QUESTION, "--profile", name, "--max-new-tokens", "8")
    assert result.exit_code == 0, result.output
    assert "new tokens" in result.stderr + result.stdout


def test_a_strip_a_qwen_target_cannot_take_is_refused_in_one_line(hub, tmp_path):
    path = tmp_path / "strip.png"
    strip().save(path)
    result = cli("generate", str(path), "-q", QUESTION, "--profile", "qwen25-vl-7b", "--max-new-tokens", "4")
    assert_one_line_error(result, "aspect ratio must be smaller than 200")


def test_hf_assisted_generation_runs_with_a_language_draft_of_fewer_rows(loaded):
    """bench's ``hf-assisted`` peer passes both tokenizers where the vocabularies differ (HF's universal assisted
    decoding), as for Vicuna-68M under LLaVA-1.5-7B: the target's own output comes out."""
    from mmspec_cli.bench.hf_assisted import assisted_generate
    from mmspec_cli.models.prompts import render_prompt

    models = loaded["llava15-7b+double7/vicuna-68m"]
    images = [chart()]
    prompt = render_prompt(models.target.processor, [QUESTION], [], 1)
    result = assisted_generate(models.target, models.draft, images, prompt, gamma=3, max_new_tokens=MAX_NEW)
    assert result.token_ids == own_generate(models.target, [QUESTION], [], 1, images, MAX_NEW)


def test_a_qwen3_language_draft_drafts_token_trees(loaded):
    """Qwen3's decoder takes a custom 4-D mask like Qwen2's: the Qwen3-0.6B stand-in drafts width and dynamic
    trees for Qwen3-VL-8B's, with the target's own output."""
    models = loaded["qwen3-vl-8b+Qwen/Qwen3-0.6B"]
    images = [photo()]
    own = own_generate(models.target, [QUESTION], [], 1, images, MAX_NEW)
    for tree in ({"tree_width": 2}, {"tree": "dynamic", "tree_budget": 8, "tree_depth": 3, "tree_topk": 2}):
        decoder = speculative_decoder(models.target, "t", models.draft, gamma=3, max_new_tokens=MAX_NEW, **tree)
        assert decoder.generate(images, [QUESTION]).turns[0].token_ids == own, tree


def test_hf_assisted_refuses_a_language_draft_of_the_targets_vocabulary_size(loaded):
    """transformers would hand Qwen3-0.6B the Qwen3-VL target's image inputs (they share 151,936 rows): refused in
    one line before any sample runs."""
    from mmspec_cli.bench.peers import HfAssistedPeer
    from mmspec_cli.errors import InputError

    models = loaded["qwen3-vl-8b+Qwen/Qwen3-0.6B"]
    with pytest.raises(InputError, match="hf-assisted can't run the language-only draft"):
        HfAssistedPeer.check_models(models.target, models.draft)
    HfAssistedPeer.check_models(loaded["qwen25-vl-7b"].target, loaded["qwen25-vl-7b"].draft)  # a VL draft runs


def test_sampling_with_a_language_draft_keeps_the_standins_distribution(loaded):
    """Vicuna-68M samples drafts for LLaVA-1.5-7B's stand-in through the table of ids: the first two tokens of
    seeded runs follow the target's exact distribution (top-k 4; ``tests/distributions.py``)."""
    from tests.distributions import PARAMS, chi_square_p_value, exact_joint, sampled_pairs

    models = loaded["llava15-7b+double7/vicuna-68m"]
    images = [chart()]
    decoder = speculative_decoder(models.target, "t", models.draft, gamma=2, max_new_tokens=3, sampling=PARAMS)
    counts, _ = sampled_pairs(decoder, 200, question=QUESTION, images=images)
    expected = exact_joint(models.target, question=QUESTION, images=images)
    assert chi_square_p_value(counts, expected, 200) > 1e-3
