"""TABED App. I.1 dataset prompts, for ``--prompt-style paper``.

The paper gives one first-turn prompt per dataset in the LLaVA-1.5 conversation format
(``USER: ... ASSISTANT:``). Here each is the engine's ``raw_prompt`` of the first turn, with
the processor's image placeholder for ``<image>``. The paper's leading ``<s>`` is left out:
the tokenizer adds BOS itself (LLaVA-1.5's does), and writing it would double it.

The engine takes a raw prompt for ONE turn. A later turn therefore runs as its own
``generate`` call whose raw prompt continues the conversation in the same LLaVA-1.5 format
(:func:`continue_prompt`, the format of ``prompts.llava15_prompt``); the target's cache of
the earlier turns is reused because the new prompt extends the old one.

Datasets without a paper prompt (and PororoSV/VIST, whose prompts interleave per-image
captions ``[CAPTION]`` that a sample does not carry) use the default style: the chat template.

The prompts are LLaVA-1.5's text, so a Qwen-VL target, which reads its own chat template (ChatML,
its images as vision tokens), is refused the paper style in one line (:func:`check_paper_target`):
before any model loads where the target's ``config.json`` is on disk (a folder, a shipped model, a hub
id already downloaded), else as soon as the target has loaded, before any sample runs.
"""

from __future__ import annotations

import re

from mmspec_cli.errors import InputError

REASONING = "For the following question, provide a detailed explanation of your reasoning leading to the answer."
_QA = "USER: <image> " + REASONING + " {question} ASSISTANT:"
_EDIT = ("USER: Please provide instructions for editing the source image to match the target image. "
         "Source Image: <image> Target Image: <image> Instruction: ASSISTANT:")
_SPOT = "USER: Explain the disparities between the first and second image. <image> <image> Difference: ASSISTANT:"

#: prompt key -> template; ``<image>`` is replaced by the processor's placeholder, ``{question}`` by the question.
PAPER_PROMPTS: dict[str, str] = {
    "llava-w": _QA,
    "docvqa": _QA,
    "pope": _QA,
    "mmvet": _QA,
    "iedit": _EDIT,
    "magicbrush": _EDIT,
    "spot-the-diff": _SPOT,
}

#: normalised category names (lower case, letters and digits only) -> prompt key
_ALIASES = {
    "llavaw": "llava-w", "llavabench": "llava-w", "llavabenchinthewild": "llava-w", "llavainthewild": "llava-w",
    "docvqa": "docvqa", "docvqaval": "docvqa",
    "pope": "pope",
    "mmvet": "mmvet",
    "iedit": "iedit", "ieedit": "iedit",
    "magicbrush": "magicbrush", "mb": "magicbrush",
    "spotthediff": "spot-the-diff", "spotthedifference": "spot-the-diff", "spot": "spot-the-diff",
}


def prompt_key_for(category: str) -> str | None:
    """The paper prompt of a manifest category such as ``LLaVA-W``, ``docvqa`` or ``Spot-the-Diff``."""
    return _ALIASES.get(re.sub(r"[^a-z0-9]", "", category.lower()))


def paper_prompt(key: str, question: str, n_images: int, image_token: str = "<image>") -> str:
    """The first-turn raw prompt of dataset ``key``; refuses a sample with another number of images."""
    template = PAPER_PROMPTS[key]
    wanted = template.count("<image>")
    if wanted != n_images:
        raise InputError(f"the paper prompt of {key} (TABED App. I.1) takes {wanted} image(s) but the sample has "
                         f"{n_images}; use --prompt-style default")
    return template.replace("<image>", image_token).replace("{question}", question.strip())


def continue_prompt(prompt: str, answer: str, eos: str, question: str) -> str:
    """The raw prompt of the next turn: the previous prompt, its answer, then the new question."""
    return f"{prompt} {answer}{eos}USER: {question.strip()} ASSISTANT:"


def strip_image_markers(question: str) -> str:
    """A dataset question without inline ``<image>`` markers (the chat template places the images)."""
    return re.sub(r"\s*<image>\s*", " ", question).strip()


def check_paper_target(model_type: str | None, model: str) -> None:
    """Refuse ``--prompt-style paper`` for a target of ``model_type`` (``config.json``'s) that does not read
    LLaVA-1.5's conversation format; ``model``: the profile's name of it. None (not known yet) passes."""
    from mmspec_cli.models.families import QWEN_VL_TYPES
    from mmspec_cli.models.prompts import shorten

    if model_type in QWEN_VL_TYPES:
        raise InputError(f"--prompt-style paper: TABED's prompts are written for LLaVA-1.5, but the target "
                         f"{shorten(model, 60)} is a Qwen-VL model ({model_type}) that reads its own chat template; "
                         f"use --prompt-style default")
