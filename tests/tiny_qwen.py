"""Tiny Qwen-VL families (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) built in-process, for tests and CPU benchmarks.

A byte-level BPE tokenizer with Qwen's special tokens, trained with `tokenizers`; the PIL
``Qwen2VLImageProcessorPil`` (native resolution: the number of vision tokens follows the image's
size); a Qwen-style chat template; and float64 models with a few small layers. Saved as
``save_pretrained`` would save them, less the video processor (which needs torchvision): a
``processor_config.json`` naming the processor class and the chat template. They load back through
``mmspec_cli.models.loading.load_model``, the code path of hub ids, which builds the processor from
the image processor and the tokenizer when the video processor can't load.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from PIL import Image
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2VLImageProcessorPil

from mmspec_cli.models.loading import images_only_processor
from tests.tiny import CORPUS

SPECIAL = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
           "<|image_pad|>", "<|video_pad|>"]
PAD_ID, EOS_ID, VISION_START_ID, VISION_END_ID, IMAGE_ID, VIDEO_ID = 1, 3, 4, 5, 6, 7
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: family -> (model class, processor class, vision patch size)
FAMILIES = {
    "qwen2_vl": ("Qwen2VLForConditionalGeneration", "Qwen2VLProcessor", 14),
    "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLProcessor", 14),
    "qwen3_vl": ("Qwen3VLForConditionalGeneration", "Qwen3VLProcessor", 16),
}
MAX_SIDE_PATCHES = 4  # images are resized to at most (4 merged patches)² · merge² patches


def train_tokenizer(vocab_size: int = 400) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")


def image_processor(family: str) -> Qwen2VLImageProcessorPil:
    patch = FAMILIES[family][2]
    factor = 2 * patch  # merge_size 2
    return Qwen2VLImageProcessorPil(min_pixels=factor * factor, max_pixels=(MAX_SIDE_PATCHES * factor) ** 2,
                                    patch_size=patch, merge_size=2, temporal_patch_size=2)


def make_processor(family: str, tokenizer):
    """The family's processor without a video processor (what mmspec's loader builds without torchvision)."""
    import transformers

    cls = getattr(transformers, FAMILIES[family][1])
    return images_only_processor(cls, image_processor(family), tokenizer, chat_template=CHAT_TEMPLATE)


def make_config(family: str, vocab_size: int, hidden: int = 32, layers: int = 2):
    import transformers

    patch = FAMILIES[family][2]
    text = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, head_dim=hidden // 4,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,  # sections sum to head_dim / 2
                                 "mrope_section": [hidden // 16, hidden // 32, hidden // 32]},
                bos_token_id=None, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    vision = dict(depth=2, num_heads=2, patch_size=patch, spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    if family == "qwen2_vl":
        config = transformers.Qwen2VLConfig
        vision.update(embed_dim=16, hidden_size=hidden, mlp_ratio=2)
    elif family == "qwen2_5_vl":
        config = transformers.Qwen2_5_VLConfig
        vision.update(hidden_size=16, out_hidden_size=hidden, intermediate_size=32, window_size=2 * 2 * patch,
                      fullatt_block_indexes=[1])
    else:
        config = transformers.Qwen3VLConfig
        text["rope_parameters"]["mrope_interleaved"] = True
        vision.update(hidden_size=16, out_hidden_size=hidden, intermediate_size=32, num_position_embeddings=64,
                      deepstack_visual_indexes=[0])
    return config(text_config=text, vision_config=vision, image_token_id=IMAGE_ID, video_token_id=VIDEO_ID,
                  vision_start_token_id=VISION_START_ID, vision_end_token_id=VISION_END_ID,
                  tie_word_embeddings=False)


def make_model(family: str, vocab_size: int, seed: int, hidden: int = 32, layers: int = 2, sharpen: float = 4.0):
    """A random float64 model of ``family`` with a sharpened LM head (argmaxes far from ties)."""
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, FAMILIES[family][0])(make_config(family, vocab_size, hidden, layers))
    model = model.to(torch.float64).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(sharpen)
    model.generation_config.eos_token_id = EOS_ID
    model.generation_config.pad_token_id = PAD_ID
    model.generation_config.bos_token_id = None
    return model


def save(model, processor, path: Path) -> str:
    """``save_pretrained`` of the model, tokenizer and image processor, and the processor's own config
    (its class and chat template): what a hub repository holds, less the video processor's file."""
    model.save_pretrained(path)
    processor.tokenizer.save_pretrained(path)
    processor.image_processor.save_pretrained(path)
    config = {"processor_class": FAMILIES[model.config.model_type][1]}
    (Path(path) / "processor_config.json").write_text(json.dumps(config))
    (Path(path) / "chat_template.jinja").write_text(processor.chat_template)
    return str(path)


def images(n: int) -> list[Image.Image]:
    """``n`` images of different sizes (so of different vision token counts)."""
    sizes = [(100, 80), (40, 60), (64, 64)]
    colours = [(220, 30, 30), (30, 200, 60), (40, 60, 210)]
    out = []
    for i in range(n):
        w, h = sizes[i % len(sizes)]
        img = Image.new("RGB", (w, h), colours[i % len(colours)])
        for x in range(0, w, 5):
            img.putpixel((x, (x * (i + 3)) % h), (255, 255, 255))
        out.append(img)
    return out
