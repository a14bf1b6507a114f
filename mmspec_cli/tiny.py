"""Tiny LLaVA families built in-process, for tests and CPU benchmarks.

A byte-level BPE tokenizer trained with `tokenizers`, a CLIPImageProcessor from a config,
a LlavaProcessor with a LLaVA-1.5 style chat template, and LlavaForConditionalGeneration
models with a few small layers. Everything is saved with ``save_pretrained`` and loaded
back through ``mmspec_cli.models.load_model``, the code path of hub ids.
"""

from __future__ import annotations

from pathlib import Path

import torch
from PIL import Image
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    CLIPImageProcessor,
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    PreTrainedTokenizerFast,
)

SPECIAL = ["<unk>", "<s>", "</s>", "<pad>", "<image>"]
IMAGE_TOKEN_ID = 4
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}USER: "
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>\n{% endif %}{% endfor %}"
    "{% for c in m['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %} "
    "{% else %}ASSISTANT: {% for c in m['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}</s>"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
CORPUS = [
    "USER: what is in the image? ASSISTANT: a red circle above a blue square, and two green triangles.",
    "USER: describe the picture in detail ASSISTANT: the picture shows three yellow stars on a white background.",
    "how many shapes are there? there are four shapes: one circle, two squares and a star.",
    "what changed between the two images? the blue square moved to the left and the circle turned red.",
    "finish the story: the cat sat on the mat, then it jumped over the fence and ran away.",
]


def train_tokenizer(vocab_size: int = 400, corpus=CORPUS) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(corpus) * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", extra_special_tokens={"image_token": "<image>"})


def make_processor(tokenizer, chat_template: str | None = CHAT_TEMPLATE) -> LlavaProcessor:
    image_processor = CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    return LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=14,
                          vision_feature_select_strategy="default", num_additional_image_tokens=1,
                          chat_template=chat_template)


def make_config(vocab_size: int, hidden: int = 32, layers: int = 2) -> LlavaConfig:
    vision = CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                              image_size=28, patch_size=14)
    text = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                       num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, pad_token_id=3)
    return LlavaConfig(vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN_ID,
                       vision_feature_select_strategy="default", vision_feature_layer=-1)


def make_model(vocab_size: int, seed: int, hidden: int = 32, layers: int = 2, sharpen: float = 4.0):
    """A random float64 LLaVA; ``sharpen`` scales the LM head so argmaxes are far from ties."""
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(make_config(vocab_size, hidden, layers)).to(torch.float64)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(sharpen)
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 3
    return model


def perturbed_copy(model, scale: float, seed: int):
    """A copy of ``model`` with Gaussian noise (relative ``scale``) on every weight."""
    torch.manual_seed(seed)
    copy = LlavaForConditionalGeneration(model.config).to(torch.float64)
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
