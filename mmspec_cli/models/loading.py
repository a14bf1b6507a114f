"""Loading target, draft (and later captioner) models with their processors.

A hub id and a local directory go through the same ``from_pretrained`` calls; tests save
tiny models with ``save_pretrained`` and load them back here. Nothing from a model
repository is executed unless its profile entry says ``trust_remote_code: true``.

Before any weights load, a device the machine lacks is refused (:func:`check_device`), a
folder holding no model (no ``config.json``) is refused naming what it lacks
(:func:`check_model_folder`), and a hub id is refused at once when the hub can't be reached and
the model is not in the local Hugging Face cache (:func:`_hub_source`), instead of after half a
minute of retries. A weights file that is cut short, empty or not a weights file at all is named
in one line (:func:`damaged_weights`), whichever error safetensors, torch or transformers raised.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import os
import sys
import threading
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

from mmspec_cli.errors import MmspecError, ModelLoadError
from mmspec_cli.models.families import family_of
from mmspec_cli.models.profiles import PACKAGE_DIR
from mmspec_cli.models.prompts import newline_token_id
from mmspec_cli.models.vocabulary import VocabularyMatch, match_vocabularies, speak_target_ids

HUB_PROBE_TIMEOUT_S = 2.0  # one HEAD request to the hub; DNS failures and refused connections answer far sooner
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
#: The files ``from_pretrained`` reads weights from (one file, or the shards an index names), as globs.
WEIGHT_GLOBS = ("model*.safetensors", "pytorch_model*.bin")


@dataclass
class LoadedModel:
    """A loaded image-text-to-text model with its processor; ``role`` is 'target' or 'draft'. A language-only draft
    (a causal language model: Gagrani et al.'s text-only drafting) has no processor, only ``text_tokenizer``."""

    role: str
    name: str
    model: Any
    processor: Any
    text_tokenizer: Any = None
    int8_threshold: float | None = None  # an 8-bit model's LLM.int8 outlier threshold (None: not 8-bit)

    @property
    def language_only(self) -> bool:
        """Whether this is a language model with no vision part (it drafts from the text alone)."""
        return self.processor is None

    @property
    def tokenizer(self):
        return self.text_tokenizer if self.language_only else self.processor.tokenizer

    @property
    def image_token_id(self) -> int | None:
        return None if self.language_only else image_token_id(self.processor, self.model.config)

    @property
    def image_placeholder_ids(self) -> tuple[int, ...]:
        """The token ids one image is in the prompt text before the processor expands it (its family's)."""
        return family_of(self.model).image_placeholder_ids(self.image_token_id)

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]


#: ``model: mmspec:NAME`` in a profile names a model shipped inside this package (the demo family).
SHIPPED_PREFIX = "mmspec:"


def shipped_models_dir() -> Path:
    """Where the models trained by ``scripts/train_demo.py`` are shipped: ``mmspec_cli/shipped/``."""
    return PACKAGE_DIR / "shipped"


def model_location(model: str) -> str:
    """What ``from_pretrained`` is given for a profile's ``model``: ``mmspec:NAME`` becomes the shipped folder.

    Everything else (hub ids, paths) passes through unchanged, so shipped, local and hub models
    all load through the same ``from_pretrained`` calls.
    """
    if model.startswith(SHIPPED_PREFIX):
        name = model[len(SHIPPED_PREFIX):]
        path = shipped_models_dir() / name
        if not name or not path.is_dir():
            raise ModelLoadError(f"'{model}' is not a model shipped with mmspec (looked in {path}); "
                                 f"shipped models: {', '.join(shipped_models()) or 'none'}")
        return str(path)
    return os.path.expanduser(model)


def shipped_models() -> list[str]:
    """``mmspec:NAME`` ids of the models shipped in the package, sorted."""
    folder = shipped_models_dir()
    if not folder.is_dir():
        return []
    return sorted(f"{SHIPPED_PREFIX}{p.name}" for p in folder.iterdir() if (p / "config.json").is_file())


def image_token_id(processor: Any, config: Any) -> int | None:
    """The id of the image placeholder token, from the config or the processor's tokenizer."""
    for attr in ("image_token_id", "image_token_index"):
        value = getattr(config, attr, None)
        if value is not None:
            return int(value)
    token = getattr(processor, "image_token", None)
    return None if token is None else processor.tokenizer.convert_tokens_to_ids(token)


