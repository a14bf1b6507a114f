"""LLaVA-NeXT and LLaVA-OneVision targets with a LLaVA-1.5-style draft sharing the tokenizer.

The target expands each ``<image>`` with its own processor (anyres tiles, ``image_sizes``); the
draft expands the same prompt text its own way (one 28×28 image, 4 tokens). Greedy speculative
decoding must still reproduce the target's own ``generate(do_sample=False)`` token for token.

transformers 5.x builds a OneVision processor only with a video processor, which needs
torchvision. Without torchvision ``load_model`` builds it from the image processor and the
tokenizer (``loading.images_only_processor``); the test saves its files by hand there, since such a
processor can't be saved. With torchvision everything goes through ``save_pretrained``.
"""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image
from transformers.utils import is_torchvision_available

from tests import tiny
from mmspec_cli.drafters import NoDrafter, build_drafter
from mmspec_cli.decoding.engine import SpeculativeDecoder
from mmspec_cli.errors import ModelLoadError
from mmspec_cli.models.loading import LoadedModel, check_compatible, load_model
from mmspec_cli.models.profiles import ModelSpec
from mmspec_cli.models.prompts import process, render_prompt
from tests.helpers import FOLLOW_UP, QUESTION, decode, image_in_second_turn, own_generate

MAX_NEW = 16
FAMILIES = {
    "next": (tiny.make_next_model, tiny.make_next_processor, "LlavaNextForConditionalGeneration"),
    "onevision": (tiny.make_onevision_model, tiny.make_onevision_processor, "LlavaOnevisionForConditionalGeneration"),
}


def load(path: str, role: str) -> LoadedModel:
    return load_model(ModelSpec(model=path, dtype="float64", device="cpu"), role)


@pytest.fixture(scope="module")
def tokenizer():
    return tiny.train_tokenizer()  # ONE tokenizer for every target and draft: their vocabularies agree


@pytest.fixture(scope="module")
def families(tmp_path_factory, tokenizer):
    """Per family: the target, a LLaVA-1.5-style draft sharing its text weights (perturbed), and a
    plain tiny LLaVA-1.5 draft (Llama text, unrelated weights), all loaded back from disk."""
    root = tmp_path_factory.mktemp("families")
    vocab = len(tokenizer)
    draft_processor = tiny.make_processor(tokenizer)
    # seed 9: a draft that never proposes the <image> id here (that hazard has its own tests below)
    plain_dir = tiny.save(tiny.make_model(vocab, seed=9), draft_processor, root / "plain_llava15")
    out = {}
    for family, (make_model, make_processor, _) in FAMILIES.items():
        target = make_model(vocab, seed=0)
        processor = make_processor(tokenizer)
        draft_dir = tiny.save(tiny.llava_draft_for(target, 0.15, seed=1), draft_processor, root / f"{family}_draft")
        if family == "onevision" and not is_torchvision_available():
            save_without_video_processor(target, processor, root / family)
            loaded = load(str(root / family), "target")
        else:
            loaded = load(tiny.save(target, processor, root / family), "target")
        out[family] = {"target": loaded, "draft": load(draft_dir, "draft"), "plain": load(plain_dir, "draft")}
    return out


def save_without_video_processor(model, processor, path) -> None:
    """What save_pretrained would write for a OneVision target, less its (torchvision) video processor."""
    model.save_pretrained(path)
    processor.tokenizer.save_pretrained(path)
    processor.image_processor.save_pretrained(path)
    config = {"processor_class": type(processor).__name__, "num_image_tokens": processor.num_image_tokens,
              "vision_feature_select_strategy": processor.vision_feature_select_strategy,
              "vision_aspect_ratio": processor.vision_aspect_ratio}
    (path / "processor_config.json").write_text(json.dumps(config))
    (path / "chat_template.jinja").write_text(processor.chat_template)


def reference(target, questions, answers, images, max_new_tokens=MAX_NEW) -> list[int]:
    """:func:`~tests.helpers.own_generate` with every image in the first turn."""
    return own_generate(target, questions, answers, len(images), images, max_new_tokens)


