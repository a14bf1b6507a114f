"""EAGLE-3 heads on disk: mmspec's layout written, and read with SpecForge's/SGLang's and the speculators format
(``shared/notes/eagle3-serving-and-pld-facts.md`` §A3, A5, A6, B, C, F); the engines' layer-id conventions. The
exports for the engines are :mod:`~mmspec_cli.models.eagle3_exports`'.

Choices made:

- **mmspec's layout** is SpecForge's (what SGLang and vLLM load as they are: ``architectures:
  ["LlamaForCausalLMEagle3"]``, ``model_type: "llama"``, Llama keys, ``draft_vocab_size``, ``target_hidden_size``,
  tensors ``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``) plus an ``mmspec`` block: ``kind``,
  ``layers`` (the target layers whose INPUTS are fused, mmspec's = vLLM's convention), ``target``,
  ``target_signature`` and what training adds (``target_layers`` and ``target_model_type``, when given, are read by
  the exports). M-RoPE is written as ``mrope_section`` (+ ``mrope_interleaved``: Qwen3-VL) inside
  ``rope_parameters``. ``embed_tokens`` is never written: it is the target's, copied at load. ``d2t`` (int64)
  and ``t2d`` (bool) keep their types whatever ``dtype`` the weights are saved in.
- **One reader** (:func:`to_mmspec`, pure) turns each of the three layouts into mmspec's: the speculators format
  (``speculators_config``; the layer's keys in ``transformer_layer_config``; tensors ``layers.0.*``) and
  SpecForge's (no ``mmspec`` block). Layer ids come from the ``mmspec`` block, else the top-level
  ``eagle_aux_hidden_state_layer_ids`` (vLLM's convention: mmspec's own), else SpecForge's/SGLang's nested
  ``eagle_config.eagle_aux_hidden_state_layer_ids`` (the OUTPUT of a layer: mmspec's id − 1, so + 1 here), else
  none: the default for the target (:func:`~mmspec_cli.models.eagle3.default_layers`). A head whose draft vocabulary
  is the target's whole vocabulary may lack ``d2t``/``t2d`` (identity); a ``t2d`` missing beside a ``d2t`` is
  rebuilt from it. Variants mmspec does not run are refused in one line naming the key (:data:`VARIANTS`).
- **Loading** (:func:`load_eagle3`) checks the head against the target (hidden size, vocabulary, the width of
  the fused features, the layers it reads), every tensor's shape, and refuses NaN weights; a head recorded for
  another target warns (:func:`~mmspec_cli.models.target_identity.warn_if_other_target`). The head comes back on
  the target's device and in its dtype, with its rotary frequencies kept in float32 as transformers keeps them.
- A head's folder, its weights and the refusal of non-finite ones are :mod:`~mmspec_cli.models.head_folders`',
  shared with the other heads (``head_files`` imports this module to load EAGLE-3 heads, so not the reverse).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from transformers import LlamaConfig

from mmspec_cli.choices import HEAD_KINDS
from mmspec_cli.errors import InputError, ModelLoadError
from mmspec_cli.models.eagle3 import KIND, Eagle3Head, default_layers, head_config
from mmspec_cli.models.head_folders import (CONFIG, WEIGHT_FILES, built_from_config, check_finite, check_head_config,
                                           head_dir, read_weights, with_article, write_head_folder)
from mmspec_cli.models.loading import LoadedModel
from mmspec_cli.models.prompts import shorten
from mmspec_cli.models.target_identity import warn_if_other_target

ARCHITECTURE = "LlamaForCausalLMEagle3"  # SpecForge's and SGLang's draft class; vLLM maps it to its Eagle3 Llama
WEIGHTS = WEIGHT_FILES[0]  # what mmspec writes
EMBEDDING = "embed_tokens.weight"  # the target's, never saved
RETRAIN = "mmspec train-head eagle3"
#: Keys of ``LlamaConfig.to_dict()`` that describe nothing of the layer (transformers' bookkeeping and defaults).
NOT_LAYER_KEYS = frozenset({"_name_or_path", "architectures", "model_type", "dtype", "torch_dtype", "id2label",
                            "label2id", "chunk_size_feed_forward", "is_encoder_decoder", "output_attentions",
                            "output_hidden_states", "problem_type", "return_dict", "transformers_version",
                            "mrope_section", "mrope_interleaved"})
#: The Llama keys a head's config.json holds for its layer (legacy rope keys read too).
LAYER_KEYS = frozenset(LlamaConfig().to_dict()) - NOT_LAYER_KEYS | {"rope_theta", "rope_scaling"}


@dataclass(frozen=True)
class Variant:
    """A config key of an EAGLE-3 variant mmspec does not run, refused when ``refused(value)``."""

    key: str
    what: str
    refused: Callable[[Any], bool] = bool


#: EAGLE-3 variants mmspec does not run (§A1, A2, B2, C): each refused in one line naming its key.
VARIANTS = (
    Variant("norm_before_residual", "the residual taken after hidden_norm"),
    Variant("norm_before_fc", "an RMSNorm over the fused features before fc"),
    Variant("fc_norm", "one RMSNorm per fused layer before fc"),
    Variant("use_aux_norm", "one RMSNorm per fused layer before fc"),
    Variant("norm_output", "the normed output fed to the next draft step"),
    Variant("attention_bias", "q/k/v/o biases"),
    Variant("mlp_bias", "MLP biases"),
    Variant("bias", "a bias on fc"),
    Variant("num_hidden_layers", "more than one decoder layer", lambda value: value not in (None, 1)),
    Variant("use_aux_hidden_state", "no fused target layers", lambda value: value is False),
)
#: Tensors of those variants, by prefix: refused even when the config does not say so.
VARIANT_TENSORS = {"input_norm.": "norm_before_fc", "fc_norm.": "fc_norm", "aux_norm": "fc_norm",
                   "layers.1.": "num_hidden_layers", "fc.bias": "bias"}


# --------------------------------------------------------------------------- layer ids


def vllm_ids(layers: Sequence[int]) -> list[int]:
    """vLLM's ``eagle_aux_hidden_state_layer_ids`` of mmspec's ``layers``: the same (id k = the hidden state after k
    layers, the input of layer k; §B6), also the speculators format's."""
    return [int(k) for k in layers]


