"""Answering held-out colour and count questions with a model, for the quality check (issue 5)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mmspec_cli.models.prompts import render_prompt
from mmspec_cli.demo.scenes import DISPLAY_SIZE, render
from mmspec_cli.demo.tasks import QualityQuestion, answer_correct, final_answer


@torch.inference_mode()
def answer_questions(model, processor, questions: Sequence[QualityQuestion], max_new_tokens: int = 160,
                     batch_size: int = 1) -> list[str]:
    """Greedy answers of ``model`` to each question about its scene (drawn at ``DISPLAY_SIZE``).

    ``batch_size`` questions go through each ``generate`` call, left-padded. On the CPU in float32 the
    shipped demo target gives the same 100 answers one by one and in one batch of 100 (the quality test
    checks some); in half precision padding may change an argmax, so keep 1 there.
    """
    tokenizer = processor.tokenizer
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    try:
        answers = []
        for start in range(0, len(questions), batch_size):
            chunk = questions[start:start + batch_size]
            prompts = [render_prompt(processor, [q.question], [], 1) for q in chunk]
            images = [[render(q.scene, DISPLAY_SIZE)] for q in chunk]
            inputs = processor(images=images, text=prompts, padding=True, return_tensors="pt")
            inputs = {k: v.to(model.device) for k, v in inputs.items()}
            if "pixel_values" in inputs:
                inputs["pixel_values"] = inputs["pixel_values"].to(model.dtype)
            out = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens)
            answers += tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
        return answers
    finally:
        tokenizer.padding_side = side


@dataclass(frozen=True)
class QualityScore:
    """Per question, in order: right read strictly (``tasks.answer_correct``), and right by the
    final answer alone (``tasks.final_answer``)."""

    strict: list[bool]
    final: list[bool]


def score_answers(questions: Sequence[QualityQuestion], answers: Sequence[str]) -> QualityScore:
    """Both readings of each answer against its question's expected word."""
    return QualityScore(strict=[answer_correct(a, q.expected) for a, q in zip(answers, questions)],
                        final=[final_answer(a, q.expected) == q.expected for a, q in zip(answers, questions)])