def resolve_device(device: str) -> str:
    """'auto' means CUDA when present, else CPU."""
    if device != "auto":
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


def devices_here() -> list[str]:
    """The devices a profile may name on this machine: cpu, each CUDA GPU (cuda:0, ...), mps if present."""
    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    mps = getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
    return ["cpu", *(f"cuda:{i}" for i in range(cuda)), *(["mps"] if mps else [])]


def check_device(device: str, role: str) -> None:
    """Refuse ``{role}.device`` (already resolved from 'auto') if this machine lacks it, naming what it has.

    Without this, torch fails deep inside the load with "Torch not compiled with CUDA enabled" or
    "invalid device ordinal", which names neither the profile entry nor a fix.
    """
    here = devices_here()
    wanted = "cuda:0" if device == "cuda" else device
    if wanted in here:
        return
    raise ModelLoadError(f"{role}.device: {device} does not exist on this machine (devices here: {', '.join(here)}); "
                         f"set {role}.device to one of them, or to auto")


def check_beside(network: torch.nn.Module, what: str, target_module: torch.nn.Module, target_part: str,
                 loader: str) -> None:
    """Refuse a drafter's own ``network`` (a draft head, an imitation network) on another device than the
    ``target_module`` it runs beside: its first block would die deep in torch with a device error that names
    neither. ``loader`` names what puts it there (its loading function)."""
    mine, theirs = (next(module.parameters(), None) for module in (network, target_module))
    if mine is None or theirs is None:  # a module without weights runs wherever its input is
        return
    if mine.device != theirs.device:
        raise ValueError(f"the {what} is on {mine.device} and the target's {target_part} on {theirs.device}; move it "
                         f"there first (.to(device)), as {loader} does")


#: LLM.int8's outlier threshold for a target: 0, no outlier columns. bitsandbytes picks its outlier columns from every
#: row a call multiplies (``int8_vectorwise_quant``: the union over the rows, computed in floating point for all of
#: them), so a token verified beside others rounds differently from the same token run alone by ``generate``, and a
#: draft could change the target's output (measured with bitsandbytes 0.50.2 on the CPU: tests/test_quantization.py).
#: Without outlier columns every row is quantized on its own. A draft keeps bitsandbytes' default
#: (:data:`BITSANDBYTES_INT8_THRESHOLD`): its rounding changes what it proposes, never what the target emits.
TARGET_INT8_THRESHOLD = 0.0
#: bitsandbytes' own default (``BitsAndBytesConfig.llm_int8_threshold``): the 8-bit model a user's own
#: ``from_pretrained(..., load_in_8bit=True)`` and its ``generate`` run.
BITSANDBYTES_INT8_THRESHOLD = 6.0


def int8_threshold(spec: Any, role: str) -> float | None:
    """The LLM.int8 outlier threshold model ``spec`` (a profile's ModelSpec) loads with as ``role``: its
    ``quantization_threshold`` when set, else :data:`TARGET_INT8_THRESHOLD` for the target and bitsandbytes' default
    for a draft or captioner; None when it is not 8-bit."""
    if spec.quantization != "8bit":
        return None
    return spec.quantization_threshold if spec.quantization_threshold is not None else _default_threshold(role)


def _default_threshold(role: str) -> float:
    """An 8-bit model's outlier threshold where none is given: the target's and the other roles' (module doc)."""
    return TARGET_INT8_THRESHOLD if role == "target" else BITSANDBYTES_INT8_THRESHOLD


def coupled_rows_caveat(threshold: float | None, role: str) -> str | None:
    """The warning line for an 8-bit target loaded with outlier columns (a threshold above 0), or None."""
    if role != "target" or not threshold:
        return None
    return (f"warning: target.quantization_threshold {threshold:g}: LLM.int8 computes the outlier columns of all "
            f"the tokens one call verifies together, so a verified token can round apart from the target's own "
            f"generate, which decodes one at a time: ar gives its output, other drafters may not (a threshold of 0, "
            f"mmspec's default, keeps every token on its own)")


