"""Tiny LLaVA families built in-process, for tests and CPU benchmarks.

A byte-level BPE tokenizer trained with `tokenizers`, a CLIPImageProcessor from a config,
a LlavaProcessor with a LLaVA-1.5 style chat template, and LlavaForConditionalGeneration
models with a few small layers. Everything is saved with ``save_pretrained`` and loaded
back through ``mmspec_cli.models.loading.load_model``, the code path of hub ids.
"""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image
from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration, PreTrainedTokenizerFast

from mmspec_cli.demo.training import processor
from mmspec_cli.demo.training.processor import CHAT_TEMPLATE, IMAGE_TOKEN_ID, SPECIAL, make_processor  # noqa: F401

CORPUS = [
    "USER: what is in the image? ASSISTANT: a red circle above a blue square, and two green triangles.",
    "USER: describe the picture in detail ASSISTANT: the picture shows three yellow stars on a white background.",
    "how many shapes are there? there are four shapes: one circle, two squares and a star.",
    "what changed between the two images? the blue square moved to the left and the circle turned red.",
    "finish the story: the cat sat on the mat, then it jumped over the fence and ran away.",
]


def train_tokenizer(vocab_size: int = 400, corpus=CORPUS, repeat: int = 20) -> PreTrainedTokenizerFast:
    """The demo family's BPE tokenizer, trained on the tests' small corpus."""
    return processor.train_tokenizer(vocab_size, corpus, repeat)


def make_config(vocab_size: int, hidden: int = 32, layers: int = 2, image_size: int = 28,
                vision_hidden: int = 16) -> LlavaConfig:
    """``vision_hidden``: the CLIP tower's width (its MLP twice that). A family for 4-bit bitsandbytes on an AVX512-BF16
    CPU needs every quantized Linear's output size a multiple of 32 and its input size a multiple of 64 (the
    quantization block): ``vision_hidden=64`` with ``hidden=64`` (key/value projections 2 heads × 16)."""
    vision = CLIPVisionConfig(hidden_size=vision_hidden, intermediate_size=2 * vision_hidden, num_hidden_layers=1,
                              num_attention_heads=2, image_size=image_size, patch_size=14)
    text = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                       num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=3)
    return LlavaConfig(vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN_ID,
                       vision_feature_select_strategy="default", vision_feature_layer=-1)


def make_model(vocab_size: int, seed: int, hidden: int = 32, layers: int = 2, sharpen: float = 4.0,
               image_size: int = 28, vision_hidden: int = 16):
    """A random float64 LLaVA; ``sharpen`` scales the LM head so argmaxes are far from ties. ``vision_hidden``: the
    vision tower's width (:func:`make_config`)."""
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(make_config(vocab_size, hidden, layers, image_size,
                                                      vision_hidden)).to(torch.float64)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(sharpen)
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 3
    return model


def perturbed_copy(model, scale: float, seed: int):
    """A copy of ``model`` (any tiny family) with Gaussian noise (relative ``scale``) on every weight."""
    torch.manual_seed(seed)
    copy = type(model)(model.config).to(torch.float64)
    copy.load_state_dict(model.state_dict())
    with torch.no_grad():
        for p in copy.parameters():
            p.add_(torch.randn_like(p) * scale * p.std().clamp_min(1e-3))
    copy.generation_config = model.generation_config
    return copy


def save(model, processor, path: Path) -> str:
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return str(path)


def images(n: int) -> list[Image.Image]:
    colours = [(220, 30, 30), (30, 200, 60), (40, 60, 210), (240, 220, 20)]
    out = []
    for i in range(n):
        img = Image.new("RGB", (40 + 8 * i, 32), colours[i % len(colours)])
        for x in range(0, 40, 7):
            img.putpixel((x, (x * (i + 3)) % 32), (255, 255, 255))
        out.append(img)
    return out


# --- LLaVA-NeXT and LLaVA-OneVision targets (anyres tiling), sharing the tokenizer above ---------------

# (height, width) resolutions of the anyres grid: one 28×28 tile, or two side by side / stacked.
GRID_PINPOINTS = [[28, 28], [28, 56], [56, 28]]


def _sharpen_and_ids(model, sharpen: float):
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(sharpen)
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 3
    return model


def make_next_processor(tokenizer, chat_template: str | None = CHAT_TEMPLATE):
    """A LlavaNextProcessor: CLIP-style 28×28 base image plus 28×28 anyres tiles (PIL backend, no torchvision)."""
    from transformers import LlavaNextImageProcessorPil, LlavaNextProcessor

    image_processor = LlavaNextImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28},
                                                 image_grid_pinpoints=GRID_PINPOINTS)
    return LlavaNextProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=14,
                              vision_feature_select_strategy="default", num_additional_image_tokens=1,
                              chat_template=chat_template)


