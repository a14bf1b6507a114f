"""Building the prompt of each turn and the per-model views of it.

The prompt text is rendered once per turn with the target processor's chat template
(``apply_chat_template(..., add_generation_prompt=True)``): each user turn holds its images in
order (the opening images in the first), then its question; later turns add the earlier answers
as assistant turns. Without a chat template, the LLaVA-1.5 format ``USER: <image>\\n{question} ASSISTANT:``
is used. Each model then tokenizes that same text with its own processor (so a LLaVA-NeXT
target and a LLaVA-1.5 draft each expand the image placeholders their own way).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mmspec_cli.errors import InputError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class ModelPrompt:
    """One model's view of a turn's prompt: token ids and the image tensors they refer to."""

    ids: list[int]
    vision: dict[str, torch.Tensor] = field(default_factory=dict)


def image_placeholder(processor: Any) -> str:
    return getattr(processor, "image_token", None) or "<image>"


def shorten(text: str, limit: int = 80) -> str:
    """``text`` on one line, cut in the middle to ``limit`` characters, to quote a user's value in an error.

    The middle goes, so a path keeps its start and its file name; only a bounded slice of each end is looked at.
    """
    if len(text) > 4 * limit:
        text = text[: 2 * limit] + " " + text[-2 * limit:]
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    head = (limit - 3) // 2
    return text[:head] + "..." + text[len(text) - (limit - 3 - head):]


#: Written after the placeholder's first character so that text holding it stays text (see :func:`as_text`).
ZERO_WIDTH_SPACE = "\u200b"


def as_text(text: str, placeholder: str) -> str:
    """``text`` with every occurrence of the image ``placeholder`` broken by a zero-width space.

    A processor expands each placeholder in the prompt into an image's tokens, so a question
    (or an answer) that quotes ``<image>`` would ask for one image more than was given. Broken
    up, it is tokenized as plain text. Repeated until none is left (a replacement can't make
    a new occurrence for ``<image>``, but could for placeholders like ``aa``).
    """
    broken = placeholder[:1] + ZERO_WIDTH_SPACE + placeholder[1:]
    while placeholder and placeholder in text:
        text = text.replace(placeholder, broken)
    return text


def image_counts(n_images: int | Sequence[int], questions: int) -> list[int]:
    """Images per user message: an int puts them all in the first; a sequence gives each question its own
    (a later question can bring new images; missing entries are 0)."""
    counts = [n_images] if isinstance(n_images, int) else list(n_images)
    return (counts + [0] * questions)[:max(questions, len(counts))]


def build_messages(questions: Sequence[str], answers: Sequence[str], n_images: int | Sequence[int]) -> list[dict]:
    """Chat messages for the turn after ``answers``: each user turn's images (:func:`image_counts`) before its
    question."""
    counts = image_counts(n_images, len(questions))
    messages: list[dict] = []
    for turn, question in enumerate(questions[: len(answers) + 1]):
        content = [{"type": "image"} for _ in range(counts[turn])]
        content.append({"type": "text", "text": question})
        messages.append({"role": "user", "content": content})
        if turn < len(answers):
            messages.append({"role": "assistant", "content": [{"type": "text", "text": answers[turn]}]})
    return messages


def llava15_prompt(messages: Sequence[dict], image_token: str, eos: str) -> str:
    """The LLaVA-1.5 conversation format, for processors that carry no chat template."""
    parts = []
    for message in messages:
        images = "".join(f"{image_token}\n" for c in message["content"] if c["type"] == "image")
        text = " ".join(c["text"] for c in message["content"] if c["type"] == "text")
        if message["role"] == "user":
            parts.append(f"USER: {images}{text} ")
        else:
            parts.append(f"ASSISTANT: {text}{eos}")
    return "".join(parts) + "ASSISTANT:"


def render_prompt(processor: Any, questions: Sequence[str], answers: Sequence[str], n_images: int | Sequence[int],
                  history: Sequence[tuple[str, str]] = ()) -> str:
    """The prompt text for the next turn, through the processor's chat template when it has one.

    ``history``: earlier (question, answer) turns given as they are (not generated), before ``questions``.
    ``n_images``: the images of the first user turn, or each user turn's (history's first), :func:`image_counts`.
    Questions and answers that hold the image placeholder keep it as text (:func:`as_text`).
    """
    placeholder = image_placeholder(processor)
    questions = [as_text(q, placeholder) for q in [q for q, _ in history] + list(questions)]
    answers = [as_text(a, placeholder) for a in [a for _, a in history] + list(answers)]
    messages = build_messages(questions, answers, n_images)
    if getattr(processor, "chat_template", None):
        return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    eos = processor.tokenizer.eos_token or ""
    return llava15_prompt(messages, placeholder, eos)


NO_QUESTION = "no question given; pass one with -q TEXT (repeat -q for a conversation)"


def check_questions(questions: Sequence[str], raw_prompt: str | None) -> list[str]:
    """The turns to run: the questions, or the one ``--raw-prompt`` turn. Refuses neither, both, or an empty one."""
    if raw_prompt is None:
        if not questions:
            raise InputError(NO_QUESTION)
        for i, question in enumerate(questions, start=1):
            if not question.strip():
                which = f"question {i} (-q)" if len(questions) > 1 else "the question (-q)"
                raise InputError(f"{which} is empty; write the question after -q, e.g. -q \"Describe the image.\"")
        return list(questions)
    if questions:
        raise InputError("--raw-prompt gives the whole prompt of one turn; drop -q or pass only --raw-prompt")
    if not raw_prompt.strip():
        raise InputError("--raw-prompt is empty; pass the whole prompt of the turn, with one <image> per image")
    return [raw_prompt]


def check_history(history: Any, raw_prompt: str | None = None) -> list[tuple[str, str]]:
    """Earlier turns as (question, answer) pairs of non-empty strings; refused beside ``--raw-prompt``."""
    if not isinstance(history, (list, tuple)):
        raise InputError(f"history must be a list of [question, answer] pairs, got {shorten(repr(history))}")
    pairs = []
    for i, turn in enumerate(history, start=1):
        if (not isinstance(turn, (list, tuple)) or len(turn) != 2
                or not all(isinstance(x, str) and x.strip() for x in turn)):
            raise InputError(f"history turn {i} must be a [question, answer] pair of non-empty strings, "
                             f"got {shorten(repr(turn))}")
        pairs.append((turn[0], turn[1]))
    if pairs and raw_prompt is not None:
        raise InputError("--raw-prompt gives the whole prompt of one turn; write the earlier turns into it "
                         "instead of passing a history")
    return pairs


def check_raw_prompt(raw_prompt: str, processor: Any, n_images: int) -> None:
    """A ``--raw-prompt`` must hold exactly one image placeholder per image."""
    placeholder = image_placeholder(processor)
    found = raw_prompt.count(placeholder)
    if found != n_images:
        raise InputError(
            f"--raw-prompt has {found} '{placeholder}' placeholder(s) but {n_images} image(s) were given; "
            f"put one '{placeholder}' where each image goes"
        )


def process(processor: Any, text: str, images: Sequence[Any]) -> ModelPrompt:
    """Tokenize ``text`` with ``processor``, expanding each image placeholder and encoding the images."""
    # one sample holding all its images (OneVision then uses its multi-image layout, as its chat template does)
    try:
        batch = processor(images=[list(images)] if images else None, text=text, return_tensors="pt")
    except ValueError as exc:  # an image its resizing rules can't take (Qwen-VL: an aspect ratio over 200:1)
        if not images or "aspect ratio" not in str(exc):
            raise
        sizes = ", ".join(f"{getattr(image, 'width', '?')}x{getattr(image, 'height', '?')}" for image in images)
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise InputError(f"the {type(processor).__name__} could not prepare the images ({sizes} pixels): {reason}; "
                         f"crop, pad or resize the image") from exc
    ids = batch["input_ids"][0].tolist()
    vision = {k: v for k, v in batch.items() if k not in ("input_ids", "attention_mask", "token_type_ids")}
    return ModelPrompt(ids=ids, vision=vision)


def newline_token_id(tokenizer: Any) -> int:
    """The id of the token for "\\n" (the last piece, e.g. Llama's <0x0A> after a leading '▁')."""
    return tokenizer("\n", add_special_tokens=False)["input_ids"][-1]


def shrink_runs(ids: Sequence[int], token: int, counts: Sequence[int]) -> list[int]:
    """``ids`` with the i-th maximal run of ``token`` cut to ``counts[i]`` tokens (pure): an expanded prompt whose
    images keep fewer vision tokens (pooled drafting of native-resolution images)."""
    out, run = [], 0
    for i, t in enumerate(ids):
        if t != token:
            out.append(t)
        elif i == 0 or ids[i - 1] != token:  # a run starts: its image's count, once
            if run >= len(counts):
                raise ValueError(f"more runs of token {token} than the {len(counts)} counts given")
            out.extend([token] * counts[run])
            run += 1
    if run != len(counts):
        raise ValueError(f"{run} runs of token {token} but {len(counts)} counts given")
    return out


def replace_image_tokens(ids: Sequence[int], placeholder: int | Sequence[int],
                         replacements: Sequence[Sequence[int]]) -> list[int]:
    """Replace the i-th image placeholder in *unexpanded* ids by ``replacements[i]`` (pure).

    In a prompt tokenized without its processor, each image is one ``placeholder``: a single token
    (LLaVA's ``<image>``) or a run of tokens (Qwen-VL's ``<|vision_start|><|image_pad|><|vision_end|>``),
    so two adjacent images stay two replacements. Used for text-only drafting (each image becomes
    one newline token, TABED App. I.2) and caption drafting (each image becomes the tokens of
    "image: <caption>", TABED App. I.2).
    """
    run = (placeholder,) if isinstance(placeholder, int) else tuple(placeholder)
    ids = list(ids)
    positions, i = [], 0
    while i <= len(ids) - len(run):
        if tuple(ids[i:i + len(run)]) == run:
            positions.append(i)
            i += len(run)
        else:
            i += 1
    if len(positions) != len(replacements):
        raise ValueError(f"prompt has {len(positions)} image placeholders but {len(replacements)} replacements were given")
    out: list[int] = []
    start = 0
    for position, replacement in zip(positions, replacements):
        out.extend(ids[start:position])
        out.extend(replacement)
        start = position + len(run)
    out.extend(ids[start:])
    return out


def text_only_ids(tokenizer: Any, text: str, placeholder: int | Sequence[int], n_images: int) -> list[int]:
    """TABED App. I.2: tokenize the prompt unexpanded, each image's ``placeholder`` becoming one "\\n" token."""
    ids = tokenizer(text)["input_ids"]
    newline = newline_token_id(tokenizer)
    return replace_image_tokens(ids, placeholder, [[newline]] * n_images)