def _quantization_config(kind: str | None, dtype: torch.dtype, role: str, threshold: float | None = None):
    """bitsandbytes' config for ``kind``; ``threshold``: an 8-bit model's outlier threshold (None: ``role``'s
    default, :func:`int8_threshold`)."""
    if kind is None:
        return None
    try:
        import bitsandbytes  # noqa: F401  (imported lazily: it may fail on some machines)
    except Exception as exc:  # ImportError, or a setup error raised at import
        raise ModelLoadError(
            f"{role}.quantization: {kind} needs bitsandbytes, which could not be imported ({type(exc).__name__}); "
            f"install it with `pip install 'mmspec[quant]'` (it runs on CUDA and on the CPU), or set "
            f"{role}.quantization: null"
        ) from exc
    from transformers import BitsAndBytesConfig

    if kind == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True,
                                  llm_int8_threshold=_default_threshold(role) if threshold is None else threshold)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=dtype)


def rows_caveat(quantization: str | None, role: str, device: str) -> str | None:
    """The warning line for a 4-bit target on a GPU, or None.

    A speculative block verifies several tokens in one call, where the target's own ``generate`` decodes one at a time,
    so the output is the target's own only if each row of a call gets the bits it gets alone. On a GPU, bitsandbytes
    (0.50.2, measured on an H100 by ``MMSPEC_TEST_DEVICE=cuda pytest tests/test_quantization.py``) runs a 4-bit layer's
    one-row call in its gemv kernel and a call of several rows as a dequantized float matmul: rows differ in their last
    bits, so a near-tie can flip a token. 8 bits (without outlier columns, :data:`TARGET_INT8_THRESHOLD`) kept rows on
    their own there, and so does the CPU's 4-bit kernel. A draft's rounding never changes the output."""
    if quantization != "4bit" or role != "target" or not device.startswith("cuda"):  # measured on CUDA only
        return None
    return (f"warning: {role}.quantization: 4bit on {device}: bitsandbytes computes one token and several tokens "
            f"with different kernels, so a verified token's logits can differ in their last bits from the target's "
            f"own generate and a near-tie can change a token; quantization: 8bit keeps each token on its own")


def _fit_cpu_4bit_kernel(model: Any, role: str) -> None:
    """On an AVX512-BF16 CPU, bitsandbytes runs 4-bit layers in a packed kernel that takes only layers whose output
    size is a multiple of 32 and whose input size is one of 64 (its column and quantization blocks); any other aborts
    in it at the first forward. Those layers are switched to bitsandbytes' other CPU path (the layer's own
    ``support_avx512bf16_for_cpu``: the weights dequantized for a float matmul), with one warning line."""
    import bitsandbytes
    from bitsandbytes.functional import has_avx512bf16

    if not has_avx512bf16():
        return
    odd = [(name, module) for name, module in model.named_modules()
           if isinstance(module, bitsandbytes.nn.Linear4bit) and (module.out_features % 32 or module.in_features % 64)]
    for _, module in odd:
        module.support_avx512bf16_for_cpu = False
    if odd:
        name, module = odd[0]
        print(f"warning: {role}.quantization: 4bit: {len(odd)} of the {role}'s 4-bit layers (first {name}, "
              f"{module.in_features}->{module.out_features}) don't fit bitsandbytes' AVX512-BF16 kernel (outputs a "
              f"multiple of 32, inputs of 64); they dequantize their weights for each matmul instead, which is slower",
              file=sys.stderr)


def _is_local(model: str) -> bool:
    return os.path.isdir(os.path.expanduser(model))