@pytest.fixture(scope="module")
def refs(families):
    return {(family, n): reference(models["target"], [QUESTION], [], tiny.images(n))
            for family, models in families.items() for n in (0, 1, 2)}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_pair_is_what_it_claims(families, family):
    target, draft = families[family]["target"], families[family]["draft"]
    assert type(target.model).__name__ == FAMILIES[family][2]
    assert type(target.processor).__name__ == FAMILIES[family][2].replace("ForConditionalGeneration", "Processor")
    assert type(draft.model).__name__ == "LlavaForConditionalGeneration"
    assert type(draft.processor).__name__ == "LlavaProcessor"
    assert target.image_token_id == draft.image_token_id == tiny.IMAGE_TOKEN_ID


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("draft", ["draft", "plain"])
def test_check_compatible_passes(families, tiny_models, family, draft):
    """A NeXT or OneVision target and a LLaVA-1.5 draft pass when they share the tokenizer, though their
    processors differ; the same target with a draft of another tokenizer is refused, so passing means something."""
    target = families[family]["target"]
    assert type(target.processor) is not type(families[family][draft].processor)
    match = check_compatible(target, families[family][draft])
    assert not match.reads_other_ids and not match.writes_other_ids  # one tokenizer: the draft reads target ids
    with pytest.raises(ModelLoadError, match="another tokenizer than the target's"):
        check_compatible(target, tiny_models["other_tokenizer"])


@pytest.mark.parametrize("family", FAMILIES)
def test_each_model_expands_the_images_its_own_way(families, family):
    target, draft = families[family]["target"], families[family]["draft"]
    text = render_prompt(target.processor, [QUESTION], [], 2)
    mine, theirs = process(target.processor, text, tiny.images(2)), process(draft.processor, text, tiny.images(2))
    assert "image_sizes" in mine.vision and "image_sizes" not in theirs.vision
    if family == "next":
        assert mine.vision["pixel_values"].shape[1] > 1  # base image + anyres tiles
    else:  # several images: OneVision's multi-image layout (no tiling), as its own chat template path uses
        assert mine.vision["pixel_values"].shape[1] == 1 and mine.vision["batch_num_images"].tolist() == [2]
    assert theirs.ids.count(tiny.IMAGE_TOKEN_ID) == 2 * 4  # LLaVA-1.5: 2×2 patches per image
    assert mine.ids.count(tiny.IMAGE_TOKEN_ID) > theirs.ids.count(tiny.IMAGE_TOKEN_ID)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("drafter", ["ar", "m", "t", "mt", "tabed"])
@pytest.mark.parametrize("gamma", [1, 3])
@pytest.mark.parametrize("n_images", [0, 1, 2])
def test_greedy_equals_target_generate(families, refs, family, drafter, gamma, n_images):
    models = families[family]
    turn = decode(models["target"], drafter, models["draft"], gamma=gamma, n_images=n_images,
                  max_new_tokens=MAX_NEW).turns[0]
    assert turn.token_ids == refs[family, n_images]
    if drafter == "m" and gamma == 3:
        assert 0.0 < turn.stats.acceptance_rate < 1.0  # both paths taken: accepted and rejected drafts


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("drafter", ["m", "t", "tabed"])
def test_an_unrelated_llava15_draft_is_still_lossless(families, refs, family, drafter):
    models = families[family]
    turn = decode(models["target"], drafter, models["plain"], max_new_tokens=MAX_NEW).turns[0]
    assert turn.token_ids == refs[family, 1]


@pytest.mark.parametrize("family", FAMILIES)
def test_two_turns_equal_generate(families, family):
    target, draft = families[family]["target"], families[family]["draft"]
    first, second = decode(target, "mt", draft, max_new_tokens=MAX_NEW, questions=(QUESTION, FOLLOW_UP)).turns
    assert first.token_ids == reference(target, [QUESTION], [], tiny.images(1))
    assert second.token_ids == reference(target, [QUESTION, FOLLOW_UP], [first.text], tiny.images(1))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("drafter", ["m", "tabed"])
def test_an_image_in_the_second_turn_keeps_the_targets_own_output(families, family, drafter):
    """NeXT feeds only the new image's tiles after the cached turn; OneVision lays a set of images out as a whole
    (``batch_num_images``), so its second turn encodes the prompt again: the same tokens either way."""
    models = families[family]
    images = [tiny.images(1)[0], Image.new("RGB", (24, 64), (200, 30, 60))]
    mine, own = image_in_second_turn(models["target"], drafter, models["draft"], images[:1], images[1:],
                                     max_new_tokens=MAX_NEW)
    assert mine == own


