"""Bounds on the numbers ``train-head`` is given that no flag type can express (imports no torch)."""

from __future__ import annotations

from mmspec_cli.errors import InputError

#: More optimizer steps than any training finishes (ViSpec's runs take tens of thousands): above it, a typo. A run
#: that long would never end, and its learning rate would stay in warm-up (5% of the steps) for good.
MAX_STEPS = 10_000_000


def check_steps(steps: int, flag: str) -> None:
    """Refuse ``steps`` (from ``flag``: --steps, or --epochs times the batches per epoch) above :data:`MAX_STEPS`."""
    if steps > MAX_STEPS:
        raise InputError(f"{flag}: {steps:,} optimizer steps would never finish (at most {MAX_STEPS:,}; ViSpec "
                         f"trains for tens of thousands); pass fewer")