def _hub_source(role: str, model: str, revision: str | None) -> str:
    """What ``from_pretrained`` loads ``model`` from, or a one-line refusal, decided before any download.

    A folder, or a hub id when the hub answers: itself. When the hub can't be reached
    (``HF_HUB_OFFLINE`` is set, or one quick probe of the endpoint fails), a model in the local
    Hugging Face cache loads from its snapshot folder there, so no request is made at all (not even
    the optional files transformers looks for, such as a PEFT adapter config, which it would retry
    for half a minute); any other is refused now, rather than after those retries.
    """
    if _is_local(model) or not _is_hub_id(model):
        return model
    offline = _offline()
    if not offline and hub_reachable():
        return model
    if _in_hub_cache(model, revision):
        from huggingface_hub import snapshot_download

        return snapshot_download(model, revision=revision, local_files_only=True)
    from huggingface_hub import constants

    why = ("HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set" if offline
           else f"the Hugging Face hub ({constants.ENDPOINT}) can't be reached")
    raise ModelLoadError(f"{role}.model: '{model}' is not in the local Hugging Face cache and {why}; "
                         f"download it where there is network (`hf download {model}`) and copy the cache here, "
                         f"or pass a local path saved with save_pretrained as {role}.model")


def hub_folder(role: str, model: str, revision: str | None, patterns: list[str]) -> str:
    """A folder holding ``model``'s files matching ``patterns``, for what ``from_pretrained`` doesn't load
    (draft heads): the same decision as :func:`_hub_source`, then the hub snapshot when it is a hub id."""
    source = _hub_source(role, model, revision)
    if _is_local(source):
        return source
    if not _is_hub_id(source):
        raise ModelLoadError(f"{role}.model: '{model}' is neither an existing directory nor a hub id; check the path")
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(source, revision=revision, allow_patterns=patterns)
    except Exception as exc:  # network, auth, missing repo: the hub's own first line
        raise ModelLoadError(f"{role}.model: could not download '{model}' ({_first_line(exc)}); "
                             f"download it where there is network, or pass a local folder") from None


def _is_hub_id(model: str) -> bool:
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(model)
    except ValueError:  # HFValidationError
        return False
    return True


def _offline() -> bool:
    """Offline mode as huggingface_hub sees it (read at its import), or as the environment says now."""
    from huggingface_hub import constants

    values = (os.environ.get(name, "").upper() for name in OFFLINE_VARIABLES)
    return bool(constants.HF_HUB_OFFLINE) or any(v in {"1", "ON", "YES", "TRUE"} for v in values)


def _in_hub_cache(model: str, revision: str | None) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(model, "config.json", revision=revision), str)


def hub_reachable(timeout: float = HUB_PROBE_TIMEOUT_S) -> bool:
    """Whether the hub endpoint answers one HEAD request within ``timeout`` seconds (DNS included: the request
    runs in a thread that is waited for no longer). Any answer below 500 counts, even an error status."""
    from huggingface_hub import constants

    answers: list[bool] = []

    def probe() -> None:
        try:
            urllib.request.urlopen(urllib.request.Request(constants.ENDPOINT, method="HEAD"), timeout=timeout).close()
            answers.append(True)
        except urllib.error.HTTPError as exc:  # the hub (or a proxy in front of it) answered
            answers.append(exc.code < 500)
        except (OSError, ValueError):  # no DNS, refused, unreachable, timed out (URLError is an OSError)
            answers.append(False)

    thread = threading.Thread(target=probe, name="mmspec-hub-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(answers) and answers[0]


def _unreachable_message(role: str, model: str, exc: Exception) -> str:
    if _is_local(model):
        return f"{role}.model: '{model}' is a directory but could not be loaded ({_first_line(exc)}); it should hold a model saved with save_pretrained"
    if os.sep in model and not model.count("/") == 1:
        return f"{role}.model: '{model}' is neither an existing directory nor a hub id; check the path"
    return (
        f"{role}.model: could not load '{model}' from the Hugging Face hub (no network, or not cached: {_first_line(exc)}); "
        f"download it where there is network, or pass a local path saved with save_pretrained as {role}.model"
    )


def check_model_folder(location: str, role: str, shown: str) -> None:
    """Refuse a folder that holds no model (no ``config.json``: an empty folder, or one of tokenizer files only),
    naming what it lacks, before transformers reads it as a config it does not know."""
    folder = Path(location)
    if not folder.is_dir() or (folder / "config.json").is_file():
        return
    if not any(folder.iterdir()):
        lacks = "the folder is empty"
    else:
        lacks = "it has no config.json" + ("" if _weight_files(folder) else
                                           " and no weights file (model.safetensors or pytorch_model.bin)")
    raise ModelLoadError(f"{role}.model: '{shown}' holds no model: {lacks}; "
                         f"name the folder a model was saved to with save_pretrained "
                         f"(config.json, model.safetensors and the processor's files), or a hub id")


def _weight_files(folder: Path) -> list[Path]:
    """The weights files in ``folder`` (:data:`WEIGHT_GLOBS`), safetensors first, as ``from_pretrained`` prefers."""
    return [path for pattern in WEIGHT_GLOBS for path in sorted(folder.glob(pattern)) if path.is_file()]


def folder_on_disk(source: str, revision: str | None) -> Path | None:
    """Where ``source``'s files are on this machine (``from_pretrained`` reads them there): the folder itself, or a
    hub id's snapshot in the local Hugging Face cache; None when neither is here."""
    if _is_local(source):
        return Path(os.path.expanduser(source))
    if not _is_hub_id(source):
        return None
    from huggingface_hub import try_to_load_from_cache

    config = try_to_load_from_cache(source, "config.json", revision=revision)
    return Path(config).parent if isinstance(config, str) else None


def damaged_weights(folder: Path | None) -> tuple[Path, str] | None:
    """The first weights file in ``folder`` that can't be read, and why (its reader's words); None when all can.

    Called when loading failed, so the cost of reading a ``.bin`` again does not matter; a safetensors file is
    only opened (its header checked against the file's size: a cut file fails here)."""
    for path in _weight_files(folder) if folder is not None else []:
        why = _unreadable(path)
        if why is not None:
            return path, why
    return None


def _unreadable(path: Path) -> str | None:
    """Why the weights file ``path`` can't be read, or None."""
    try:
        if path.stat().st_size == 0:
            return "it is empty"
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="pt"):
                return None
        mmap = zipfile.is_zipfile(path)  # torch's own format since 1.6; the legacy one is read whole
        torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:  # safetensors' SafetensorError, torch's RuntimeError, UnpicklingError, EOFError, ...
        return _first_line(exc).split(". ")[0].rstrip(".")  # torch's first sentence; its advice does not apply
    return None


