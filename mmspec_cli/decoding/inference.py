"""Inference mode entered once per block: :func:`inference`, the decorator of the calls a block makes.

``@torch.inference_mode()`` enters the mode at every call, even when it is on already: it builds a context object,
enters and leaves it (about 1.6 µs a call on this CPU when its caches are warm, several times that right after a
forward). A block made several (on the demo family, greedy, per block: 6.0 for `m`, 6.1 for `tabed` and 3.1 for
`eagle` eager; 3.7, 3.4 and 4.9 compiled; ``benchmarks/census_engine_ops.py``).
:meth:`~mmspec_cli.decoding.step.BlockStep.run` runs its whole block under one ``torch.inference_mode()``, and the
methods it reaches are decorated with :func:`inference`, which runs them as they are when the mode is on and enters
it otherwise (a call from a test, a benchmark or a drafter's turn start). Each such call runs under the mode as it
did; what the block computes between them (the verification rule's tensors, a drafter's proposal and observations)
is now computed under it too. The events a block yields hold Python numbers, no tensors.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

Fn = TypeVar("Fn", bound=Callable)


def inference(fn: Fn) -> Fn:
    """``fn`` run under ``torch.inference_mode()``, which is entered only when it is not on already."""

    @functools.wraps(fn)
    def under_inference_mode(*args, **kwargs):
        if torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with torch.inference_mode():
            return fn(*args, **kwargs)

    return under_inference_mode  # type: ignore[return-value]
