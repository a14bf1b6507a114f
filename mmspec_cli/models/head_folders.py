"""What every draft head on disk shares, whatever its kind: where its folder is (a local folder, ``mmspec:NAME`` or a
hub id), reading its weights (one line when they are missing or unreadable), writing them with its config (together,
atomically), refusing weights a diverged training left (NaN, infinity), and its rope settings without M-RoPE's
keys. ``head_files`` (EAGLE-2, ViSpec) and
``eagle3_files`` (EAGLE-3) read heads through these."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from mmspec_cli.errors import ModelLoadError
from mmspec_cli.models.loading import hub_folder, model_location
from mmspec_cli.models.writing import WriteFailed, reason, write_atomically

CONFIG = "config.json"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def head_dir(model: str, revision: str | None = None) -> Path:
    """The folder holding a head: ``mmspec:NAME`` -> shipped, a folder -> itself, a hub id -> its snapshot."""
    location = model_location(model)
    folder = Path(location)
    if folder.is_dir():
        return folder
    return Path(hub_folder("head", location, revision, patterns=[CONFIG, *WEIGHT_FILES]))


def read_weights(folder: Path, shown: str) -> dict[str, torch.Tensor]:
    """The tensors of ``folder``'s weights file (safetensors first)."""
    for name in WEIGHT_FILES:
        path = folder / name
        if not path.is_file():
            continue
        try:
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(str(path))
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # a truncated or foreign file: one line, whatever the reader raised
            said = (str(exc).strip().splitlines() or [""])[0].split(". ")[0][:120]  # its first sentence
            raise ModelLoadError(f"head.model: {shown}/{name} can't be read ({type(exc).__name__}: {said}); download "
                                 f"or copy the head again") from None
    raise ModelLoadError(f"head.model: {shown} has no weights; expected one of {', '.join(WEIGHT_FILES)} beside its "
                         f"{CONFIG}")


def write_head_folder(folder: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> list[Path]:
    """``model.safetensors`` and ``config.json`` in ``folder`` (made if missing), written together atomically
    (:func:`mmspec_cli.models.writing.write_atomically`: a failure leaves both files as they were); the paths."""
    from safetensors.torch import save

    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file above it, a read-only file system: said as a failed write
        raise WriteFailed(folder, reason(exc)) from None
    data = save({k: v.contiguous() for k, v in tensors.items()}, metadata={"format": "pt"})
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    paths = [folder / WEIGHT_FILES[0], folder / CONFIG]
    write_atomically({paths[0]: lambda handle: handle.write(data),
                      paths[1]: lambda handle: handle.write(text.encode("utf-8"))})
    return paths


def check_finite(weights: dict[str, torch.Tensor], what: str, retrain: str) -> None:
    """Refuse weights holding NaN or infinity (a diverged training): they would make every draft distribution NaN."""
    for key, tensor in weights.items():
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise ModelLoadError(f"{what}: {key} holds NaN or infinite values (its training diverged); train it "
                                 f"again with a lower --lr (`{retrain}`)")


@contextlib.contextmanager
def built_from_config(shown: str) -> Iterator[None]:
    """Around building a head's config and modules from its ``config.json``: what transformers raises on values no
    head has (0 attention heads, an unknown activation or rope type, a negative size, a string for a number) is one
    line naming the head's file, not a traceback."""
    try:
        yield
    except ModelLoadError:
        raise
    except Exception as exc:  # noqa: BLE001 - ValueError, KeyError, ZeroDivisionError, huggingface_hub's strict
        # dataclass errors (not ValueErrors): whatever the user's config.json makes transformers raise
        said = " ".join(line.strip() for line in str(exc).splitlines()).split(". ")[0][:120]
        raise ModelLoadError(f"head.model: {shown}/{CONFIG} doesn't describe a head that can be built "
                             f"({type(exc).__name__}: {said}); download the head again, or name the {CONFIG} that "
                             f"came with its weights") from None


def folder_holds(raw: Any) -> str | None:
    """What a folder whose ``config.json`` is ``raw`` holds when it is no draft head at all, in words (an imitation
    network, a whole model: one with text or vision parts, or of several decoder layers, where every head has one);
    None when it may be a head (mmspec's or a published layout: its own loader checks the rest)."""
    if not isinstance(raw, dict):
        return None
    if "mmspec_imitation" in raw:
        return "an imitation network (ssd.imitation), not a draft head"
    meta = raw.get("mmspec")
    names = [str(name) for name in raw.get("architectures") or []]
    if (isinstance(meta, dict) and meta.get("kind")) or "speculators_config" in raw or "draft_vocab_size" in raw \
            or any("Eagle3" in name for name in names):
        return None
    model = f"a whole {raw['model_type']} model" if isinstance(raw.get("model_type"), str) else "a whole model"
    if "text_config" in raw or "vision_config" in raw:
        return f"{model}, not a draft head"
    layers = raw.get("num_hidden_layers")
    if isinstance(layers, int) and not isinstance(layers, bool) and layers > 1:
        return f"{model} of {layers} layers, not a draft head (a head has one)"
    return None


def check_head_config(raw: dict[str, Any], shown: str, fix: str) -> None:
    """Refuse a head folder's parsed ``config.json`` that is no head's, before its weights are read (a whole model's
    may be many gigabytes): an ``mmspec`` block that is not an object, or what :func:`folder_holds` names; ``fix``:
    the folder to name instead."""
    if "mmspec" in raw and not isinstance(raw["mmspec"], dict):
        raise ModelLoadError(f"head.model: {shown}/{CONFIG} has an mmspec block that is not an object; it is not a "
                             f"config mmspec wrote: download or copy the head again")
    holds = folder_holds(raw)
    if holds:
        raise ModelLoadError(f"head.model: {shown} holds {holds}; {fix}")


def with_article(kind: str) -> str:
    """``an eagle``, ``a vispec``, ``an eagle3``."""
    return f"{'an' if kind[:1] in 'aeiou' else 'a'} {kind}"


def plain_rope(rope: dict[str, Any]) -> dict[str, Any]:
    """Rope settings without M-RoPE: the ``mrope*`` keys dropped and an ``mrope`` type read as ``default``
    (transformers' Qwen2-VL configs do the same)."""
    out = {k: v for k, v in rope.items() if not k.startswith("mrope")}
    if "mrope" in (out.get("type"), out.get("rope_type")):
        out.pop("type", None)
        out["rope_type"] = "default"
    return out
