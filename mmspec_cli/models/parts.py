"""Named parts of a loaded image-text-to-text model that mmspec reads: its language decoder stack."""

from __future__ import annotations

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
