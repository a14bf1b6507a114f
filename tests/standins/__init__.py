"""Stand-ins of the hub models the profiles name: each model's own published files, only its sizes shrunk, random
weights, laid out as a Hugging Face cache so that the profile's hub id loads through the same ``from_pretrained`` path.

``files/ORG/NAME/`` holds the files as published (copied byte for byte from public repositories that vendor them:
``SOURCES.md`` names each one's repository, path and commit); ``files/shared/qwen2/`` the Qwen tokenizer's
``vocab.json`` and ``merges.txt``, which every Qwen2.5/Qwen3 model publishes alike. :func:`build_hub_cache` writes,
for each :data:`STANDINS` entry, ``models--ORG--NAME/snapshots/standin/`` with those files, ``config.json`` shrunk by
:func:`shrink_config` (every key kept; only widths, depths and head counts changed, and the lists that index layers
rescaled to the new depth) and random weights (``model.safetensors``). Nothing else of a published file changes.

What no public repository holds is said per entry (``made``): a sibling model's files standing in for the model's
own, or a file written here.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

FILES = Path(__file__).parent / "files"
QWEN_TOKENIZER = ("shared/qwen2/vocab.json", "shared/qwen2/merges.txt")
REVISION = "standin"

#: the language model's sizes in a stand-in: head_dim 32, so that M-RoPE's sections scale by a whole factor
TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1}
HEAD_DIM = 32
#: a CLIP vision tower's (LLaVA) and a Qwen-VL vision tower's sizes
CLIP = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_hidden_layers": 2,
        "projection_dim": 32}
QWEN_VISION = {"hidden_size": 64, "intermediate_size": 128, "num_heads": 4}
QWEN_VISION_DEPTH = 8  # Qwen2.5-VL's window/full attention pattern ([7, 15, 23, 31] of 32) keeps its shape: [1, 3, 5, 7]


@dataclass(frozen=True)
class StandIn:
    """One hub repository's stand-in: its files (``folder`` under ``files/``, plus ``shared`` ones), the class that
    loads it (``image-text-to-text`` or ``causal-lm``), and what in it is not the model's own published file."""

    repo: str
    folder: str
    kind: str = "image-text-to-text"
    shared: tuple[str, ...] = ()
    made: str = ""
    near: str | None = None  # a draft: its weights are ``near``'s (built before it) plus noise, where shapes agree
    values: tuple[tuple[str, object], ...] = ()  # config values set here before shrinking (said in ``made``)


