"""Hugging Face assisted generation as a peer of mmspec's drafters (``mmspec bench --drafters hf-assisted``).

``target.generate(assistant_model=draft, ...)`` with a constant γ, greedy. Two things
about transformers 5.x that this has to handle (see docs/BENCHMARKS.md, findings 1 and 2):

- ``AssistedCandidateGenerator`` reads ``num_assistant_tokens``,
  ``num_assistant_tokens_schedule`` and ``assistant_confidence_threshold`` from the
  ASSISTANT's ``generation_config``, not from the kwargs of ``target.generate``. They are set
  there for the call (and passed as kwargs too), then restored.
- The assistant never receives the pixels: outside its first iteration the multimodal
  inputs are dropped, and its first iteration is not a "first iteration" for an assistant.
  The image placeholders reach the draft as plain token embeddings, so its acceptance is
  that of a draft that does not see the image.

Block efficiency is new tokens / target forward calls; the calls are counted with a public
``register_forward_hook`` on the target (every target call of assisted generation verifies
one block, the first one also prefilling the prompt, as in mmspec). HF does not report how
many drafted tokens each block accepted, so there is no acceptance rate here.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from mmspec_cli.decoding.step import cut_after_eos

from mmspec_cli.decoding.engine import eos_ids
from mmspec_cli.models.loading import LoadedModel
from mmspec_cli.decoding.kv import to_model

ASSISTANT_SETTINGS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")


@dataclass(frozen=True)
class AssistedResult:
    token_ids: list[int]  # the new tokens, without the prompt, cut after the first EOS
    target_calls: int  # target forward calls = blocks
    draft_calls: int  # draft forward calls
    wall_s: float  # processor + generate + decoding the text, like the engine's turn time
    text: str
    prompt_tokens: int  # the prompt's length after the processor expanded the image placeholders

    @property
    def block_efficiency(self) -> float:
        return len(self.token_ids) / self.target_calls if self.target_calls else 0.0


class ForwardCounter:
    """Counts forward calls of a module through a public forward hook (a context manager)."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.calls = 0
        self._handle = None

    def _count(self, module, args, output) -> None:
        self.calls += 1

    def __enter__(self) -> "ForwardCounter":
        self._handle = self.module.register_forward_hook(self._count)
        return self

    def __exit__(self, *exc_info) -> None:
        self._handle.remove()


@contextmanager
def assistant_settings(draft_model: Any, gamma: int) -> Iterator[None]:
    """γ constant and no confidence cut-off on the assistant's own generation_config, restored after."""
    config = draft_model.generation_config
    saved = {name: getattr(config, name, None) for name in ASSISTANT_SETTINGS}
    config.num_assistant_tokens = gamma
    config.num_assistant_tokens_schedule = "constant"
    config.assistant_confidence_threshold = 0.0
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(config, name, value)


@torch.inference_mode()
def assisted_generate(target: LoadedModel, draft: LoadedModel, images: Sequence[Any], prompt: str, gamma: int,
                      max_new_tokens: int, repetition_penalty: float | None = None) -> AssistedResult:
    """Greedy assisted generation of one turn whose prompt text is ``prompt`` (one placeholder per image);
    ``repetition_penalty``: a profile's override of the target's generation_config (None: its own)."""
    start = time.perf_counter()
    batch = target.processor(images=list(images) or None, text=prompt, return_tensors="pt")
    inputs = {k: to_model(v, target.model) for k, v in batch.items()}
    prompt_length = inputs["input_ids"].shape[1]
    options = {} if target.vocab_size == draft.vocab_size else \
        {"tokenizer": target.tokenizer, "assistant_tokenizer": draft.tokenizer}  # HF's universal assisted decoding
    if repetition_penalty is not None:
        options["repetition_penalty"] = repetition_penalty
    with assistant_settings(draft.model, gamma), ForwardCounter(target.model) as t, ForwardCounter(draft.model) as d:
        out = target.model.generate(
            **inputs, do_sample=False, max_new_tokens=max_new_tokens, assistant_model=draft.model,
            num_assistant_tokens=gamma, num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0,
            **options,
        )
    ids, _ = cut_after_eos(out[0, prompt_length:].tolist(), eos_ids(target))
    text = target.tokenizer.decode(ids, skip_special_tokens=True).strip()
    return AssistedResult(token_ids=ids, target_calls=t.calls, draft_calls=d.calls,
                          wall_s=time.perf_counter() - start, text=text, prompt_tokens=prompt_length)
