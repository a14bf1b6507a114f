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

from mmspec_cli.demo.training import processor as demo_processor
from mmspec_cli.models.prompts import render_prompt, text_only_ids
from mmspec_cli.demo.scenes import COLOURS, COLUMNS, KINDS, PLURALS, ROWS, SIZES, Scene, random_scene, render
from mmspec_cli.demo.tasks import CAPTION_QUESTION, NUMBER_WORDS, Sample

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
    tokenizer = demo_processor.train_tokenizer(vocab_size, corpus_texts(samples), repeat=1)
    return demo_processor.make_processor(tokenizer, image_size=image_size, patch_size=patch_size)


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
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_id=demo_processor.IMAGE_TOKEN_ID,
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


def encode(processor, sample: Sample, image_size: int, text_only: bool = False) -> list[Example]:
    """One example per turn: the engine's prompt for that turn, then the answer and EOS to learn.

    ``text_only`` builds the prompt the text-only drafter ``t`` sees (each image one newline
    token, TABED App. I.2) and no pixels: the draft's text pretraining, as in Gagrani et al.
    """
    images = [render(scene, image_size) for scene in sample.images]
    tokenizer = processor.tokenizer
    eos = tokenizer.eos_token
    questions, answers = sample.questions, sample.answers
    out = []
    for turn, answer in enumerate(answers):
        prompt = render_prompt(processor, questions[: turn + 1], answers[:turn], len(images))
        if text_only:
            image_id = tokenizer.convert_tokens_to_ids(processor.image_token)
            prompt_ids = text_only_ids(tokenizer, prompt, image_id, len(images))
            ids = text_only_ids(tokenizer, f"{prompt} {answer}{eos}", image_id, len(images))
            if ids[: len(prompt_ids)] != prompt_ids:
                raise ValueError("the answer changed the prompt's tokenization")
            out.append(Example(ids, [IGNORE] * len(prompt_ids) + ids[len(prompt_ids):], None))
            continue
        batch = processor(images=[images] if images else None, text=f"{prompt} {answer}{eos}", return_tensors="pt")
        prompt_len = len(processor(images=[images] if images else None, text=prompt)["input_ids"][0])
        ids = batch["input_ids"][0].tolist()
        labels = [IGNORE] * prompt_len + ids[prompt_len:]
        out.append(Example(ids, labels, batch.get("pixel_values")))
    return out


# --- the vision tower's own pretraining (the stand-in for a pretrained CLIP) ----------------------

def cell_labels(scene: Scene, grid: int) -> torch.Tensor:
    """Per patch (row-major, ``grid`` x ``grid``): (colour, kind, size, cell) class ids, 0 meaning empty
    for the first three; the cell (0-8) the patch lies in is always set.

    ``grid`` must be a multiple of 3, so that every patch lies inside one cell of the scene.
    """
    if grid % 3:
        raise ValueError(f"the patch grid ({grid}x{grid}) must be a multiple of 3 to map patches to cells")
    labels = torch.zeros(grid * grid, 4, dtype=torch.long)
    per_cell = grid // 3
    for patch in range(grid * grid):
        labels[patch, 3] = (patch // grid // per_cell) * 3 + (patch % grid) // per_cell
    for shape in scene.shapes:
        for dr in range(per_cell):
            for dc in range(per_cell):
                patch = (shape.row * per_cell + dr) * grid + shape.col * per_cell + dc
                labels[patch, :3] = torch.tensor([list(COLOURS).index(shape.colour) + 1, KINDS.index(shape.kind) + 1,
                                                  SIZES.index(shape.size) + 1])
    return labels


def pretrain_vision(model, image_processor, steps: int, batch_size: int, lr: float, seed: int, render_size: int,
                    log: Callable[[int, float], None] = lambda step, loss: None) -> float:
    """Teach the vision tower what is in each patch (colour, kind, size) and where it is (its cell).

    Returns the share of patches with all four right in the last batch.

    LLaVA starts from a pretrained CLIP; here the tower is tiny and trained from scratch with a
    per-patch classification loss on random scenes, read at the layer the projector takes
    (``vision_feature_layer``). The linear heads are thrown away afterwards.
    """
    tower = model.model.vision_tower
    config = model.config.vision_config
    with torch.no_grad():  # CLIP's default init (std 0.02) hides the position under the pixels: cells were not learnable
        tower.embeddings.position_embedding.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(seed))
    grid = config.image_size // config.patch_size
    heads = torch.nn.ModuleList(torch.nn.Linear(config.hidden_size, n)
                                for n in (len(COLOURS) + 1, len(KINDS) + 1, len(SIZES) + 1, 9))
    params = [*tower.parameters(), *heads.parameters()]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    rng = random.Random(f"mmspec-demo:vision:{seed}")
    torch.manual_seed(seed)
    tower.train()
    accuracy = 0.0
    for step in range(steps):
        scenes = [random_scene(rng) for _ in range(batch_size)]
        pixels = image_processor([render(s, render_size) for s in scenes], return_tensors="pt")["pixel_values"]
        labels = torch.stack([cell_labels(s, grid) for s in scenes])  # (B, P, 4)
        hidden = tower(pixels, output_hidden_states=True).hidden_states[model.config.vision_feature_layer][:, 1:]
        logits = [head(hidden) for head in heads]  # 4 x (B, P, classes)
        loss = sum(torch.nn.functional.cross_entropy(l.flatten(0, 1), labels[..., i].flatten())
                   for i, l in enumerate(logits))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            right = torch.stack([l.argmax(-1) == labels[..., i] for i, l in enumerate(logits)], -1).all(-1)
            accuracy = float(right.float().mean())
        log(step, float(loss.detach()))
    tower.eval()
    return accuracy