def damaged_message(role: str, shown: str, local: bool, path: Path, why: str) -> str:
    """One line naming the damaged file and the fix: save (or copy) a ``local`` folder's model again, download a
    hub model's files again (they are in the Hugging Face cache)."""
    fix = ("save the model there again with save_pretrained, or copy or download it again" if local
           else f"download it again with `hf download {shown} --force-download`")
    return (f"{role}.model: the weights file {path} is damaged ({why}): it was cut short or is not a weights file; "
            f"{fix}")


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__


def load_model(spec: Any, role: str, multi_gpu_ok: bool = False, fallback_processor: Any = None) -> LoadedModel:
    """Load ``spec.model`` (hub id or directory) as an image-text-to-text model plus processor.

    ``spec`` carries model, dtype, device, quantization, trust_remote_code and revision
    (see ``profiles.ModelSpec``). With several GPUs and ``multi_gpu_ok`` the model is spread
    with ``device_map="auto"`` (accelerate). A model saved without processor files (tokenizer,
    image processor) uses ``fallback_processor`` when one is given: a draft then shares the
    target's, which is right when it was trained with the target's tokenizer and image
    processing, as TABED's LLaVA-1.5 drafts were.
    """
    name = model_location(spec.model)
    device = resolve_device(spec.device)
    check_device(device, role)
    check_model_folder(name, role, spec.model)
    local = _is_local(name)
    name = _hub_source(role, name, spec.revision)
    common = {"trust_remote_code": spec.trust_remote_code, "revision": spec.revision}
    try:
        config = AutoConfig.from_pretrained(name, **common)
    except OSError as exc:
        raise ModelLoadError(_unreachable_message(role, spec.model, exc)) from exc
    except ValueError as exc:
        raise ModelLoadError(f"{role}.model: '{spec.model}' has a config transformers does not know ({_first_line(exc)}); "
                             f"if it ships its own code and you trust it, set {role}.trust_remote_code: true") from exc
    language_only = role == "draft" and is_language_model(config.model_type)
    supported = transformers.models.auto.modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    if config.model_type not in supported and not language_only and not spec.trust_remote_code:
        also = " (a draft may also be a causal language model, such as Qwen/Qwen2.5-0.5B-Instruct)" \
            if role == "draft" else ""
        raise ModelLoadError(
            f"{role}.model: '{spec.model}' is a '{config.model_type}' model, not an image-text-to-text model; "
            f"use a LLaVA-family or Qwen-VL model such as llava-hf/llava-1.5-7b-hf or Qwen/Qwen2.5-VL-7B-Instruct"
            f"{also}"
        )
    dtype = getattr(torch, spec.dtype)  # one of choices.DTYPES, checked by the profile
    kwargs: dict[str, Any] = dict(common, dtype=dtype)
    threshold = int8_threshold(spec, role)
    quant = _quantization_config(spec.quantization, dtype, role, threshold)
    if quant is not None:
        kwargs.update(quantization_config=quant, device_map={"": 0} if device == "cuda" else device)
    elif multi_gpu_ok and device == "cuda" and torch.cuda.device_count() > 1:
        kwargs["device_map"] = "auto"
    try:
        if language_only:
            model = AutoModelForCausalLM.from_pretrained(name, **kwargs)
            processor, text_tokenizer = None, _load_tokenizer(name, common, role, spec.model)
        else:
            model = AutoModelForImageTextToText.from_pretrained(name, **kwargs)
            processor = _load_processor(name, common, role, spec.model, fallback_processor, config.model_type)
            text_tokenizer = None
    except torch.cuda.OutOfMemoryError as exc:
        raise ModelLoadError(
            f"CUDA ran out of memory loading the {role} model '{spec.model}'; set {role}.quantization: 4bit or 8bit, "
            f"or a smaller {role}.dtype (float16)"
        ) from exc
    except ImportError as exc:  # e.g. LLaVA-OneVision's processor needs torchvision for its video part
        raise ModelLoadError(f"{role}.model: '{spec.model}' needs a package that is not installed ({_first_line(exc)}); "
                             f"install it (often `pip install torchvision`) and try again") from exc
    except ModelLoadError:  # the processor's own refusals
        raise
    except Exception as exc:  # a damaged weights file raises what its reader raises: checked here, by reading it
        damaged = damaged_weights(folder_on_disk(name, spec.revision))
        if damaged is not None:
            raise ModelLoadError(damaged_message(role, spec.model, local, *damaged)) from exc
        if isinstance(exc, SafetensorError):  # safetensors' errors all mean a file it can't read
            raise ModelLoadError(f"{role}.model: '{spec.model}' has a weights file safetensors can't read "
                                 f"({_first_line(exc)}); download or save the model again") from exc
        if isinstance(exc, OSError):
            raise ModelLoadError(_unreachable_message(role, spec.model, exc)) from exc
        raise
    if spec.quantization == "4bit" and device == "cpu":
        _fit_cpu_4bit_kernel(model, role)
    for caveat in (rows_caveat(spec.quantization, role, device), coupled_rows_caveat(threshold, role)):
        if caveat is not None:
            print(caveat, file=sys.stderr)
    if not language_only:
        processor = with_pixel_bounds(processor, spec, role, fallback_processor)
    if "device_map" not in kwargs:
        model = model.to(device)
    model.eval()
    return LoadedModel(role=role, name=spec.model, model=model, processor=processor, text_tokenizer=text_tokenizer,
                       int8_threshold=threshold)