def sglang_ids(layers: Sequence[int], shown: str = "the head") -> list[int]:
    """SGLang's (and SpecForge's) explicit ids of mmspec's ``layers``: the OUTPUT of layer k − 1, so k − 1 (§B6).
    The embeddings (mmspec's 0) have no SGLang id: refused."""
    if any(int(k) < 1 for k in layers):
        raise InputError(f"{shown} reads the input of target layer 0 (the embeddings), which SGLang can't name (its "
                         f"ids are layer outputs); export it --to vllm, or train a head reading layers >= 1")
    return [int(k) - 1 for k in layers]


def from_sglang_ids(ids: Sequence[int]) -> list[int]:
    """mmspec's layers of SGLang's (SpecForge's) explicit ids: each + 1."""
    return [int(k) + 1 for k in ids]


def engine_default(target_layers: int) -> tuple[int, int, int]:
    """The layers vLLM and SGLang read when a head names none: (2, L//2, L − 3), unclamped (§B6)."""
    return 2, target_layers // 2, target_layers - 3


# --------------------------------------------------------------------------- mmspec's layout


def written_config(layer: LlamaConfig, draft_vocab: int, target_hidden: int, meta: dict[str, Any]) -> dict[str, Any]:
    """mmspec's ``config.json`` of a head whose layer config is ``layer`` (:func:`~.eagle3.head_config`'s): its
    Llama keys, M-RoPE inside ``rope_parameters``, the EAGLE-3 keys and the ``mmspec`` block ``meta``."""
    fields = {k: v for k, v in layer.to_dict().items() if k in LAYER_KEYS and k not in ("rope_theta", "rope_scaling")}
    rope = dict(fields.get("rope_parameters") or {"rope_type": "default"})
    sections = getattr(layer, "mrope_section", None)
    if sections:
        rope["mrope_section"] = [int(s) for s in sections]
        if getattr(layer, "mrope_interleaved", False):
            rope["mrope_interleaved"] = True
    fields.update(rope_parameters=rope, num_hidden_layers=1, tie_word_embeddings=False, attention_bias=False,
                  mlp_bias=False)
    return {**fields, "architectures": [ARCHITECTURE], "model_type": "llama", "draft_vocab_size": int(draft_vocab),
            "target_hidden_size": int(target_hidden), "mmspec": meta}