STANDINS = (
    StandIn("llava-hf/llava-1.5-7b-hf", "llava-hf/llava-1.5-7b-hf"),
    StandIn("mjbooo/lvlm68m", "mjbooo/lvlm68m", near="llava-hf/llava-1.5-7b-hf",
            made="no public copy of its files: config.json written here from llava-1.5-7b-hf's with vicuna-68m's "
                 "language model (2 layers); no processor files, so the target's processor is lent to it"),
    StandIn("double7/vicuna-68m", "double7/vicuna-68m", kind="causal-lm", near="llava-hf/llava-1.5-7b-hf",
            made="no public copy of its files: config.json written here from its hub page's values (2 layers, 768 "
                 "wide, 12 heads, bos 0, pad 1, 32,000 tokens); tokenizer.json is llava-1.5-7b-hf's LLaMA tokenizer "
                 "without LLaVA's two added tokens (<image>, <pad>), tokenizer_config.json likewise"),
    StandIn("Qwen/Qwen2.5-VL-7B-Instruct", "Qwen/Qwen2.5-VL-7B-Instruct", shared=QWEN_TOKENIZER),
    StandIn("Qwen/Qwen2.5-VL-3B-Instruct", "Qwen/Qwen2.5-VL-3B-Instruct", shared=QWEN_TOKENIZER,
            near="Qwen/Qwen2.5-VL-7B-Instruct"),
    StandIn("Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct", kind="causal-lm", shared=QWEN_TOKENIZER,
            near="Qwen/Qwen2.5-VL-7B-Instruct",
            values=(("vocab_size", 151936), ("tie_word_embeddings", True), ("max_position_embeddings", 32768),
                    ("max_window_layers", 21)),
            made="no public copy of its files: Qwen2.5-7B-Instruct's (the same family and tokenizer), with the "
                 "0.5B's own vocab_size 151936 (128 rows fewer than the 7B VL target's), tie_word_embeddings true, "
                 "max_position_embeddings and max_window_layers, from a re-saved copy of its config"),
    StandIn("JLKang/ViSpec-Qwen2.5-VL-7B-Instruct", "JLKang/ViSpec-Qwen2.5-VL-7B-Instruct", kind="vispec-head",
            near="Qwen/Qwen2.5-VL-7B-Instruct",
            made="config.json is ViSpec's own training config for this head (vispec/train/ in ViSpec's repository; "
                 "the hub's copy is in no public repository found); the weights follow the published 22-tensor "
                 "layout"),
    StandIn("Qwen/Qwen3-VL-8B-Instruct", "Qwen/Qwen3-VL-8B-Instruct", shared=QWEN_TOKENIZER,
            made="config.json is the 8B's (its max_position_embeddings 8192 looks edited by the repository that "
                 "vendors it); processor, template, tokenizer and generation files are Qwen3-VL-4B-Instruct's"),
    StandIn("Qwen/Qwen3-0.6B", "Qwen/Qwen3-0.6B", kind="causal-lm", shared=QWEN_TOKENIZER,
            near="Qwen/Qwen3-VL-8B-Instruct",
            made="no public copy of its files: Qwen3-4B's (the same family, tokenizer and template; tied in both)"),
    StandIn("Qwen/Qwen3-VL-2B-Instruct", "Qwen/Qwen3-VL-2B-Instruct", shared=QWEN_TOKENIZER,
            near="Qwen/Qwen3-VL-8B-Instruct",
            made="no public copy of its files: Qwen3-VL-4B-Instruct's (the same tokenizer, template and processor; "
                 "tie_word_embeddings true in both)"),
)