@pytest.mark.parametrize("family", FAMILIES)
def test_a_reused_decoder_sees_an_image_of_another_shape(families, family):
    """A tall image picks another anyres grid: another placeholder count, another ``image_sizes``."""
    models = families[family]
    target = models["target"]
    wide, tall = tiny.images(1)[0], Image.new("RGB", (24, 64), (200, 30, 60))
    text = render_prompt(target.processor, [QUESTION], [], 1)
    counts = [process(target.processor, text, [img]).ids.count(tiny.IMAGE_TOKEN_ID) for img in (wide, tall)]
    assert counts[0] != counts[1]
    for name in ("m", "mt"):
        decoder = SpeculativeDecoder(target, build_drafter(name, target, models["draft"]), gamma=3,
                                     max_new_tokens=MAX_NEW)
        decoder.generate([wide], [QUESTION])
        assert decoder.generate([tall], [QUESTION]).turns[0].token_ids == reference(target, [QUESTION], [], [tall])


@pytest.mark.skipif(is_torchvision_available(), reason="with torchvision the standard processor loads")
def test_onevision_loads_without_torchvision(families):
    """The loader builds the processor without its video part; it processes images as the standard one would."""
    target = families["onevision"]["target"]
    assert getattr(target.processor, "images_only", False)
    assert target.processor.num_image_tokens == 4 and target.processor.chat_template == tiny.CHAT_TEMPLATE


# --- An <image> id outside the prompt -----------------------------------------------------------------
# A drafted or generated <image> id is an ordinary vocabulary entry once the prompt is over: it gets no
# pixels (as in transformers' own generate), and the runner must not take it for a prompt placeholder.


def image_token_lm_head(model) -> None:
    """Make ``model`` emit the <image> id at every step: an LM head with zero weights and a bias on it."""
    head = model.get_output_embeddings()
    new = torch.nn.Linear(head.in_features, head.out_features, bias=True, dtype=head.weight.dtype)
    with torch.no_grad():
        new.weight.zero_()
        new.bias.zero_()
        new.bias[tiny.IMAGE_TOKEN_ID] = 1.0
    model.set_output_embeddings(new)


@pytest.fixture(scope="module")
def image_token_draft(tokenizer):
    model = tiny.make_model(len(tokenizer), seed=9).eval()
    image_token_lm_head(model)
    return LoadedModel(role="draft", name="image-token draft", model=model, processor=tiny.make_processor(tokenizer))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_target_that_generates_the_image_id_matches_generate(tokenizer, families, family):
    model = FAMILIES[family][0](len(tokenizer), seed=0).eval()
    image_token_lm_head(model)
    target = LoadedModel(role="target", name=family, model=model, processor=families[family]["target"].processor)
    ref = reference(target, [QUESTION], [], tiny.images(1), max_new_tokens=4)
    assert ref == [tiny.IMAGE_TOKEN_ID] * 4
    decoder = SpeculativeDecoder(target, NoDrafter(), gamma=3, max_new_tokens=4)
    assert decoder.generate(tiny.images(1), [QUESTION]).turns[0].token_ids == ref


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("drafter", ["m", "t", "mt"])
def test_a_drafted_image_id_is_just_rejected(families, refs, image_token_draft, family, drafter):
    target = families[family]["target"]
    decoder = SpeculativeDecoder(target, build_drafter(drafter, target, image_token_draft), gamma=3,
                                 max_new_tokens=MAX_NEW)
    turn = decoder.generate(tiny.images(1), [QUESTION]).turns[0]
    assert turn.token_ids == refs[family, 1]
    assert turn.stats.accepted == 0


def test_a_next_draft_is_refused_for_batched_image_rows(families):
    """Batched m/p rows build LLaVA-1.5 inputs themselves: a LLaVA-NeXT draft is refused before decoding."""
    from mmspec_cli.errors import ModelLoadError

    target = families["next"]["target"]
    with pytest.raises(ModelLoadError, match="LLaVA-1.5-style draft"):
        build_drafter("mt", target, target)
    assert build_drafter("t", target, target).name == "t"  # single text-only drafting works with any draft


def test_a_prompt_too_long_for_its_images_asks_for_what_shrinks_them():
    """A LLaVA-1.5 image costs its 576 tokens at any size, so only fewer images help; NeXT and OneVision tile an
    image by its size, so a smaller one helps too."""
    from types import SimpleNamespace

    from mmspec_cli.models.families import family_of

    def fix(model_type: str) -> str:
        return family_of(SimpleNamespace(model_type=model_type)).fewer_image_tokens(2, 100, "target")

    assert fix("llava") == "pass fewer images"
    assert fix("llava_next") == fix("llava_onevision") == "pass fewer or smaller images"