def is_language_model(model_type: str | None) -> bool:
    """Whether ``model_type`` is a causal language model with no vision part (a text-only draft can be one)."""
    auto = transformers.models.auto.modeling_auto
    return model_type in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and \
        model_type not in auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def _load_tokenizer(name: str, common: dict, role: str, shown: str) -> Any:
    try:
        return AutoTokenizer.from_pretrained(name, **common)
    except (OSError, ValueError, TypeError) as exc:
        raise ModelLoadError(f"{role}.model: '{shown}' has no usable tokenizer files ({_first_line(exc)}); save its "
                             f"tokenizer with save_pretrained next to the weights") from exc


def with_pixel_bounds(processor: Any, spec: Any, role: str, shared: Any = None) -> Any:
    """``processor`` with the profile's ``min_pixels``/``max_pixels`` as its image processor's bounds (a copy when it
    is ``shared``, the target's processor lent to a draft); unchanged when neither is set. Only a native-resolution
    image processor (Qwen-VL's ``smart_resize``: a pixel range, in multiples of patch x merge) has them; another one
    is refused in one line."""
    bounds = {"shortest_edge": getattr(spec, "min_pixels", None), "longest_edge": getattr(spec, "max_pixels", None)}
    if all(value is None for value in bounds.values()):
        return processor
    images = getattr(processor, "image_processor", None)
    size = getattr(images, "size", None)
    edge = (lambda key: size.get(key)) if isinstance(size, dict) else (lambda key: getattr(size, key, None))
    if images is None or not hasattr(images, "merge_size") or None in (edge("shortest_edge"), edge("longest_edge")):
        what = "no image processor" if images is None else \
            f"a {type(images).__name__}, which does not resize to a pixel range"
        raise ModelLoadError(f"{role}.min_pixels/max_pixels: '{spec.model}' has {what} (those keys are Qwen-VL's); "
                             f"remove them")
    bounds = {key: edge(key) if value is None else value for key, value in bounds.items()}
    if bounds["shortest_edge"] > bounds["longest_edge"]:
        raise ModelLoadError(f"{role}: min_pixels {bounds['shortest_edge']} is larger than max_pixels "
                             f"{bounds['longest_edge']} (one of them the model's default); set both")
    if processor is shared:
        processor, images = copy.copy(processor), copy.copy(images)
        processor.image_processor = images
    images.size = dataclasses.replace(size, **bounds) if dataclasses.is_dataclass(size) else {**size, **bounds}
    return processor


