"""How many CPU threads torch uses when the models run on the CPU, chosen on purpose.

torch's default (one thread per core) falls off a cliff on a busy machine: its threads wait
for each other at every operator, and a core taken by another process stalls them all. On a
2-core machine with two busy processes beside it, the README's main job ran about 120 times
slower (docs/BENCHMARKS.md, "CPU threads under load"). The choice, in this order:

1. ``--threads N``, then the ``MMSPEC_THREADS`` environment variable: N as given, at most
   :data:`THREADS_PER_CORE` times the cores this process may use (refused in one line before anything loads);
2. models on a GPU: torch's default is left alone (its CPU threads barely work there);
3. a small target (fewer than :data:`SMALL_MODEL_PARAMS` parameters, like the demo family):
   1 thread, since an operator on such small tensors costs less than waking a second thread;
4. otherwise: the cores this process may use that the load average leaves idle (at least 1).

The choice is printed in ``generate --json`` and carried by ``bench`` records.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from mmspec_cli.errors import InputError

ENV = "MMSPEC_THREADS"
SMALL_MODEL_PARAMS = 50_000_000
#: The most threads a user may ask for per usable core. torch's threads meet at every operator, so threads beyond
#: the cores only wait for their turn (``--threads 1000`` on 2 cores took 188 s for 52 tokens); twice the cores still
#: lets oversubscription be measured on purpose, and refuses a typo before it costs minutes.
THREADS_PER_CORE = 2


@dataclass(frozen=True)
class ThreadChoice:
    """``count`` threads (None: torch's default left alone) and why."""

    count: int | None
    reason: str

    def as_dict(self) -> dict:
        return {"count": self.count, "reason": self.reason}


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity), not every core of the machine."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def check_count(value: object, source: str, cores: int | None = None) -> int:
    """A thread count from a flag or the environment: an integer from 1 to :data:`THREADS_PER_CORE` times the
    ``cores`` this process may use (default: :func:`usable_cores`), or one line saying how to fix it."""
    try:
        count = int(str(value).strip())
    except ValueError:
        count = 0
    if count < 1:
        raise InputError(f"{source}: expected a number of CPU threads >= 1, got {str(value)[:40]!r}; "
                         f"e.g. {source.split('=')[0]} 1")
    cores = usable_cores() if cores is None else cores
    if count > THREADS_PER_CORE * cores:
        shown = str(count) if len(str(count)) <= 12 else f"{str(count)[:9]}..."
        raise InputError(f"{source}: {shown} CPU threads is more than {THREADS_PER_CORE} per core this process may "
                         f"use ({cores} core{'s' * (cores != 1)}: at most {THREADS_PER_CORE * cores}); threads beyond "
                         f"the cores only wait for each other: use {cores}{' or fewer' * (cores > 1)}, or give none "
                         f"for mmspec's own choice")
    return count


def choose_threads(requested: int | None, env: Mapping[str, str], on_cpu: bool, target_params: int,
                   cores: int, load: float | None) -> ThreadChoice:
    """The thread count by the rules in the module docstring (pure: every input is given)."""
    if requested is not None:
        return ThreadChoice(check_count(requested, "--threads", cores), "--threads")
    if env.get(ENV, "").strip():
        return ThreadChoice(check_count(env[ENV], ENV, cores), ENV)
    if not on_cpu:
        return ThreadChoice(None, "models on a GPU: torch's default")
    if target_params < SMALL_MODEL_PARAMS:
        return ThreadChoice(1, f"small target ({target_params / 1e6:.1f}M parameters): 1 thread")
    if load is None:
        return ThreadChoice(cores, f"{cores} usable cores")
    idle = max(1, min(cores, math.floor(cores - load + 0.5)))
    return ThreadChoice(idle, f"{cores} usable cores, load average {load:.2f}: {idle} idle")


def apply_threads(requested: int | None, model) -> ThreadChoice:
    """Choose for ``model`` (the target) on this machine and set torch's intra-op threads."""
    import torch

    on_cpu = model.device.type == "cpu"
    params = sum(p.numel() for p in model.parameters())
    choice = choose_threads(requested, os.environ, on_cpu, params, usable_cores(), load_average())
    if choice.count is not None:
        torch.set_num_threads(choice.count)
    return choice


def busy_warning(choice: ThreadChoice, on_cpu: bool, load: float | None = None, cores: int | None = None) -> str | None:
    """One ``warning:`` line when the machine is busier than the cores this process may use: CPU timings
    taken then (``profile-latency``) say more about the other work than about the models."""
    load = load_average() if load is None else load
    cores = usable_cores() if cores is None else cores
    if not on_cpu or load is None or load <= cores:
        return None
    return (f"warning: the load average is {load:.2f}, above the {cores} cores this process may use; the timings "
            f"below are not trustworthy (other work competes for the CPU); measure on a quiet machine "
            f"({choice.count or 'default'} threads used)")
