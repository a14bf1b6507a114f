"""The demo family's tokenizer and processor: a byte-level BPE trained in-process with ``tokenizers``,
a ``CLIPImageProcessor`` built from a config, and a ``LlavaProcessor`` with a LLaVA-1.5 style chat template.

The tests build their tiny models with the same pieces (``tests/tiny.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import CLIPImageProcessor, LlavaProcessor, PreTrainedTokenizerFast

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


def train_tokenizer(vocab_size: int, corpus: Sequence[str], repeat: int = 1) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(corpus) * repeat, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", extra_special_tokens={"image_token": "<image>"})


def make_processor(tokenizer, chat_template: str | None = CHAT_TEMPLATE, image_size: int = 28,
                   patch_size: int = 14) -> LlavaProcessor:
    image_processor = CLIPImageProcessor(size={"shortest_edge": image_size},
                                         crop_size={"height": image_size, "width": image_size})
    return LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=patch_size,
                          vision_feature_select_strategy="default", num_additional_image_tokens=1,
                          chat_template=chat_template)
