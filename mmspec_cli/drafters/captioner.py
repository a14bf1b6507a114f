"""Captions for caption drafting (``c``, TABED §6.1, App. E).

Any image-text-to-text model can caption: Florence-2 (task prompt ``<CAPTION>``), BLIP
(``Salesforce/blip-image-captioning-base``, no prompt needed), or a chat LVLM prompted with
``captioner.prompt``. Each distinct image is captioned once per process, keyed by a hash
of its pixels, and the caption is reused across turns and drafters.
"""

from __future__ import annotations

import hashlib
import threading
import time
from typing import Any

import torch

from mmspec_cli.models.loading import LoadedModel
from mmspec_cli.models.prompts import process, render_prompt
from mmspec_cli.decoding.kv import to_model

DEFAULT_PROMPT = "Describe the image in one sentence."
_CACHE: dict[tuple[str, str, str], str] = {}  # (model, prompt, image hash) -> caption
_LOCK = threading.Lock()


def image_hash(image: Any) -> str:
    digest = hashlib.sha256()
    digest.update(f"{image.mode}{image.size}".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


class Captioner:
    """Captions images with ``loaded`` (greedy, ``max_new_tokens``), caching by content hash."""

    def __init__(self, loaded: LoadedModel, prompt: str | None = None, max_new_tokens: int = 32):
        self.loaded = loaded
        self.model_type = loaded.model.config.model_type
        self.prompt = prompt or ("<CAPTION>" if self.model_type == "florence2" else DEFAULT_PROMPT)
        self.max_new_tokens = max_new_tokens
        self.seconds = 0.0  # time spent captioning (reported apart from decoding)

    def caption(self, image: Any) -> str:
        key = (self.loaded.name, self.prompt, image_hash(image))
        with _LOCK:
            if key in _CACHE:
                return _CACHE[key]
        start = time.perf_counter()
        text = self._generate(image)
        self.seconds += time.perf_counter() - start
        with _LOCK:
            _CACHE[key] = text
        return text

    @torch.inference_mode()
    def _generate(self, image: Any) -> str:
        model, processor = self.loaded.model, self.loaded.processor
        if self.model_type == "florence2":
            inputs = processor(text=self.prompt, images=image, return_tensors="pt")
        elif self.model_type == "blip":
            inputs = processor(images=image, return_tensors="pt")
        else:  # a chat LVLM: the same prompt building as the target's
            prompt = process(processor, render_prompt(processor, [self.prompt], [], 1), [image])
            inputs = {"input_ids": torch.tensor([prompt.ids]), **prompt.vision}
        inputs = {k: to_model(v, model) for k, v in dict(inputs).items()}
        out = model.generate(**inputs, do_sample=False, max_new_tokens=self.max_new_tokens)
        if "input_ids" in inputs and not model.config.is_encoder_decoder:
            out = out[:, inputs["input_ids"].shape[1]:]
        return processor.tokenizer.decode(out[0], skip_special_tokens=True).strip()