def freeze_vision(model) -> None:
    """Keep the (pretrained) vision tower fixed while the projector and language model learn (LLaVA stage 2)."""
    for p in model.model.vision_tower.parameters():
        p.requires_grad_(False)


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


#: Words that carry the facts of a scene: learning them is learning to look at the image.
FACT_WORDS: frozenset[str] = frozenset(
    [*COLOURS, *KINDS, *PLURALS.values(), *SIZES, *ROWS, *COLUMNS, "center", *NUMBER_WORDS])


def fact_token_ids(tokenizer) -> list[int]:
    """Ids of the tokens that spell a fact word whole (with or without a leading space, any case)."""
    ids = set()
    for word in FACT_WORDS:
        for form in (word, word.capitalize()):
            for text in (form, " " + form):
                encoded = tokenizer(text, add_special_tokens=False)["input_ids"]
                if len(encoded) == 1:
                    ids.add(encoded[0])
    return sorted(ids)


def weighted_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, each target token weighted by ``weights[token]``; mean over weight.

    logits (B, T, V) predict labels shifted by one; IGNORE labels count for nothing.
    """
    shift_logits, shift_labels = logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()
    keep = shift_labels != IGNORE
    per_token = torch.nn.functional.cross_entropy(shift_logits[keep], shift_labels[keep], reduction="none")
    w = weights[shift_labels[keep]]
    return (per_token * w).sum() / w.sum()


def length_grouped_batches(lengths: Sequence[int], batch_size: int, rng: random.Random,
                           group: int | None) -> list[list[int]]:
    """One epoch of batches of indices into ``lengths``: every index exactly once.

    The indices are shuffled; with ``group``, each run of ``group * batch_size`` of them is sorted
    by length before it is cut into batches, and the batches are shuffled again. Rows of a batch
    then have similar lengths, so little of the padded batch is padding (about half of it is with
    plain random batches of this corpus, where one five-image story sets the length of fifteen
    single-image rows). ``group=None`` gives plain random batches. Either way the last batch of
    an epoch holds the remainder (``len(lengths) % batch_size`` rows, if any).
    """
    order = rng.sample(range(len(lengths)), len(lengths))
    span = batch_size * group if group else batch_size
    batches = []
    for start in range(0, len(order), span):
        chunk = order[start:start + span]
        if group:
            chunk = sorted(chunk, key=lambda i: lengths[i])
        batches += [chunk[k:k + batch_size] for k in range(0, len(chunk), batch_size)]
    if group:
        rng.shuffle(batches)
    return batches


def train(model, examples: Sequence[Example], steps: int, batch_size: int, lr: float, seed: int, pad_id: int,
          log: Callable[[int, float], None] = lambda step, loss: None,
          token_weights: torch.Tensor | None = None, length_group: int | None = None) -> list[float]:
    """AdamW with linear warm-up and cosine decay; returns the loss of every step.

    ``token_weights`` (vocabulary-sized), if given, weights each learned token's loss: the demo
    build puts more weight on fact words (:func:`fact_token_ids`) so grounding is learned sooner.
    ``length_group`` batches rows of similar length (:func:`length_grouped_batches`).
    """
    rng = random.Random(seed)
    torch.manual_seed(seed)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.01)
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    model.train()
    lengths = [len(e.input_ids) for e in examples]
    batches: list[list[int]] = []
    losses = []
    for step in range(steps):
        if not batches:
            batches = length_grouped_batches(lengths, batch_size, rng, length_group)
        inputs = collate([examples[i] for i in batches.pop()], pad_id)
        if token_weights is None:
            loss = model(**inputs).loss
        else:
            labels = inputs.pop("labels")
            loss = weighted_loss(model(**inputs).logits, labels, token_weights)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
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
