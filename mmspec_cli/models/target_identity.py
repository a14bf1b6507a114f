"""What a trained draft network (a head, an imitation network) remembers of the target it was trained for.

A head or an imitation network only drafts well for the target whose features it learnt; for
another target of the same shape (a random one, another fine-tune) nearly every draft is
rejected (τ ≈ 1), although nothing fails. Its ``config.json`` therefore keeps the target's
name and :func:`signature`: :data:`ROWS` x :data:`COLUMNS` entries of the target's LM head,
spread over its vocabulary and its width, with their row and column numbers. Loading compares
them (:func:`warn_if_other_target`) and says so in one ``warning:`` line, without refusing: the
user may know better (a head reused for a close fine-tune).

Entries, not norms: a fine-tune that moves every weight by a few percent of its spread leaves
the norm of a row (a sum over its width) within a fraction of a percent, and so looked like the
target itself; most of its entries move by more than :data:`RTOL`. The same weights in another
precision agree entry by entry within :data:`RTOL` (bfloat16 keeps 8 significant bits: it
rounds by at most 2**-8 of a value, half the tolerance) or :data:`ATOL` (float16's smallest
subnormal steps, for entries near zero).

Networks saved before held the norms of :data:`ROWS` rows (a list): they are still compared so,
within :data:`NORM_RTOL`.

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
COLUMNS = 8
RTOL = 2**-7  # entries: twice bfloat16's largest rounding, far below what a fine-tune moves
ATOL = 2**-24  # entries: float16's subnormal spacing, for entries near zero
NORM_RTOL = 1e-2  # the norms networks saved before hold


def canonical_name(model: str) -> str:
    """A model's name for comparisons: a local folder as its absolute normalised path, anything else as written."""
    expanded = os.path.expanduser(model)
    if os.path.isdir(expanded):
        return os.path.normpath(os.path.abspath(expanded))
    return model


def signature(model: Any) -> dict[str, list] | None:
    """:data:`ROWS` x :data:`COLUMNS` entries of the model's LM head at evenly spaced rows and columns (float32,
    7 significant digits), with their numbers: ``{"rows": [...], "columns": [...], "entries": [[...], ...]}``;
    None when its weights are not at hand (offloaded to disk by ``device_map``)."""
    weight = model.get_output_embeddings().weight
    if weight.device.type == "meta":
        return None
    rows, columns = _spread(weight.shape[0], ROWS), _spread(weight.shape[1], COLUMNS)
    with torch.no_grad():
        entries = _entries(weight, rows, columns).tolist()
    return {"rows": rows, "columns": columns, "entries": [[float(f"{x:.7g}") for x in row] for row in entries]}


def _spread(size: int, count: int) -> list[int]:
    """``count`` evenly spaced numbers from 0 to ``size - 1`` (fewer when ``size`` is smaller)."""
    return sorted({round(i * (size - 1) / max(count - 1, 1)) for i in range(min(count, size))})


def _entries(weight: torch.Tensor, rows: list[int], columns: list[int]) -> torch.Tensor:
    index = torch.tensor(rows, device=weight.device)
    return weight.index_select(0, index)[:, torch.tensor(columns, device=weight.device)].double().cpu()


def same_signature(stored: Any, weight: torch.Tensor) -> bool:
    """Whether the LM-head ``weight`` has the ``stored`` signature: its entries (:func:`signature`) within
    :data:`RTOL` or :data:`ATOL` each, or, for a signature saved before (a list), its rows' norms within
    :data:`NORM_RTOL`. A signature that can't be read, or names rows or columns the weight lacks, differs."""
    if isinstance(stored, list):
        here = _norms(weight)
        return len(stored) == len(here) and all(
            abs(float(x) - y) <= NORM_RTOL * max(abs(float(x)), abs(y)) for x, y in zip(stored, here))
    try:
        rows, columns = [int(r) for r in stored["rows"]], [int(c) for c in stored["columns"]]
        entries = torch.tensor(stored["entries"], dtype=torch.float64)
    except (KeyError, TypeError, ValueError):
        return False
    if not all(0 <= r < weight.shape[0] for r in rows) or not all(0 <= c < weight.shape[1] for c in columns) \
            or tuple(entries.shape) != (len(rows), len(columns)):
        return False
    with torch.no_grad():
        here = _entries(weight, rows, columns)
    return bool(((here - entries).abs() <= RTOL * torch.maximum(here.abs(), entries.abs()) + ATOL).all())


def _norms(weight: torch.Tensor) -> list[float]:
    """The norms of :data:`ROWS` evenly spaced rows of ``weight``: the signature networks saved before hold."""
    rows = torch.linspace(0, weight.shape[0] - 1, ROWS).round().long().to(weight.device)
    with torch.no_grad():
        return weight[rows].float().norm(dim=-1).tolist()


def other_target(stored_name: Any, stored_signature: Any, name: str, model: Any) -> bool:
    """Whether a network stored with ``stored_name``/``stored_signature`` was trained for another target than
    ``model`` (called ``name``): by the signature when one is stored, else by the name; unknown: False."""
    if isinstance(stored_signature, (list, dict)) and stored_signature:
        weight = model.get_output_embeddings().weight
        return weight.device.type != "meta" and not same_signature(stored_signature, weight)
    if isinstance(stored_name, str) and stored_name:
        return canonical_name(stored_name) != canonical_name(name)
    return False


def warn_if_other_target(what: str, shown: str, stored_name: Any, stored_signature: Any, name: str,
                         model: Any, retrain: str) -> None:
    """One ``warning:`` line on stderr when ``what`` (``head``, ``ssd.imitation``) named ``shown`` was trained for
    another target than ``name``; ``retrain`` is the command that trains one for it."""
    if other_target(stored_name, stored_signature, name, model):
        same_name = isinstance(stored_name, str) and canonical_name(stored_name) == canonical_name(name)
        other = ("another version of it (a fine-tune, or other weights under that name)" if same_name
                 else f"another target ({shorten(str(stored_name))})")
        print(f"warning: {what} {shown} was trained for {other}, not {shorten(name)}: its LM head differs, so "
              f"nearly every draft will be rejected; train one for this target with `{retrain}`", file=sys.stderr)
