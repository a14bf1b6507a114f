"""Draft heads on disk: one loader for local folders, hub ids and shipped heads (``mmspec:NAME``), strict.

The layout is that of ViSpec's published heads: ``config.json`` with Llama-style keys
(hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, vocab_size,
rms_norm_eps, max_position_embeddings, rope settings) and ``model.safetensors`` (or
``pytorch_model.bin``) with the tensors of :class:`~mmspec_cli.models.head.DraftHead`: 17 for a
LLaVA vispec head, 11 for an eagle head. Every tensor must be used and none may be missing.

ViSpec's published Qwen2.5-VL heads (source: ViSpec's published checkpoint layout, the ``JLKang/ViSpec-*``
hub repositories, here ``JLKang/ViSpec-Qwen2.5-VL-7B-Instruct``) add ``"qkv_bias": true`` and
``rope_theta`` to config.json and five tensors: the decoder layer's ``layers.0.self_attn.{q,k,v}_proj.bias``
and the vision adaptor's ``imadpt.{k,v}_proj.bias``, 22 in all for a vispec head (``imadpt.q`` is
(2, 28, 128) for the 7B, as reported for that repository; mmspec's tests check this layout offline, with
random weights, on a tiny Qwen2.5-VL target). Such a head gets transformers'
``Qwen2DecoderLayer`` (:func:`~mmspec_cli.models.head.decoder_parts`); a Qwen-VL ``mrope`` rope type in
its config is read as the plain 1-D rope the head runs (:func:`plain_rope`).

Heads trained by mmspec add an ``mmspec`` block to ``config.json``: the kind, num_q and the target
they were trained for. Published heads have none: their kind follows from their tensors
(``imadpt`` and ``img_fc`` make a vispec head) and num_q from ``imadpt.q`` (2 when absent).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig

from mmspec_cli.choices import EAGLE3, HEAD_KINDS
from mmspec_cli.errors import ModelLoadError
from mmspec_cli.models.head import DEFAULT_NUM_Q, DraftHead, has_qkv_bias
from mmspec_cli.models.head_folders import (built_from_config, check_finite, check_head_config, head_dir, plain_rope,
                                           read_weights, with_article, write_head_folder)
from mmspec_cli.models.loading import LoadedModel
from mmspec_cli.models.prompts import shorten
from mmspec_cli.models.target_identity import warn_if_other_target

CHECKED_SHAPE = ("hidden_size", "vocab_size", "num_attention_heads")  # a head for another target differs here


@dataclass(frozen=True)
class HeadInfo:
    """What ``config.json`` says about a head: its layer config, kind, num_q, target and the target's signature
    (:func:`~.target_identity.signature`, or the norms heads saved before hold; None when unknown)."""

    config: LlamaConfig
    kind: str | None
    num_q: int | None
    target: str | None
    target_signature: dict[str, list] | list[float] | None = None




def read_info(folder: Path, shown: str) -> HeadInfo:
    path = folder / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"head.model: {shown} has no config.json; a head folder holds config.json and "
                             f"model.safetensors (as `mmspec train-head` writes them)") from None
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"head.model: {shown}/config.json can't be read ({exc})") from None
    if isinstance(raw, dict):
        check_head_config(raw, shown, "name a head folder (as `mmspec train-head` writes it)")
    if not isinstance(raw, dict) or not all(isinstance(raw.get(k), int) for k in CHECKED_SHAPE):
        raise ModelLoadError(f"head.model: {shown}/config.json lacks integer {', '.join(CHECKED_SHAPE)}; "
                             f"it is not a draft head's config")
    if not isinstance(raw.get("qkv_bias", False), bool):
        raise ModelLoadError(f"head.model: {shown}/config.json has qkv_bias {json.dumps(raw['qkv_bias'])}; "
                             f"set it to true (q/k/v biases, as ViSpec's Qwen heads) or false")
    meta = raw.pop("mmspec", None) or {}
    fields = {k: v for k, v in raw.items() if k not in ("architectures", "model_type", "transformers_version")}
    for key in ("rope_scaling", "rope_parameters"):
        if isinstance(fields.get(key), dict):
            fields[key] = plain_rope(fields[key])
    fields["num_hidden_layers"] = 1
    if meta.get("kind") is not None and meta.get("kind") not in HEAD_KINDS:
        raise ModelLoadError(f"head.model: {shown}/config.json names kind {shorten(json.dumps(meta['kind']), 30)}, "
                             f"which is no head kind mmspec knows ({', '.join(HEAD_KINDS)}); name a head folder as "
                             f"`mmspec train-head` writes it")
    with built_from_config(shown):
        config = LlamaConfig(**fields)
    return HeadInfo(config, meta.get("kind"), meta.get("num_q"), meta.get("target"), meta.get("target_signature"))




def infer_kind(weights: dict[str, torch.Tensor]) -> str:
    return "vispec" if any(k.startswith(("imadpt.", "img_fc.")) for k in weights) else "eagle"


def target_shape(target: LoadedModel) -> dict[str, int]:
    text = target.model.config.get_text_config()
    return {"hidden_size": text.hidden_size, "vocab_size": target.vocab_size,
            "num_attention_heads": text.num_attention_heads}


def check_fits(info: HeadInfo, target: LoadedModel, shown: str) -> None:
    """A head trained for another target is refused in one line naming both shapes."""
    wanted = target_shape(target)
    have = {k: getattr(info.config, k) for k in CHECKED_SHAPE}
    if have != wanted:
        diff = ", ".join(f"{k} {have[k]} vs {wanted[k]}" for k in CHECKED_SHAPE if have[k] != wanted[k])
        raise ModelLoadError(f"head {shown} was trained for another target ({diff} in {shorten(target.name)}); "
                             f"train one for this target with `mmspec train-head`")


def is_qkv_bias(key: str) -> bool:
    """A q/k/v bias of the decoder layer or the vision adaptor: what a ``qkv_bias`` head has more."""
    return key.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")) and key.startswith(("layers.", "imadpt."))


def check_tensors(head: DraftHead, weights: dict[str, torch.Tensor], shown: str) -> None:
    """Every tensor of the head present with its shape, and no other: one line naming the fault and its fix."""
    wanted = {k: tuple(v.shape) for k, v in head.state_dict().items()}
    missing = [k for k in wanted if k not in weights]
    extra = [k for k in weights if k not in wanted]
    if missing or extra:
        parts = ([f"missing {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}"] if missing else []) + \
                ([f"unexpected {', '.join(extra[:3])}{' ...' if len(extra) > 3 else ''}"] if extra else [])
        biased = has_qkv_bias(head.config)
        biases = [k for k in wanted if is_qkv_bias(k)]
        if extra and not missing and not biased and all(is_qkv_bias(k) for k in extra):
            fix = 'these are q/k/v biases (ViSpec\'s Qwen layout): add "qkv_bias": true to its config.json'
        elif missing and not extra and biased and missing == biases:
            fix = 'its config.json says "qkv_bias": true but it holds no q/k/v biases: set it to false'
        elif missing and not extra and biased and all(is_qkv_bias(k) for k in missing):
            fix = (f"a qkv_bias head holds all {len(biases)} q/k/v biases, so the file is incomplete: download "
                   f"it again or name a complete head")
        else:
            fix = ("its weights are not those its config.json describes, or the file is incomplete: download it "
                   "again, or name a folder as `mmspec train-head` writes it")
        layout = " with q/k/v biases" if biased else ""
        raise ModelLoadError(f"head {shown} doesn't have the tensors of a {head.kind} head{layout} "
                             f"({len(wanted)} expected): {'; '.join(parts)}; {fix}")
    for key, shape in wanted.items():
        if tuple(weights[key].shape) != shape:
            raise ModelLoadError(f"head {shown}: {key} has shape {tuple(weights[key].shape)}, expected {shape} "
                                 f"from its config.json; the weights and config.json are of different heads: "
                                 f"download the head again, or name the config.json that came with its weights")


def load_head(model: str, kind: str | None, num_q: int | None, target: LoadedModel,
              revision: str | None = None, drafter: str | None = None) -> DraftHead:
    """Load a head for ``target``; ``kind``/``num_q`` from the profile (None: from the checkpoint). ``drafter``: the
    kind of head the drafter that will use it needs (None: any), checked when the profile names no kind."""
    shown = shorten(model)
    folder = head_dir(model, revision)
    if kind == EAGLE3 or (kind is None and drafter == EAGLE3):
        from mmspec_cli.models.eagle3_files import load_eagle3

        return load_eagle3(model, target, revision)
    if looks_eagle3(folder):
        check_kind(EAGLE3, kind, drafter, shown)
        from mmspec_cli.models.eagle3_files import load_eagle3

        return load_eagle3(model, target, revision)
    info = read_info(folder, shown)
    check_fits(info, target, shown)
    weights = read_weights(folder, shown)
    check_finite(weights, f"head {shown}", "mmspec train-head")
    found = info.kind or infer_kind(weights)
    check_kind(found, kind, drafter, shown)
    if "imadpt.q" in weights:
        stored = int(weights["imadpt.q"].shape[0])
        if num_q is not None and num_q != stored:
            raise ModelLoadError(f"head {shown} was trained with num_q {stored}, the profile says {num_q}; "
                                 f"drop num_q or set it to {stored}")
        num_q = stored
    with built_from_config(shown):
        head = DraftHead(info.config, found, num_q or info.num_q or DEFAULT_NUM_Q)
    check_tensors(head, weights, shown)
    warn_if_other_target("head", shown, info.target, info.target_signature, target.name, target.model,
                         f"mmspec train-head {found}")
    head.load_state_dict(weights, strict=True, assign=True)  # keep the stored precision until the cast below
    lm_head = target.model.get_output_embeddings().weight
    return head.to(device=lm_head.device, dtype=lm_head.dtype).eval()


def looks_eagle3(folder: Path) -> bool:
    """Whether ``folder``'s config.json is an EAGLE-3 head's (mmspec's, SpecForge's, SGLang's or the speculators
    format): a draft vocabulary, an ``Eagle3`` architecture or a ``speculators_config``."""
    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(raw, dict):
        return False
    names = raw.get("architectures") or []
    meta = raw.get("mmspec")
    return ("draft_vocab_size" in raw or "speculators_config" in raw
            or (isinstance(meta, dict) and meta.get("kind") == EAGLE3) or any("Eagle3" in str(name) for name in names))


def check_kind(found: str, kind: str | None, drafter: str | None, shown: str) -> None:
    """Refuse a head of kind ``found`` that is not the kind the profile gives it (``kind``) or, when it gives none,
    the kind the drafter needs (``drafter``), in one line naming which of the two asked for another kind."""
    if kind is not None and kind != found:
        raise ModelLoadError(f"head {shown} is {with_article(found)} head but the profile says kind: {kind}; "
                             f"set its kind: {found}, or name {with_article(kind)} head")
    if kind is None and drafter is not None and drafter != found:
        raise ModelLoadError(f"the {drafter} drafter needs {with_article(drafter)} head, and the profile's head {shown} (which "
                             f"names no kind) is {with_article(found)} head; draft with {found}, or add {with_article(drafter)} head to "
                             f"the profile (head: [{{model: {shown}, kind: {found}}}, {{model: PATH, kind: {drafter}}}]"
                             f"), trained with `mmspec train-head {drafter}`")








def target_qkv_bias(model: torch.nn.Module) -> bool:
    """Whether the target's decoder attention has biases on q/k/v and none on o (Qwen2's, Qwen2-VL's, Qwen2.5-VL's
    attention; not Llama's nor Qwen3-VL's): a head for it then has them too, as ViSpec's Qwen heads do."""
    try:
        attention = model.get_decoder().layers[0].self_attn
    except (AttributeError, IndexError, TypeError, NotImplementedError):
        return False
    q, o = getattr(attention, "q_proj", None), getattr(attention, "o_proj", None)
    return getattr(q, "bias", None) is not None and o is not None and getattr(o, "bias", None) is None