def _load_processor(name: str, common: dict, role: str, shown: str, fallback: Any, model_type: str) -> Any:
    try:
        return AutoProcessor.from_pretrained(name, **common)
    except (OSError, ValueError, TypeError) as exc:
        if fallback is not None:
            return fallback
        raise ModelLoadError(f"{role}.model: '{shown}' has no usable processor files (tokenizer and image processor: "
                             f"{_first_line(exc)}); save its processor with save_pretrained next to the weights") from exc
    except (ImportError, AttributeError) as exc:  # its video part needs torchvision (ImportError in 5.23,
        processor = _images_only_from_pretrained(name, common, model_type)  # an AttributeError in earlier 5.x)
        if processor is None:
            raise ModelLoadError(f"{role}.model: '{shown}' has a processor that could not be built "
                                 f"({_first_line(exc)}); if it names a missing package, install it "
                                 f"(often `pip install torchvision`) and try again") from exc
        return processor


def images_only_processor(cls: type, image_processor: Any, tokenizer: Any, **kwargs: Any) -> Any:
    """A ``cls`` processor (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA-OneVision) built from its image processor and
    tokenizer alone, with no video processor: it processes images and text exactly as the full one does.

    transformers 5.x builds these processors only with a video processor, and video processors need
    torchvision (transformers #43986, #48556). The subclass accepts ``video_processor=None`` through
    ``check_argument_for_proper_class``, the hook transformers gives processors for checking their parts;
    a video given to it fails in transformers with its own error. It can't be saved with ``save_pretrained``.
    """
    return _images_only_class(cls)(image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
                                   **kwargs)


@functools.cache
def _images_only_class(cls: type) -> type:
    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name == "video_processor" and argument is None:
            return None
        return cls.check_argument_for_proper_class(self, argument_name, argument)

    return type(cls.__name__, (cls,), {"check_argument_for_proper_class": check_argument_for_proper_class,
                                       "images_only": True, "__module__": __name__,
                                       "__doc__": f"{cls.__name__} without a video processor (no torchvision)."})


def _images_only_from_pretrained(name: str, common: dict, model_type: str) -> Any | None:
    """The model's processor without its video processor, from the same files; None when torchvision is present
    or the processor has no video part (then the ImportError had another cause)."""
    from transformers import AutoImageProcessor
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES
    from transformers.utils import is_torchvision_available

    class_name = PROCESSOR_MAPPING_NAMES.get(model_type)
    cls = getattr(transformers, class_name, None) if isinstance(class_name, str) else None
    if is_torchvision_available() or cls is None or "video_processor" not in cls.get_attributes():
        return None
    processor_dict, extra = cls.get_processor_dict(name, **common)
    parts = {"image_processor": AutoImageProcessor.from_pretrained(name, **common),
             "tokenizer": AutoTokenizer.from_pretrained(name, **common), "video_processor": None}
    if set(cls.get_attributes()) != set(parts):
        return None
    return _images_only_class(cls).from_args_and_dict([parts[a] for a in cls.get_attributes()], processor_dict,
                                                      **extra)


