"""Training the demo LVLM family on the synthetic corpus: deterministic, CPU-sized (issue 5).

The target is a LLaVA-architecture model (CLIP-style vision tower, Llama language model)
trained on every task family with up to five images. The draft is a much smaller LLaVA
trained only on samples with at most two images, as TABED's small drafts were, so that
multimodal drafting helps on one image and breaks down on five (TABED Table 1). Both share
one BPE tokenizer trained on the corpus. Each turn of a conversation is one training
example: the prompt is built exactly as the engine builds it (``prompts.render_prompt``)
and only the answer (and its end-of-sequence token) is learned.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

from .. import tiny
from ..prompts import render_prompt
from .scenes import render
from .tasks import CAPTION_QUESTION, Sample

IGNORE = -100  # label of positions that are not learned (prompt, padding)


@dataclass(frozen=True)
class ModelSize:
    hidden: int
    layers: int
    heads: int
    vision_hidden: int
    vision_layers: int


@dataclass(frozen=True)
class Example:
    input_ids: list[int]
    labels: list[int]
    pixel_values: torch.Tensor | None  # (n_images, 3, H, W)


def corpus_texts(samples: Sequence[Sample]) -> list[str]:
    """Every question and answer, plus the prompt scaffolding, for training the tokenizer."""
    texts = ["USER: ASSISTANT:", CAPTION_QUESTION, "image: "]
    for sample in samples:
        for question, answer in sample.turns:
            texts.extend((question, answer))
    return texts


def build_processor(samples: Sequence[Sample], vocab_size: int, image_size: int, patch_size: int):
    """The shared BPE tokenizer (trained on ``samples``) inside a LlavaProcessor with a chat template."""
    tokenizer = tiny.train_tokenizer(vocab_size, corpus_texts(samples), repeat=1)
    return tiny.make_processor(tokenizer, image_size=image_size, patch_size=patch_size)


def build_model(size: ModelSize, vocab_size: int, image_size: int, patch_size: int, seed: int):
    """A float32 LLaVA of ``size`` with the tiny family's special-token ids."""
    torch.manual_seed(seed)
    vision = CLIPVisionConfig(hidden_size=size.vision_hidden, intermediate_size=4 * size.vision_hidden,
                              num_hidden_layers=size.vision_layers, num_attention_heads=max(1, size.vision_hidden // 32),
                              image_size=image_size, patch_size=patch_size)
    text = LlamaConfig(vocab_size=vocab_size, hidden_size=size.hidden, intermediate_size=int(2.75 * size.hidden),
                       num_hidden_layers=size.layers, num_attention_heads=size.heads,
                       num_key_value_heads=max(1, size.heads // 2), max_position_embeddings=2048,
                       bos_token_id=1, eos_token_id=2, pad_token_id=3, tie_word_embeddings=True)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_id=tiny.IMAGE_TOKEN_ID,
                         vision_feature_select_strategy="default", vision_feature_layer=-1)
    model = LlavaForConditionalGeneration(config)
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 3
    return model


def language_model_parameters(model) -> int:
    """Parameters of the language model (embeddings, decoder, LM head), as the 1/10 rule counts them."""
    language = model.model.language_model
    head = model.get_output_embeddings().weight
    tied = head.data_ptr() == language.get_input_embeddings().weight.data_ptr()
    return sum(p.numel() for p in language.parameters()) + (0 if tied else head.numel())


def encode(processor, sample: Sample, image_size: int) -> list[Example]:
    """One example per turn: the engine's prompt for that turn, then the answer and EOS to learn."""
    images = [render(scene, image_size) for scene in sample.images]
    eos = processor.tokenizer.eos_token
    questions, answers = sample.questions, sample.answers
    out = []
    for turn, answer in enumerate(answers):
        prompt = render_prompt(processor, questions[: turn + 1], answers[:turn], len(images))
        batch = processor(images=[images] if images else None, text=f"{prompt} {answer}{eos}", return_tensors="pt")
        prompt_len = len(processor(images=[images] if images else None, text=prompt)["input_ids"][0])
        ids = batch["input_ids"][0].tolist()
        labels = [IGNORE] * prompt_len + ids[prompt_len:]
        out.append(Example(ids, labels, batch.get("pixel_values")))
    return out


def collate(examples: Sequence[Example], pad_id: int) -> dict:
    """Right-padded batch; pixel values concatenated in placeholder order (row by row)."""
    length = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), length), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), length), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(examples), length), dtype=torch.long)
    for row, e in enumerate(examples):
        ids[row, : len(e.input_ids)] = torch.tensor(e.input_ids)
        labels[row, : len(e.labels)] = torch.tensor(e.labels)
        mask[row, : len(e.input_ids)] = 1
    pixels = [e.pixel_values for e in examples if e.pixel_values is not None]
    return {"input_ids": ids, "labels": labels, "attention_mask": mask,
            "pixel_values": torch.cat(pixels) if pixels else None}


def train(model, examples: Sequence[Example], steps: int, batch_size: int, lr: float, seed: int, pad_id: int,
          log: Callable[[int, float], None] = lambda step, loss: None) -> list[float]:
    """AdamW with linear warm-up and cosine decay; returns the loss of every step."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    model.train()
    order: list[int] = []
    losses = []
    for step in range(steps):
        if len(order) < batch_size:
            order += rng.sample(range(len(examples)), len(examples))
        batch, order = [examples[i] for i in order[:batch_size]], order[batch_size:]
        loss = model(**collate(batch, pad_id)).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(float(loss.detach()))
        log(step, losses[-1])
    model.eval()
    return losses


def save_half(model, processor, path) -> None:
    """Safetensors in float16, with the processor: loadable by the same ``from_pretrained`` as hub models."""
    model.to(torch.float16).save_pretrained(path)
    processor.save_pretrained(path)
    model.to(torch.float32)
