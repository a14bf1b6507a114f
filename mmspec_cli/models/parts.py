"""Named parts of a loaded image-text-to-text model that mmspec reads: its language decoder stack, and the keyword
its forwards take a KV cache by."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from mmspec_cli.errors import ModelLoadError


def text_decoder(model: Any) -> Any:
    """The decoder stack (embeddings, layers, final norm) of an image-text-to-text model."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is None or not isinstance(getattr(decoder, "layers", None), torch.nn.ModuleList):
        raise ModelLoadError(f"{type(model).__name__} has no decoder with a `layers` list, which self-speculative "
                             f"drafting and draft heads read; use another drafter")
    return decoder


def _cache_keyword() -> str:
    from transformers.models.llama.modeling_llama import LlamaModel

    return "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"


#: The keyword transformers' forwards (models, decoder stacks, decoder layers) take a KV cache by: ``cache`` from
#: transformers 5.24 on, ``past_key_values`` before. 5.24 still takes the old name, but with a FutureWarning on the
#: user's stderr, and is to drop it in 5.40.
CACHE_KEYWORD = _cache_keyword()


def with_cache(cache: Any) -> dict[str, Any]:
    """The keyword argument passing ``cache`` to a transformers forward, under this version's name for it."""
    return {CACHE_KEYWORD: cache}
