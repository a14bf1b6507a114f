"""The training loop: ViSpec's recipe at any scale, under ``accelerate`` (one CPU or several GPUs).

- **Frozen:** the target, its embeddings (the head holds a frozen copy) and its LM head (shared).
  Trained: ``fc``, the decoder layer, and for vispec ``img_fc`` and the adaptor.
- **Data:** step s takes ``batch_size`` sequences from a stream of epochs, each a seeded
  permutation of the training sequences (:func:`batch_indices`), so the order depends only on the
  seed and a resumed run sees the same batches.
- **Loss:** :class:`~.passes.HeadObjective` (multi-token passes, noise; :mod:`.losses`).
- **Optimiser:** AdamW with betas (0.9, 0.95) (ViSpec), linear warm-up over ``warmup`` of the steps
  (ViSpec: one epoch of twenty, 5%) then linear decay to zero, gradients clipped to ±``clip`` per
  value (ViSpec: 0.5).
- **Checkpoints** every ``checkpoint_every`` steps and at the last one (:mod:`.checkpoint`).
- **Distribution:** ``accelerate.Accelerator`` prepares the objective (DDP across processes under
  ``accelerate launch``) and the optimizer; each step's batch is split between the processes with
  ``split_between_processes``, so the global batch is ``batch_size`` whatever the number of
  processes. On one CPU the accelerator does nothing but hold the device. Deterministic for a seed
  on a CPU with a fixed number of threads.
"""

from __future__ import annotations

import contextlib
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from mmspec_cli.errors import InputError
from mmspec_cli.models.head import DraftHead
from mmspec_cli.models.loading import LoadedModel
from mmspec_cli.models.writing import WriteFailed
from mmspec_cli.training.checkpoint import save_checkpoint
from mmspec_cli.training.losses import loss_function, lr_factor
from mmspec_cli.training.passes import HeadObjective
from mmspec_cli.training.sequences import SequenceStore

BETAS = (0.9, 0.95)  # ViSpec's AdamW


@dataclass(frozen=True)
class TrainConfig:
    """What decides the trained weights (a resumed run must keep every one of them)."""

    steps: int
    batch_size: int = 8
    lr: float = 3e-5
    passes: int = 3  # --mtp: pass 0 on the target's features + 2 passes on the head's own
    noise: float = 0.2  # relative amplitude of the uniform noise on the target's features
    loss: str = "vispec"
    warmup: float = 0.05  # share of the steps
    clip: float = 0.5  # gradient value clipping (ViSpec)
    weight_decay: float = 0.01  # AdamW's default, as ViSpec keeps it
    seed: int = 0
    checkpoint_every: int = 200


@dataclass
class TrainResult:
    steps: int
    started_at: int  # 0, or the step a resumed run started from
    seconds: float
    history: list[dict] = field(default_factory=list)  # per step: loss and top-1 agreement per pass
    kept: dict = field(default_factory=dict)  # what the caller asked to keep in checkpoints (restored on resume)

    def tail(self, n: int = 50) -> dict[str, list[float]]:
        """Mean loss and top-1 agreement per pass over the last ``n`` steps run."""
        rows = self.history[-n:]
        passes = max((len(r["passes"]) for r in rows), default=0)
        out: dict[str, list[float]] = {"loss": [], "top1": []}
        for k in range(passes):
            vals = [r["passes"][k] for r in rows if len(r["passes"]) > k]
            out["loss"].append(round(sum(v["loss"] for v in vals) / len(vals), 4))
            out["top1"].append(round(sum(v["top1"] for v in vals) / len(vals), 4))
        return out


def batch_indices(step: int, batch_size: int, n: int, seed: int, _orders: dict | None = None) -> list[int]:
    """The sequences of step ``step``: positions step·B .. step·B + B − 1 of the stream of epochs, epoch e
    being ``random.Random(f"mmspec-train:{seed}:{e}")``'s permutation of range(n)."""
    orders = {} if _orders is None else _orders
    out = []
    for position in range(step * batch_size, (step + 1) * batch_size):
        epoch = position // n
        if epoch not in orders:
            orders[epoch] = random.Random(f"mmspec-train:{seed}:{epoch}").sample(range(n), n)
        out.append(orders[epoch][position % n])
    return out