def make_next_config(vocab_size: int, hidden: int = 32, layers: int = 2):
    from transformers import LlavaNextConfig

    base = make_config(vocab_size, hidden, layers)
    return LlavaNextConfig(vision_config=base.vision_config, text_config=base.text_config,
                           image_token_id=IMAGE_TOKEN_ID, vision_feature_select_strategy="default",
                           vision_feature_layer=-1, image_grid_pinpoints=GRID_PINPOINTS, image_seq_length=4)


def make_next_model(vocab_size: int, seed: int, hidden: int = 32, layers: int = 2, sharpen: float = 4.0):
    """A random float64 LLaVA-NeXT (CLIP 28/14 tower, Llama text) with a sharpened LM head."""
    from transformers import LlavaNextForConditionalGeneration

    torch.manual_seed(seed)
    model = LlavaNextForConditionalGeneration(make_next_config(vocab_size, hidden, layers)).to(torch.float64)
    return _sharpen_and_ids(model, sharpen)


def make_onevision_processor(tokenizer, chat_template: str | None = CHAT_TEMPLATE):
    """A LlavaOnevisionProcessor: SigLIP-style 28×28 images (4 tokens each) plus anyres tiles (PIL backend).

    transformers 5.x builds this processor only with a video processor, and its video processors
    need torchvision. With torchvision the processor is the standard one (saveable, and loadable
    by ``AutoProcessor``). Without it, it is the images-only one mmspec's loader builds
    (``loading.images_only_processor``): it processes images and text like the standard one but
    cannot be saved (``tests/test_model_families.py`` writes its files instead).
    """
    from transformers import LlavaOnevisionImageProcessorPil, LlavaOnevisionProcessor
    from transformers.utils import is_torchvision_available

    from mmspec_cli.models.loading import images_only_processor

    image_processor = LlavaOnevisionImageProcessorPil(size={"height": 28, "width": 28},
                                                      image_grid_pinpoints=GRID_PINPOINTS)
    kwargs = dict(num_image_tokens=4, vision_feature_select_strategy="full", vision_aspect_ratio="anyres_max_9",
                  chat_template=chat_template)
    if is_torchvision_available():
        from transformers import LlavaOnevisionVideoProcessor

        return LlavaOnevisionProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                       video_processor=LlavaOnevisionVideoProcessor(size={"height": 28, "width": 28}),
                                       **kwargs)
    return images_only_processor(LlavaOnevisionProcessor, image_processor, tokenizer, **kwargs)


def make_onevision_config(vocab_size: int, hidden: int = 32, layers: int = 2):
    from transformers import LlavaOnevisionConfig, Qwen2Config, SiglipVisionConfig

    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14, vision_use_head=False)
    text = Qwen2Config(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                       num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=3)
    # No <video> token in the shared tokenizer: the video id is one no token has.
    return LlavaOnevisionConfig(vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN_ID,
                                video_token_id=vocab_size, vision_feature_select_strategy="full",
                                vision_feature_layer=-1, image_grid_pinpoints=GRID_PINPOINTS,
                                vision_aspect_ratio="anyres_max_9")


def make_onevision_model(vocab_size: int, seed: int, hidden: int = 32, layers: int = 2, sharpen: float = 4.0):
    """A random float64 LLaVA-OneVision (SigLIP 28/14 tower, Qwen2 text) with a sharpened LM head."""
    from transformers import LlavaOnevisionForConditionalGeneration

    torch.manual_seed(seed)
    model = LlavaOnevisionForConditionalGeneration(make_onevision_config(vocab_size, hidden, layers)).to(torch.float64)
    return _sharpen_and_ids(model, sharpen)


def llava_draft_for(target, scale: float, seed: int):
    """A LLaVA-1.5-style draft (LlavaForConditionalGeneration, CLIP 28/14 tower) for any tiny target.

    It takes the target's text config; its language model and LM head are the target's plus
    Gaussian noise (relative ``scale``), and so are its vision tower and projector when the
    target's tower is the same CLIP (LLaVA-NeXT): the draft agrees with the target often, not always.
    """
    torch.manual_seed(seed)
    text = target.config.text_config
    base = make_config(text.vocab_size)
    config = LlavaConfig(vision_config=base.vision_config, text_config=text, image_token_id=IMAGE_TOKEN_ID,
                         vision_feature_select_strategy="default", vision_feature_layer=-1)
    draft = LlavaForConditionalGeneration(config).to(torch.float64)
    prefixes = ["model.language_model.", "lm_head."]
    if target.config.vision_config.to_dict() == config.vision_config.to_dict():
        prefixes += ["model.vision_tower.", "model.multi_modal_projector."]
    own = draft.state_dict()
    shared = {k: v for k, v in target.state_dict().items()
              if k.startswith(tuple(prefixes)) and k in own and own[k].shape == v.shape}
    draft.load_state_dict(shared, strict=False)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * scale * p.std().clamp_min(1e-3))
    draft.generation_config.eos_token_id = 2
    draft.generation_config.pad_token_id = 3
    return draft
