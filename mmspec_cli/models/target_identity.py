"""What a trained draft network (a head, an imitation network) remembers of the target it was trained for.

A head or an imitation network only drafts well for the target whose features it learnt; for
another target of the same shape (a random one, another fine-tune) nearly every draft is
rejected (τ ≈ 1), although nothing fails. Its ``config.json`` therefore keeps the target's
name and :func:`signature`: the norms of :data:`ROWS` rows of the target's LM head, spread over
its vocabulary. Loading compares them (:func:`warn_if_other_target`) and says so in one
``warning:`` line, without refusing: the user may know better (a head reused for a close
fine-tune). The same weights in another precision agree to far better than :data:`RTOL`; two
different targets differ far more.

Names are compared as :func:`canonical_name` writes them, so ``models/target`` and
``models/target/`` are the same target.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from mmspec_cli.models.prompts import shorten

ROWS = 16
RTOL = 1e-2


def canonical_name(model: str) -> str:
    """A model's name for comparisons: a local folder as its absolute normalised path, anything else as written."""
    expanded = os.path.expanduser(model)
    if os.path.isdir(expanded):
        return os.path.normpath(os.path.abspath(expanded))
    return model


def signature(model: Any) -> list[float] | None:
    """Norms of :data:`ROWS` evenly spaced rows of the model's LM head (float32, 6 significant digits);
    None when its weights are not at hand (offloaded to disk by ``device_map``)."""
    weight = model.get_output_embeddings().weight
    if weight.device.type == "meta":
        return None
    rows = torch.linspace(0, weight.shape[0] - 1, ROWS).round().long().to(weight.device)
    with torch.no_grad():
        norms = weight[rows].float().norm(dim=-1).tolist()
    return [float(f"{x:.6g}") for x in norms]


def same_signature(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= RTOL * max(abs(x), abs(y)) for x, y in zip(a, b))


def other_target(stored_name: Any, stored_signature: Any, name: str, model: Any) -> bool:
    """Whether a network stored with ``stored_name``/``stored_signature`` was trained for another target than
    ``model`` (called ``name``): by the signature when one is stored, else by the name; unknown: False."""
    if isinstance(stored_signature, list) and stored_signature:
        here = signature(model)
        return here is not None and not same_signature([float(x) for x in stored_signature], here)
    if isinstance(stored_name, str) and stored_name:
        return canonical_name(stored_name) != canonical_name(name)
    return False


def warn_if_other_target(what: str, shown: str, stored_name: Any, stored_signature: Any, name: str,
                         model: Any, retrain: str) -> None:
    """One ``warning:`` line on stderr when ``what`` (``head``, ``ssd.imitation``) named ``shown`` was trained for
    another target than ``name``; ``retrain`` is the command that trains one for it."""
    if other_target(stored_name, stored_signature, name, model):
        print(f"warning: {what} {shown} was trained for another target ({shorten(str(stored_name))}) than "
              f"{shorten(name)}: its LM head "
              f"differs, so nearly every draft will be rejected; train one for this target with `{retrain}`",
              file=sys.stderr)