def make_accelerator(on_cpu: bool, unused_parameters: bool):
    """``accelerate.Accelerator`` (its DDP told that the vispec adaptor goes unused on text-only batches)."""
    from accelerate import Accelerator, DistributedDataParallelKwargs

    return Accelerator(cpu=on_cpu, kwargs_handlers=[DistributedDataParallelKwargs(
        find_unused_parameters=unused_parameters)])


def train(head: torch.nn.Module, target: LoadedModel, store: SequenceStore, config: TrainConfig, out: Path,
          identity: dict[str, Any], resume: dict[str, Any] | None = None, keep: dict | None = None,
          on_step: Callable[[int, int, list[dict]], None] | None = None,
          objective: torch.nn.Module | None = None, accelerator: Any = None) -> TrainResult:
    """Train ``head`` in place for ``config.steps`` optimizer steps (from a checkpoint's step when ``resume``).

    ``head`` is what is trained and checkpointed: a :class:`DraftHead`, whose loss is
    :class:`HeadObjective`, or any module with its own ``objective`` (FastVLM's imitation network,
    :mod:`.imitation`): a module whose ``forward(batch, generator)`` gives (loss, pass stats).
    ``identity`` (kind, num_q, target) goes into every checkpoint with ``keep`` (the caller's own
    values, e.g. the acceptance before training); ``on_step(step, total, pass_stats)`` after each step;
    ``accelerator`` the run's (None: made here).
    """
    lm_head = target.model.get_output_embeddings()
    device = lm_head.weight.device
    accelerator = accelerator or make_accelerator(device.type == "cpu", getattr(head, "kind", None) == "vispec")
    head.to(device=device, dtype=torch.float32).train()
    if objective is None:
        objective = HeadObjective(head, lm_head, target.image_token_id, loss_function(config.loss), config.passes,
                                  config.noise)
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, betas=BETAS, weight_decay=config.weight_decay)
    total = config.steps
    warm = max(1, round(config.warmup * total))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, warm, total))
    generator = torch.Generator().manual_seed(config.seed * 1009 + accelerator.process_index)
    start = 0
    kept = dict(keep or {})
    if resume is not None:
        head.load_state_dict(resume["head"])
        optimizer.load_state_dict(resume["optimizer"])
        scheduler.load_state_dict(resume["scheduler"])
        generator.set_state(resume["noise_rng"])
        torch.set_rng_state(resume["torch_rng"])
        start = int(resume["step"])
        kept.update(resume.get("kept", {}))
    objective, optimizer = accelerator.prepare(objective, optimizer)
    orders: dict = {}
    result = TrainResult(steps=total, started_at=start, seconds=0.0, kept=kept)
    clock = time.perf_counter()
    saved = start if resume is not None else None  # the step of the newest checkpoint on disk

    def checkpoint(step: int, rng: tuple[torch.Tensor, torch.Tensor], barrier: bool = True) -> None:
        nonlocal saved
        if accelerator.is_main_process:
            try:
                save_checkpoint(out, {**identity, "settings": asdict(config), "step": step,
                                      "head": head.state_dict(),
                                      "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                                      "noise_rng": rng[0], "torch_rng": rng[1], "kept": kept})
            except WriteFailed as exc:
                before = (f"the checkpoint of step {saved} is kept" if saved is not None
                          else "no earlier checkpoint was written")
                raise WriteFailed(exc.path, f"{exc.reason}; {before}; free some space and run the same command"
                                            f"{' with --resume' if saved is not None else ''}") from None
        saved = step
        if barrier:
            accelerator.wait_for_everyone()

    def rng_now() -> tuple[torch.Tensor, torch.Tensor]:
        return generator.get_state(), torch.get_rng_state()

    def stop(step: int, what: str) -> TrainingDiverged:
        kept = (f"the checkpoint of step {saved} is kept in {out}/checkpoint.pt (delete it to train again)"
                if saved is not None else "no checkpoint was written")
        return TrainingDiverged(f"training stopped at step {step}: {what} (the learning rate {config.lr:g} is likely "
                                f"too high); {kept}; train again with a lower --lr (the answers are reused)")

    done = start  # the steps whose update is complete
    rng = rng_now()  # the RNG states after `done` steps: what a checkpoint of `done` holds
    with CtrlC() as ctrl_c:
        try:
            for step in range(start, total):
                indices = batch_indices(step, config.batch_size, len(store), config.seed, orders)
                with accelerator.split_between_processes(indices, apply_padding=True) as mine:
                    batch = [store[i] for i in mine]
                loss, stats = objective(batch, generator)
                losses = accelerator.gather(loss.detach().reshape(1))  # every process decides alike
                if not bool(torch.isfinite(losses).all()):
                    raise stop(step + 1, f"the loss is {float(losses[~torch.isfinite(losses)][0])}")
                accelerator.backward(loss)
                accelerator.clip_grad_value_(params, config.clip)
                with ctrl_c.deferred():  # an update is applied whole or not at all
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad(set_to_none=True)
                    result.history.append({"step": step + 1, "loss": float(loss.detach()), "passes": stats})
                    done, rng = step + 1, rng_now()
                if on_step is not None:
                    on_step(step + 1, total, stats)
                if done % config.checkpoint_every == 0 or done == total:
                    wrong = unsavable(params)
                    if wrong:  # never checkpoint (nor, at the end, save) weights that can't be used
                        raise stop(done, wrong)
                    checkpoint(done, rng)
        except KeyboardInterrupt:
            if done > 0 and saved != done and not unsavable(params):  # the interval since the last checkpoint too
                checkpoint(done, rng, barrier=False)
            if saved is None:
                raise TrainingInterrupted("no training step was completed, so no checkpoint was written") from None
            raise TrainingInterrupted(f"the checkpoint of step {saved} of {total} is saved in {out}") from None
    result.seconds = time.perf_counter() - clock
    head.eval()
    return result


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C during train-head, once what it reached is saved: ``saved`` says what stays on disk (None: nothing);
    the CLI prints it with the command that continues."""

    def __init__(self, saved: str | None):
        super().__init__(saved)
        self.saved = saved


class TrainingDiverged(InputError):
    """The loss turned NaN or infinite: the run stops before the update that would spread it into the weights."""


def unsavable(params: list[torch.Tensor]) -> str | None:
    """Why weights can't be kept (NaN or infinity, or values beyond float16, the dtype networks are saved in), or
    None. A learning rate far too high gets there in one update, before any loss turns NaN."""
    largest = torch.finfo(torch.float16).max
    for p in params:
        data = p.detach()
        if not bool(torch.isfinite(data).all()):
            return "the weights hold NaN or infinity"
        if bool((data.abs() > largest).any()):
            return f"the weights grew past float16's range (up to {float(data.abs().max()):.3g})"
    return None


class CtrlC:
    """While entered: Ctrl-C raises KeyboardInterrupt at once, except inside :meth:`deferred`, where it is held until
    the block ends. Installed only in the main thread, and only over Python's own handler (a SIGINT that the shell
    ignores, for a background job, stays ignored)."""

    def __init__(self):
        self.holding = False
        self.pending = False
        self.previous: Any = None

    def __enter__(self) -> "CtrlC":
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            self.previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.holding:
            self.pending = True
            return
        raise KeyboardInterrupt

    @contextlib.contextmanager
    def deferred(self):
        self.holding = True
        try:
            yield
        finally:
            self.holding = False
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt


def trainable_parameters(head: DraftHead) -> int:
    return sum(p.numel() for p in head.parameters() if p.requires_grad)


def copy_embeddings(head: DraftHead, target: LoadedModel) -> None:
    """The head's frozen embedding table is a copy of the target's input embeddings."""
    weight = target.model.get_input_embeddings().weight
    with torch.no_grad():
        head.embed_tokens.weight.copy_(weight.detach().to(head.embed_tokens.weight.dtype))