def head_config(target: LoadedModel) -> LlamaConfig:
    """The layer config of a new head for ``target``: the target's text config, one layer, and ``qkv_bias: true``
    when the target's attention has q/k/v biases (:func:`target_qkv_bias`), so mmspec's own heads for Qwen2-VL
    and Qwen2.5-VL targets have ViSpec's published Qwen layout and save it (``save_head`` writes the key to
    config.json, which ``load_head`` reads back).

    The head reads 1-D positions along its own sequence (:func:`~mmspec_cli.models.head.head_sequence`), so a
    Qwen-VL target's M-RoPE sections are left out of its rotary settings, and so is the per-layer list of the
    target's attention kinds (``layer_types``)."""
    text = target.model.config.get_text_config()
    fields = {k: v for k, v in text.to_dict().items() if k not in ("architectures", "model_type", "layer_types")}
    rope = fields.get("rope_parameters")
    if isinstance(rope, dict):
        fields["rope_parameters"] = plain_rope(rope)
    fields.update(num_hidden_layers=1, vocab_size=target.vocab_size)
    if target_qkv_bias(target.model):
        fields["qkv_bias"] = True
    return LlamaConfig(**fields)


def save_head(head: DraftHead, folder: Path, target: str, dtype: torch.dtype = torch.float16,
              extra: dict[str, Any] | None = None, target_signature: dict[str, list] | None = None) -> None:
    """Write ``config.json`` (Llama keys + an ``mmspec`` block: kind, num_q, the target's name and
    :func:`~.target_identity.signature`) and ``model.safetensors`` in ``dtype``."""
    folder.mkdir(parents=True, exist_ok=True)
    config = head.config.to_dict()
    for key in ("architectures", "_attn_implementation_autoset", "dtype", "torch_dtype"):
        config.pop(key, None)
    signed = {} if target_signature is None else {"target_signature": target_signature}
    config["mmspec"] = {"kind": head.kind, "num_q": head.num_q, "target": target, **signed, **(extra or {})}
    save_weights(folder, head, dtype, config)


def save_weights(folder: Path, module: torch.nn.Module, dtype: torch.dtype, config: dict[str, Any]) -> None:
    """``model.safetensors`` (``module``'s tensors in ``dtype``) and ``config.json``, written together atomically
    (:func:`mmspec_cli.models.writing.write_atomically`: a failure leaves both files as they were)."""
    write_head_folder(folder, config, {k: v.detach().to("cpu", dtype) for k, v in module.state_dict().items()})