def layer_config(config: dict[str, Any]) -> LlamaConfig:
    """The layer config of an mmspec-layout ``config`` (M-RoPE sections as :func:`~.eagle3.head_config` keeps them)."""
    fields = {k: v for k, v in config.items() if k in LAYER_KEYS}
    return head_config(SimpleNamespace(to_dict=lambda: fields), int(config["vocab_size"]))


def saved_tensors(head: Eagle3Head, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The head's tensors as saved: all but the embedding, floating ones in ``dtype``, ``d2t``/``t2d`` as they are."""
    return {k: (v.detach().to("cpu", dtype) if v.is_floating_point() else v.detach().to("cpu")).contiguous()
            for k, v in head.state_dict().items() if k != EMBEDDING}


def save_eagle3(head: Eagle3Head, folder: Path, target_name: str, dtype: torch.dtype = torch.float16,
                extra: dict[str, Any] | None = None, target_signature: dict[str, list] | None = None) -> None:
    """Write ``head`` in mmspec's layout: ``config.json`` (with the ``mmspec`` block: kind, layers, the target's name
    and :func:`~.target_identity.signature`, ``extra``) and ``model.safetensors``, together atomically."""
    signed = {} if target_signature is None else {"target_signature": target_signature}
    meta = {"kind": KIND, "layers": list(head.layers_read), "target": target_name, **signed, **(extra or {})}
    config = written_config(head.config, head.draft_vocab, head.target_hidden, meta)
    write_head_folder(Path(folder), config, saved_tensors(head, dtype))


# --------------------------------------------------------------------------- reading any layout




def read_folder(folder: Path, shown: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``config.json`` and the weights of a head folder, each refused in one line when missing or unreadable."""
    if not (folder / CONFIG).is_file():
        raise ModelLoadError(f"head {shown} has no {CONFIG}; an EAGLE-3 head folder holds {CONFIG} and {WEIGHTS} "
                             f"(as `{RETRAIN}` or SpecForge writes them)")
    try:
        raw = json.loads((folder / CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"head {shown}/{CONFIG} can't be read ({exc}); download or copy the head again") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"head {shown}/{CONFIG} holds no JSON object; it is not a draft head's config")
    check_head_config(raw, shown, f"name an EAGLE-3 head's folder (as `{RETRAIN}` or SpecForge writes it)")
    return raw, read_weights(folder, shown)


def other_kind(raw: dict[str, Any], tensors: dict[str, torch.Tensor]) -> str | None:
    """The kind of a head that is not an EAGLE-3 head (``eagle``, ``vispec``, or what its ``mmspec`` block says);
    None for an EAGLE-3 head of any of the three layouts."""
    meta = raw.get("mmspec")
    if isinstance(meta, dict) and meta.get("kind") not in (None, KIND):
        return str(meta["kind"])
    names = [str(name) for name in raw.get("architectures") or []]
    if ("speculators_config" in raw or "draft_vocab_size" in raw or any("Eagle3" in name for name in names)
            or (isinstance(meta, dict) and meta.get("kind") == KIND) or "d2t" in tensors
            or any(k.startswith("midlayer.") for k in tensors)):
        return None
    return "vispec" if any(k.startswith(("imadpt.", "img_fc.")) for k in tensors) else "eagle"


def check_variants(top: dict[str, Any], layer: dict[str, Any], tensors: dict[str, torch.Tensor], shown: str) -> None:
    """Refuse an EAGLE-3 variant mmspec does not run (:data:`VARIANTS`), naming its key."""
    nested = top.get("eagle_config") if isinstance(top.get("eagle_config"), dict) else {}
    speculators = "speculators_config" in top or "transformer_layer_config" in top
    for variant in VARIANTS:
        if variant.key == "norm_output" and not speculators:
            continue  # SpecForge's norm_output (default true) is the final norm before lm_head: standard EAGLE-3
        for where, fields in (("", top), ("", layer), ("eagle_config.", nested)):
            if variant.key in fields and variant.refused(fields[variant.key]):
                raise ModelLoadError(f"head {shown}: {where}{variant.key}: {json.dumps(fields[variant.key])} in its "
                                     f"{CONFIG} is an EAGLE-3 variant mmspec does not run ({variant.what}); use a "
                                     f"head trained without it (`{RETRAIN}`, or SpecForge's defaults)")
    for prefix, key in VARIANT_TENSORS.items():
        found = next((k for k in tensors if k.startswith(prefix)), None)
        if found is not None:
            what = next(v.what for v in VARIANTS if v.key == key)
            raise ModelLoadError(f"head {shown} holds {found}, the tensor of an EAGLE-3 variant mmspec does not run "
                                 f"({key}: {what}); use a head trained without it (`{RETRAIN}`, or SpecForge's "
                                 f"defaults)")


def _ids(value: Any, key: str, shown: str) -> list[int]:
    if not isinstance(value, list) or not value or not all(isinstance(k, int) and not isinstance(k, bool)
                                                            for k in value):
        raise ModelLoadError(f"head {shown}: {key} in its {CONFIG} is {shorten(json.dumps(value))}, not a list of "
                             f"layer numbers; fix or remove it (the target's default layers are then read)")
    return value


def layer_ids(raw: dict[str, Any], shown: str) -> list[int] | None:
    """The target layers (mmspec's convention) a head's config names, from whichever key its layout uses (module
    doc); None when it names none (the target's default)."""
    meta = raw.get("mmspec") if isinstance(raw.get("mmspec"), dict) else {}
    if meta.get("layers") is not None:
        return _ids(meta["layers"], "mmspec.layers", shown)
    # an engine's ids: vLLM and SGLang capture each listed layer once, as the decoder reaches it, so fc reads them
    # in ascending order whatever order the list has
    if raw.get("eagle_aux_hidden_state_layer_ids") is not None:
        return sorted(set(_ids(raw["eagle_aux_hidden_state_layer_ids"], "eagle_aux_hidden_state_layer_ids", shown)))
    nested = raw.get("eagle_config") if isinstance(raw.get("eagle_config"), dict) else {}
    if nested.get("eagle_aux_hidden_state_layer_ids") is not None:
        ids = _ids(nested["eagle_aux_hidden_state_layer_ids"], "eagle_config.eagle_aux_hidden_state_layer_ids", shown)
        return sorted(set(from_sglang_ids(ids)))
    return None


def _count(value: Any, key: str, shown: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ModelLoadError(f"head {shown}: {key} in its {CONFIG} is {shorten(json.dumps(value))}, not a positive "
                             f"integer; it is not an EAGLE-3 head's config")
    return value


def to_mmspec(raw: dict[str, Any], tensors: dict[str, torch.Tensor],
              shown: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A head's ``config.json`` and tensors in any of the three layouts, in mmspec's (pure; module doc). The
    ``mmspec`` block's ``layers`` is left out when the head names none."""
    speculators = "speculators_config" in raw or "transformer_layer_config" in raw
    layer = raw.get("transformer_layer_config") if speculators else raw
    if not isinstance(layer, dict):
        raise ModelLoadError(f"head {shown}: its {CONFIG} has a speculators_config but no transformer_layer_config "
                             f"object; it is not a speculators EAGLE-3 head")
    if speculators:
        algorithm = raw.get("speculators_model_type")
        if algorithm != KIND:
            raise ModelLoadError(f"head {shown} is a speculators {shorten(json.dumps(algorithm))} model, not an "
                                 f"EAGLE-3 one (speculators_model_type: eagle3); name an EAGLE-3 head")
        if layer.get("model_type", "llama") != "llama":
            raise ModelLoadError(f"head {shown}: transformer_layer_config.model_type is "
                                 f"{shorten(json.dumps(layer['model_type']))}; mmspec runs EAGLE-3 heads with a Llama "
                                 f"layer (model_type llama) only")
    check_variants(raw, layer, tensors, shown)
    renamed = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v
               for k, v in tensors.items() if k != EMBEDDING}
    vocab = layer.get("vocab_size", len(renamed["t2d"]) if "t2d" in renamed else None)
    vocab = _count(vocab, "vocab_size", shown)
    lm_rows = renamed["lm_head.weight"].shape[0] if "lm_head.weight" in renamed else vocab
    draft_vocab = _count(raw.get("draft_vocab_size", lm_rows), "draft_vocab_size", shown)
    hidden = _count(layer.get("hidden_size"), "hidden_size", shown)
    target_hidden = _count(raw.get("target_hidden_size") or hidden, "target_hidden_size", shown)
    renamed.update(draft_vocabulary(renamed, draft_vocab, vocab, shown))
    meta = dict(raw["mmspec"]) if isinstance(raw.get("mmspec"), dict) else {}
    meta.pop("exported_for", None)
    meta["kind"] = KIND
    layers = layer_ids(raw, shown)
    meta.pop("layers", None)
    if layers is not None:
        meta["layers"] = layers
    verifier = (raw.get("speculators_config") or {}).get("verifier") if speculators else None
    if not meta.get("target") and isinstance(verifier, dict) and isinstance(verifier.get("name_or_path"), str):
        meta["target"] = verifier["name_or_path"]
    with built_from_config(shown):
        config = written_config(layer_config({**layer, "vocab_size": vocab}), draft_vocab, target_hidden, meta)
    return config, renamed


def draft_vocabulary(tensors: dict[str, torch.Tensor], draft_vocab: int, vocab: int,
                     shown: str) -> dict[str, torch.Tensor]:
    """``d2t`` and ``t2d``: as stored; identity when the draft vocabulary is the whole vocabulary and they are
    absent; ``t2d`` rebuilt from ``d2t`` when only it is absent. Target ids outside the vocabulary are refused."""
    d2t, t2d = tensors.get("d2t"), tensors.get("t2d")
    if d2t is None:
        if draft_vocab != vocab:
            raise ModelLoadError(f"head {shown} drafts over {draft_vocab} of the target's {vocab} tokens but holds no "
                                 f"d2t (each draft id's target id); download it again or name a complete head")
        d2t = torch.zeros(draft_vocab, dtype=torch.long)
    if d2t.dtype.is_floating_point or d2t.dim() != 1 or len(d2t) != draft_vocab:
        raise ModelLoadError(f"head {shown}: d2t is {tuple(d2t.shape)} {d2t.dtype}, expected ({draft_vocab},) "
                             f"integers (draft_vocab_size); its weights and {CONFIG} are of different heads")
    ids = torch.arange(draft_vocab) + d2t.long()
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= vocab or len(set(ids.tolist())) != draft_vocab):
        raise ModelLoadError(f"head {shown}: d2t maps draft ids outside the target's {vocab} tokens, or two to one; "
                             f"its weights and {CONFIG} are of different heads: download it again")
    if t2d is None:
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
    return {"d2t": d2t.long(), "t2d": t2d.bool()}


# --------------------------------------------------------------------------- checks




def expected_shapes(config: dict[str, Any], layers: int) -> dict[str, tuple[int, ...]]:
    """The shape of every saved tensor of the head ``config`` (mmspec's layout) describes, reading ``layers`` target
    layers; built on the meta device, so nothing is allocated."""
    with torch.device("meta"):
        head = Eagle3Head(layer_config(config), range(layers), config["draft_vocab_size"], config["target_hidden_size"])
    return {k: tuple(v.shape) for k, v in head.state_dict().items() if k != EMBEDDING}


def check_tensors(config: dict[str, Any], tensors: dict[str, torch.Tensor], layers: int, shown: str) -> None:
    """Every tensor of the head present with its shape, and no other: one line naming the first fault."""
    with built_from_config(shown):
        wanted = expected_shapes(config, layers)
    missing = [k for k in wanted if k not in tensors]
    extra = [k for k in tensors if k not in wanted]
    if missing or extra:
        parts = ([f"missing {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}"] if missing else []) + \
                ([f"unexpected {', '.join(extra[:3])}{' ...' if len(extra) > 3 else ''}"] if extra else [])
        raise ModelLoadError(f"head {shown} doesn't have the tensors of an EAGLE-3 head ({len(wanted)} expected): "
                             f"{'; '.join(parts)}; download it again, or name a folder as `{RETRAIN}` or SpecForge "
                             f"writes it")
    for key, shape in wanted.items():
        if tuple(tensors[key].shape) != shape:
            hint = (f" (fc reads {layers} target layers of width {config['target_hidden_size']})"
                    if key == "fc.weight" else "")
            raise ModelLoadError(f"head {shown}: {key} has shape {tuple(tensors[key].shape)}, expected {shape} from "
                                 f"its {CONFIG}{hint}; its weights and {CONFIG} are of different heads: download it "
                                 f"again")


def target_layer_count(config: Any) -> int:
    """The number of decoder layers of a target (its config, or its language model's)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text.num_hidden_layers)


def check_fits(config: dict[str, Any], layers: Sequence[int], target: LoadedModel, shown: str) -> None:
    """Refuse a head whose shapes or layers are not the target's, in one line naming both."""
    text = target.model.config.get_text_config()
    have = {"hidden_size": config["hidden_size"], "vocab_size": config["vocab_size"],
            "target_hidden_size": config["target_hidden_size"]}
    wanted = {"hidden_size": int(text.hidden_size), "vocab_size": target.vocab_size,
              "target_hidden_size": int(text.hidden_size)}
    differ = [k for k in have if have[k] != wanted[k]]
    if differ:
        diff = ", ".join(f"{k} {have[k]} vs {wanted[k]}" for k in differ)
        raise ModelLoadError(f"head {shown} was trained for another target ({diff} in {shorten(target.name)}); "
                             f"train one for this target with `{RETRAIN}`")
    count = target_layer_count(target.model.config)
    outside = [k for k in layers if not 0 <= k < count]
    if outside:
        raise ModelLoadError(f"head {shown} reads the input of target layer {outside[0]}, but {shorten(target.name)} "
                             f"has layers 0 to {count - 1}; train one for this target with `{RETRAIN}`")


# --------------------------------------------------------------------------- loading


def load_eagle3(model: str, target: LoadedModel, revision: str | None = None) -> Eagle3Head:
    """Load an EAGLE-3 head (mmspec's layout, SpecForge's/SGLang's, or the speculators format) for ``target``: on
    its device and in its dtype, in eval mode, its embedding a copy of the target's input embedding."""
    shown = shorten(model)
    raw, tensors = read_folder(head_dir(model, revision), shown)
    kind = other_kind(raw, tensors)
    if kind is not None and kind not in HEAD_KINDS:
        raise ModelLoadError(f"head {shown}/{CONFIG} names kind {shorten(json.dumps(kind), 30)}, which is no head "
                             f"kind mmspec knows ({', '.join(HEAD_KINDS)}); name an EAGLE-3 head's folder (as "
                             f"`{RETRAIN}` writes it)")
    if kind is not None:
        raise ModelLoadError(f"head {shown} is {with_article(kind)} head, not an EAGLE-3 "
                             f"one; set its kind: {kind} in the profile, or name an EAGLE-3 head")
    config, tensors = to_mmspec(raw, tensors, shown)
    meta = config["mmspec"]
    layers = meta.get("layers") or list(default_layers(target_layer_count(target.model.config)))
    check_fits(config, layers, target, shown)
    check_tensors(config, tensors, len(layers), shown)
    check_finite(tensors, f"head {shown}", RETRAIN)
    warn_if_other_target("head", shown, meta.get("target"), meta.get("target_signature"), target.name, target.model,
                         RETRAIN)
    embedding = target.model.get_input_embeddings().weight.detach()
    if tuple(embedding.shape) != (config["vocab_size"], config["hidden_size"]):
        raise ModelLoadError(f"head {shown}: {shorten(target.name)}'s input embedding is {tuple(embedding.shape)}, "
                             f"not (vocab_size, hidden_size) = ({config['vocab_size']}, {config['hidden_size']}) as "
                             f"its LM head; mmspec copies it into EAGLE-3 heads, so it can't draft for this target")
    with built_from_config(shown):
        head = Eagle3Head(layer_config(config), layers, config["draft_vocab_size"], config["target_hidden_size"])
    # assign: the stored tensors and a copy of the target's embedding become the head's (cast below), no second copy
    head.load_state_dict({**tensors, EMBEDDING: embedding.clone()}, strict=True, assign=True)
    inv_freq = head.rotary.inv_freq
    lm_head = target.model.get_output_embeddings().weight
    head = head.to(device=lm_head.device, dtype=lm_head.dtype)
    head.rotary.inv_freq = inv_freq.to(lm_head.device)  # float32, as transformers keeps its rotary frequencies
    return head.eval()