def _scaled_indexes(indexes: list[int], old_depth: int, new_depth: int) -> list[int]:
    """Layer indexes of a depth-``old_depth`` stack at the same relative places in a depth-``new_depth`` one."""
    return sorted({i * new_depth // old_depth for i in indexes})


def _shrink_rope(rope: dict | None, old_head_dim: int) -> None:
    if rope and "mrope_section" in rope:
        factor = old_head_dim // HEAD_DIM
        assert all(s % factor == 0 for s in rope["mrope_section"]), rope
        rope["mrope_section"] = [s // factor for s in rope["mrope_section"]]


def _shrink_text(text: dict, defaults: dict) -> int:
    """Shrink a language model's sizes in place (keys the file leaves to their defaults are set); its new width."""
    old = {**defaults, **text}
    old_head_dim = old.get("head_dim") or old["hidden_size"] // old["num_attention_heads"]
    text.update(TEXT)
    text["num_hidden_layers"] = min(old.get("num_hidden_layers", TEXT["num_hidden_layers"]), TEXT["num_hidden_layers"])
    if old.get("num_key_value_heads") == old["num_attention_heads"]:  # full multi-head attention stays so
        text["num_key_value_heads"] = TEXT["num_attention_heads"]
    if "head_dim" in old:
        text["head_dim"] = HEAD_DIM
    if "max_window_layers" in text:
        text["max_window_layers"] = min(text["max_window_layers"], TEXT["num_hidden_layers"])
    if isinstance(text.get("layer_types"), list):
        text["layer_types"] = text["layer_types"][:TEXT["num_hidden_layers"]]
    for key in ("rope_scaling", "rope_parameters"):
        _shrink_rope(text.get(key), old_head_dim)
    return TEXT["hidden_size"]


def _shrink_vision(vision: dict, width: int) -> None:
    if "depth" in vision:  # Qwen-VL's tower
        old_depth = vision["depth"]
        depth = QWEN_VISION_DEPTH if "fullatt_block_indexes" in vision else 4
        vision.update(QWEN_VISION, depth=depth, out_hidden_size=width)
        if "embed_dim" in vision:  # Qwen2-VL names its width so
            vision["embed_dim"] = QWEN_VISION["hidden_size"]
        for key in ("fullatt_block_indexes", "deepstack_visual_indexes"):
            if key in vision:
                vision[key] = _scaled_indexes(vision[key], old_depth, depth)
    else:  # CLIP / SigLIP
        vision.update(CLIP)


def shrink_config(config: dict) -> dict:
    """``config`` (a published ``config.json``) with its sizes shrunk: every key kept, the language model's and the
    vision tower's widths, depths and head counts made tiny, the layer lists (full-attention blocks, DeepStack taps)
    at the same relative depths, M-RoPE's sections scaled with the head dimension. Vocabulary sizes, token ids,
    patch and merge sizes, rope settings and tie settings stay as published."""
    config = json.loads(json.dumps(config))
    if "text_config" in config:
        text_type = config["text_config"].get("model_type", "llama")
        text_defaults = AutoConfig.for_model(text_type).to_dict()
        width = _shrink_text(config["text_config"], text_defaults)
    else:  # Qwen2-VL's and Qwen2.5-VL's flat layout, and a causal LM: the language model's keys at the top level
        width = _shrink_text(config, {})
    if "vision_config" in config:
        _shrink_vision(config["vision_config"], width)
    return config


NEAR_NOISE = 0.15  # a draft's relative noise around its target's weights: some drafts accepted, not all


def _plain_name(name: str) -> str:
    """A parameter's name with the language model's prefix of an image-text-to-text class taken off."""
    return name.replace("model.language_model.", "model.").replace("language_model.", "")


def _near(model: torch.nn.Module, target: torch.nn.Module) -> None:
    """``model``'s parameters set to ``target``'s of the same name plus noise, where the shapes agree (embedding
    rows: the rows both have)."""
    theirs = {_plain_name(n): p for n, p in target.named_parameters()}
    with torch.no_grad():
        for name, param in model.named_parameters():
            other = theirs.get(_plain_name(name))
            if other is None or other.shape[1:] != param.shape[1:]:
                continue
            rows = min(len(other), len(param))
            param[:rows] = other[:rows] + torch.randn_like(other[:rows]) * NEAR_NOISE * other.std().clamp_min(1e-3)


def _write_weights(snapshot: Path, kind: str, seed: int, near: torch.nn.Module | None) -> torch.nn.Module:
    """Random weights for the (shrunk) config in ``snapshot`` (``near``'s plus noise, for a draft), written as
    ``from_pretrained`` reads them: every layer of unit gain, embeddings and an untied head of unit entries (logits
    spread about 8 over the vocabulary: argmaxes far from ties). A tied model's head is its embedding, so it tends
    to repeat what it read, as random tied models do. Only the weights file
    is kept (``save_pretrained`` would rewrite the published config). The model, for the drafts near it."""
    config = AutoConfig.from_pretrained(snapshot)
    auto = AutoModelForCausalLM if kind == "causal-lm" else AutoModelForImageTextToText
    torch.manual_seed(seed)
    model = auto.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # weights of unit gain, so that what a model emits depends on what it reads
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(0.0, module.in_features ** -0.5)
            elif isinstance(module, torch.nn.Embedding):
                module.weight.normal_(0.0, 1.0)
        head = model.get_output_embeddings()
        if head.weight is not model.get_input_embeddings().weight:  # untied: logits of spread ~8 over the vocabulary
            head.weight.normal_(0.0, 1.0)
    if near is not None:
        _near(model, near)
    with tempfile.TemporaryDirectory() as scratch:
        model.save_pretrained(scratch)
        for file in Path(scratch).glob("model*.safetensors*"):
            shutil.copy(file, snapshot / file.name)
    return model


def _llama_tokenizer_without_llava_tokens(path: Path) -> None:
    """LLaVA-1.5's published ``tokenizer.json`` (the LLaMA tokenizer plus ``<image>`` 32000 and ``<pad>`` 32001)
    without its two added tokens: the tokenizer of a Vicuna, whose own file no public repository holds."""
    data = json.loads((FILES / "llava-hf/llava-1.5-7b-hf/tokenizer.json").read_text(encoding="utf-8"))
    data["added_tokens"] = [token for token in data["added_tokens"] if token["id"] < 32000]
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")


def vispec_qwen_shapes(h: int, i: int, heads: int, kv: int, vocab: int) -> dict[str, tuple[int, ...]]:
    """The 22 tensors of ViSpec's published Qwen2.5-VL draft head (``JLKang/ViSpec-Qwen2.5-VL-7B-Instruct``: the 17
    of a LLaVA vispec head plus q/k/v biases of its layer and its vision adaptor), for width ``h``, MLP ``i``,
    ``heads`` query and ``kv`` key/value heads and ``vocab`` rows."""
    d = h // heads
    return {
        "embed_tokens.weight": (vocab, h),
        "fc.weight": (h, 2 * h), "fc.bias": (h,),
        "img_fc.weight": (h, 2 * h), "img_fc.bias": (h,),
        "imadpt.q": (2, heads, d),
        "imadpt.k_proj.weight": (h, h), "imadpt.k_proj.bias": (h,),
        "imadpt.v_proj.weight": (h, h), "imadpt.v_proj.bias": (h,),
        "imadpt.o_proj.weight": (h, h),
        "layers.0.self_attn.q_proj.weight": (heads * d, h), "layers.0.self_attn.q_proj.bias": (heads * d,),
        "layers.0.self_attn.k_proj.weight": (kv * d, h), "layers.0.self_attn.k_proj.bias": (kv * d,),
        "layers.0.self_attn.v_proj.weight": (kv * d, h), "layers.0.self_attn.v_proj.bias": (kv * d,),
        "layers.0.self_attn.o_proj.weight": (h, heads * d),
        "layers.0.mlp.gate_proj.weight": (i, h), "layers.0.mlp.up_proj.weight": (i, h),
        "layers.0.mlp.down_proj.weight": (h, i),
        "layers.0.post_attention_layernorm.weight": (h,),
    }


def _write_vispec_head(snapshot: Path, seed: int, target: torch.nn.Module) -> None:
    """Random tensors of ViSpec's published Qwen2.5-VL layout for the head's (shrunk) config, its token embedding
    the target's (as ViSpec's heads carry their target's)."""
    from safetensors.torch import save_file

    config = json.loads((snapshot / "config.json").read_text())
    shapes = vispec_qwen_shapes(config["hidden_size"], config["intermediate_size"], config["num_attention_heads"],
                                config["num_key_value_heads"], config["vocab_size"])
    generator = torch.Generator().manual_seed(seed)
    weights = {key: 0.3 * torch.randn(shape, generator=generator) for key, shape in shapes.items()}
    weights["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().float().clone()
    weights["layers.0.post_attention_layernorm.weight"] += 1.0
    save_file(weights, str(snapshot / "model.safetensors"))


def _nears(repos: tuple[str, ...]) -> set[str]:
    return {s.near for s in STANDINS if s.repo in repos and s.near is not None}


def snapshot_of(cache: Path, repo: str) -> Path:
    return cache / f"models--{repo.replace('/', '--')}" / "snapshots" / REVISION


def build_hub_cache(cache: Path, repos: tuple[str, ...] | None = None) -> Path:
    """A Hugging Face cache at ``cache`` holding the stand-ins of ``repos`` (default: all), as ``hf download``
    leaves one; point ``HF_HUB_CACHE`` at it, with ``HF_HUB_OFFLINE=1``."""
    built: dict[str, torch.nn.Module] = {}
    for seed, standin in enumerate(STANDINS):
        if repos is not None and standin.repo not in repos and standin.repo not in _nears(repos):
            continue
        snapshot = snapshot_of(cache, standin.repo)
        snapshot.mkdir(parents=True, exist_ok=True)
        for file in (FILES / standin.folder).iterdir():
            shutil.copy(file, snapshot / file.name)
        for shared in standin.shared:
            shutil.copy(FILES / shared, snapshot / Path(shared).name)
        if standin.repo == "double7/vicuna-68m":
            _llama_tokenizer_without_llava_tokens(snapshot / "tokenizer.json")
        config = json.loads((FILES / standin.folder / "config.json").read_text())
        config.update(standin.values)
        (snapshot / "config.json").write_text(json.dumps(shrink_config(config), indent=2))
        if standin.kind == "vispec-head":
            _write_vispec_head(snapshot, seed, built[standin.near])
        else:
            built[standin.repo] = _write_weights(snapshot, standin.kind, seed, built.get(standin.near))
        refs = snapshot.parent.parent / "refs"
        refs.mkdir(exist_ok=True)
        (refs / "main").write_text(REVISION)
    return cache