def check_compatible(target: LoadedModel, draft: LoadedModel) -> VocabularyMatch:
    """Refuse a target/draft pair whose tokenizers disagree (speculation compares token ids), in one line; the table
    from the target's ids to the draft's (:mod:`~mmspec_cli.models.vocabulary`: special tokens may differ). A draft
    that sees images must also write them as the target's image token does."""
    if not draft.language_only and target.image_token_id != draft.image_token_id:
        raise ModelLoadError(
            f"the target's image placeholder token id ({target.image_token_id}) differs from the draft's "
            f"({draft.image_token_id}); use a draft trained with the target's tokenizer"
        )
    tokenizer = draft.tokenizer
    substitute = tokenizer.unk_token_id if tokenizer.unk_token_id is not None else newline_token_id(tokenizer)
    match = match_vocabularies(target.tokenizer, tokenizer, target.vocab_size, _rows(draft.model), draft.name,
                               substitute)
    if match.moved and not draft.language_only:  # its own processor writes its prompt views in its own ids
        raise ModelLoadError(f"draft.model: '{draft.name}' writes {match.moved} special tokens at other ids than the "
                             f"target's tokenizer, and a vision-language draft tokenizes its image views itself; "
                             f"use a draft trained with the target's tokenizer")
    return match


def check_tokenizer_files(target: Any, draft: Any) -> None:
    """Refuse a draft whose tokenizer can't be mapped onto the target's (:func:`match_vocabularies`) from the two
    models' tokenizer and config files alone, before any weights load (``target``, ``draft``: profile specs). Where
    either can't be read without loading (a draft that borrows the target's processor, a model not on this machine
    and no hub), nothing is said here: :func:`check_compatible` checks the loaded pair."""
    sources = []
    for role, spec in (("target", target), ("draft", draft)):
        try:
            name = _hub_source(role, model_location(spec.model), spec.revision)
            common = {"trust_remote_code": spec.trust_remote_code, "revision": spec.revision}
            rows = AutoConfig.from_pretrained(name, **common).get_text_config().vocab_size
            sources.append((AutoTokenizer.from_pretrained(name, **common), int(rows)))
        except Exception:  # unreadable here: the loader says why, in its words, or the loaded pair is checked
            return
    (target_tokenizer, target_rows), (draft_tokenizer, draft_rows) = sources
    match_vocabularies(target_tokenizer, draft_tokenizer, target_rows, draft_rows, draft.model, substitute=0)


def pair_draft(target: LoadedModel, draft: LoadedModel) -> None:
    """Check ``draft`` against ``target`` (:func:`check_compatible`) and make it read and write the target's ids
    (once: a draft already paired is left as it is)."""
    speak_target_ids(draft.model, check_compatible(target, draft))


def _rows(model: Any) -> int:
    """The ids a model can both read and write: the smaller of its embedding's and its LM head's rows."""
    return min(model.get_input_embeddings().weight.shape[0], model.get_output_embeddings().weight.shape[0])


def model_type_on_disk(spec: Any) -> str | None:
    """The ``model_type`` of a profile's model (a :class:`~mmspec_cli.models.profiles.ModelSpec`) from a
    ``config.json`` already on this machine, without loading anything: a folder, ``mmspec:NAME``, or a hub id in
    the local cache. None where it would take a download (or the file can't be read: loading will say why)."""
    try:
        folder = folder_on_disk(model_location(spec.model), spec.revision)
        data = json.loads((folder / "config.json").read_text(encoding="utf-8")) if folder is not None else None
    except (MmspecError, OSError, ValueError):  # not there, not a hub id, not JSON: the loader says why in its words
        return None
    model_type = data.get("model_type") if isinstance(data, dict) else None
    return model_type if isinstance(model_type, str) else None
