"""Profiles: YAML files that pin what a run uses (models, decoding settings, drafter).

A profile is read with a ``yaml.SafeLoader`` that refuses alias bombs (:class:`_ProfileLoader`)
and turned into frozen dataclasses by one small validator, :func:`_build`, which walks a
mapping against a dataclass. Every section is a dataclass whose fields carry a *check* in
their metadata (see :func:`_key`); the validator rejects unknown keys, missing required keys
and bad values, naming the key path (and quoting at most a short form of the value)::

    decoding.gamma: expected an integer between 1 and 64, got "five"
    decoding.gama: unknown key; known keys: gamma, max_new_tokens, temperature, ...

Adding a section means adding a dataclass and one ``_key(..., _section(NewSpec))`` field on
:class:`Profile`; nothing else changes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import yaml

from mmspec_cli.choices import (DTYPES, HEAD_KINDS, MAX_GAMMA, MAX_TREE_BUDGET, MAX_TREE_WIDTH, MEMBER_LETTERS, POLICIES,
                             TREE_SETTINGS, tree_conflict,
                                QUANTIZATIONS, SCHEDULES, TREE_KINDS, tree_kind)
from mmspec_cli.errors import InputError, ProfileError
from mmspec_cli.models.prompts import shorten

#: Profile used when ``--profile`` is not given: the shipped demo family (``profiles/demo.yaml``),
#: which runs offline on a CPU. ``None`` would make ``--profile`` required.
DEFAULT_PROFILE: str | None = "demo"

PROFILE_SUFFIXES = (".yaml", ".yml")

#: The largest seed: torch's ``manual_seed`` takes 0 to 2**64 - 1 (negative seeds are refused here anyway).
MAX_SEED = 2**64 - 1

#: The most values a profile may hold once its YAML aliases are expanded; a real profile holds a few dozen.
MAX_YAML_VALUES = 10_000

#: A check takes ``(value, key_path)`` and returns the (possibly normalised) value, or
#: raises :class:`ProfileError` (via :func:`_fail`).
Check = Callable[[Any, str], Any]


# --------------------------------------------------------------------------- messages


#: The most characters of a bad value an error message quotes.
SHOW_LIMIT = 80


def _show(value: Any, limit: int = SHOW_LIMIT) -> str:
    """Render a value as it appeared in YAML (strings quoted, ``null``/``true``/``false``), cut to ``limit`` characters.

    The text is built piece by piece and stops at the limit, so a huge, deeply nested or
    self-referencing value (what YAML aliases can build) is never serialised whole.
    """
    text = ""
    for piece in _pieces(value, limit):
        text += piece
        if len(text) > limit:
            return text[: limit - 3] + "..."
    return text


def _pieces(value: Any, limit: int) -> Iterator[str]:
    """JSON-like text of ``value``, lazily; every container yields a piece before descending into it."""
    if value is None:
        yield "null"
    elif isinstance(value, bool):
        yield "true" if value else "false"
    elif isinstance(value, int):  # str() of an int past ~4300 digits raises: say how long it is instead
        digits = int(value.bit_length() * 0.30103)  # log10(2)
        yield repr(value) if digits < 300 else f"an integer of about {digits} digits"
    elif isinstance(value, float):
        yield repr(value)
    elif isinstance(value, Mapping):
        yield "{"
        for i, (key, item) in enumerate(value.items()):
            yield ", " if i else ""
            yield json.dumps(str(key)[:limit], ensure_ascii=False) + ": "
            yield from _pieces(item, limit)
        yield "}"
    elif isinstance(value, (list, tuple)):
        yield "["
        for i, item in enumerate(value):
            yield ", " if i else ""
            yield from _pieces(item, limit)
        yield "]"
    else:
        text = value if isinstance(value, str) else str(value)
        yield json.dumps(text[: limit + 1], ensure_ascii=False)


def _fail(path: str, expected: str, value: Any) -> None:
    """Raise the standard one-line error for a bad value at ``path``."""
    raise ProfileError(f"{path}: expected {expected}, got {_show(value)}")


def _join(path: str, key: Any) -> str:
    key = str(key) if len(str(key)) <= 40 else str(key)[:37] + "..."  # a key is quoted in messages: keep it short
    return f"{path}.{key}" if path else key


# --------------------------------------------------------------------------- checks


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _range_text(kind: str, lo: float | None, hi: float | None) -> str:
    if lo is not None and hi is not None:
        return f"{kind} between {lo} and {hi}"
    if lo is not None:
        return f"{kind} >= {lo}"
    return kind


def _integer(lo: int | None = None, hi: int | None = None) -> Check:
    """An int (never a bool) in ``[lo, hi]``."""
    expected = _range_text("an integer", lo, hi)

    def check(value: Any, path: str) -> int:
        if not _is_int(value) or (lo is not None and value < lo) or (hi is not None and value > hi):
            _fail(path, expected, value)
        return value

    return check


def _number(expected: str, ok: Callable[[float], bool]) -> Check:
    """A finite int or float (never a bool) for which ``ok`` holds; returned as float."""

    def check(value: Any, path: str) -> float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            _fail(path, expected, value)
        try:
            number = float(value)
        except OverflowError:  # an int past the largest float
            _fail(path, expected, value)
        if not math.isfinite(number) or not ok(number):
            _fail(path, expected, value)
        return number

    return check


def _string(value: Any, path: str) -> str:
    """A non-empty string."""
    if not isinstance(value, str) or not value.strip():
        _fail(path, "a non-empty string", value)
    return value


def _boolean(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        _fail(path, "true or false", value)
    return value


def _choice(*options: str | None) -> Check:
    """One of ``options`` (``None`` allowed if listed; shown as ``null`` for a YAML key, and not shown for a flag
    such as ``--tree``, which can't be given null)."""
    in_yaml = "one of " + ", ".join("null" if o is None else o for o in options)
    as_flag = "one of " + ", ".join(o for o in options if o is not None)

    def check(value: Any, path: str) -> Any:
        if not (value is None or isinstance(value, str)) or value not in options:
            _fail(path, as_flag if path.startswith("--") else in_yaml, value)
        return value

    return check


def _matches(pattern: str, expected: str) -> Check:
    """A string fully matching the regular expression ``pattern``."""
    regex = re.compile(pattern)

    def check(value: Any, path: str) -> str:
        if not isinstance(value, str) or not regex.fullmatch(value):
            _fail(path, expected, value)
        return value

    return check


def _optional(check: Check) -> Check:
    """``None`` or whatever ``check`` accepts."""
    return lambda value, path: None if value is None else check(value, path)


def _section(cls: type, optional: bool = False) -> Check:
    """A nested mapping validated against dataclass ``cls``.

    ``null`` (or an empty ``key:`` in YAML) gives ``None`` if ``optional``, else ``cls()``.
    """

    def check(value: Any, path: str) -> Any:
        if value is None:
            return None if optional else _build(cls, {}, path)
        return _build(cls, value, path)

    return check


def _key(check: Check, default: Any = dataclasses.MISSING, *, factory: Any = dataclasses.MISSING) -> Any:
    """Declare a dataclass field that is a profile key, validated by ``check``.

    Without ``default``/``factory`` the key is required.
    """
    return field(default=default, default_factory=factory, metadata={"check": check})


def _keys(cls: type) -> list[dataclasses.Field]:
    """The fields of ``cls`` that are profile keys (those declared with :func:`_key`)."""
    return [f for f in dataclasses.fields(cls) if "check" in f.metadata]


# --------------------------------------------------------------------------- validator


def _build(cls: type, data: Any, path: str = "", **extra: Any) -> Any:
    """Validate mapping ``data`` against dataclass ``cls`` and construct it.

    ``path`` is the key path of ``data`` (``""`` at the top level); ``extra`` fills fields
    that are not profile keys (e.g. ``Profile.name``).
    """
    fields = _keys(cls)
    if not isinstance(data, Mapping):
        names = ", ".join(f.name for f in fields)
        _fail(path or "profile", f"a mapping with keys {names}", data)
    known = {f.name for f in fields}
    for key in data:
        if key not in known:
            raise ProfileError(
                f"{_join(path, key)}: unknown key; known keys: {', '.join(f.name for f in fields)}"
            )
    values = dict(extra)
    for f in fields:
        key_path = _join(path, f.name)
        if f.name in data:
            values[f.name] = f.metadata["check"](data[f.name], key_path)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            where = f'under "{path}"' if path else "at the top level"
            raise ProfileError(f'{key_path}: required key is missing; add "{f.name}:" {where}')
    try:
        return cls(**values)
    except ProfileError as exc:  # a check across a section's keys (__post_init__): named from the section
        if path and not str(exc).startswith(path):
            raise ProfileError(f"{path}.{exc}") from None
        raise


# --------------------------------------------------------------------------- sections

@dataclass(frozen=True)
class ModelSpec:
    """A model to load: hub id or local path, plus how to load it."""

    model: str = _key(_string)
    dtype: str = _key(_choice(*DTYPES), "float16")
    device: str = _key(_matches(r"auto|cpu|cuda(:\d+)?|mps", "one of auto, cpu, cuda, cuda:N, mps"), "auto")
    quantization: str | None = _key(_choice(*QUANTIZATIONS), None)
    #: LLM.int8's outlier threshold of an 8-bit model (bitsandbytes' ``llm_int8_threshold``); unset: mmspec's for
    #: the role, 0 for a target (no outlier columns: every verified token rounds on its own) and bitsandbytes'
    #: 6.0 for a draft or captioner (``models/loading.int8_threshold``)
    quantization_threshold: float | None = _key(_optional(_number("a number >= 0", lambda x: x >= 0)), None)
    trust_remote_code: bool = _key(_boolean, False)
    revision: str | None = _key(_optional(_string), None)
    #: a Qwen-VL image processor's pixel bounds (``smart_resize``: each image is scaled, keeping its aspect, to
    #: between min_pixels and max_pixels, in multiples of patch x merge); unset: the model's own defaults
    min_pixels: int | None = _key(_optional(_integer(1)), None)
    max_pixels: int | None = _key(_optional(_integer(1)), None)

    def __post_init__(self) -> None:
        if self.quantization_threshold is not None and self.quantization != "8bit":
            raise ProfileError(f"quantization_threshold is LLM.int8's outlier threshold, for quantization: 8bit, and "
                               f"this model's quantization is {self.quantization or 'null'}; set quantization: 8bit, "
                               f"or drop quantization_threshold")
        if self.min_pixels is not None and self.max_pixels is not None and self.min_pixels > self.max_pixels:
            raise ProfileError(f"min_pixels ({self.min_pixels}) is larger than max_pixels ({self.max_pixels}); "
                               f"set min_pixels to at most max_pixels")


def _seed(value: Any, path: str) -> int:
    """An integer torch's ``manual_seed`` takes: 0 to 2**64 - 1 (it would remap a negative one; refused here)."""
    value = _integer(0)(value, path)
    if value > MAX_SEED:
        _fail(path, f"an integer between 0 and {MAX_SEED} (the range torch's manual_seed takes)", value)
    return value


@dataclass(frozen=True)
class DecodingSpec:
    """Decoding settings shared by all drafters."""

    gamma: int = _key(_integer(1, MAX_GAMMA), 5)
    max_new_tokens: int = _key(_integer(1), 128)
    temperature: float = _key(_number("a number >= 0", lambda x: x >= 0), 0.0)
    top_p: float | None = _key(_optional(_number("a number in (0, 1]", lambda x: 0 < x <= 1)), None)
    top_k: int | None = _key(_optional(_integer(1)), None)
    seed: int | None = _key(_optional(_seed), None)
    gamma_schedule: str = _key(_choice(*SCHEDULES), "constant")  # schedules.py: constant | heuristic | fastvlm | cost
    tree_width: int = _key(_integer(1, MAX_TREE_WIDTH), 1)  # token trees: branches per block (1 = a plain chain)
    tree: str | None = _key(_choice(None, *TREE_KINDS), None)  # null: width when tree_width > 1, else chain
    tree_budget: int = _key(_integer(2, MAX_TREE_BUDGET), 30)  # dynamic trees (EAGLE-2; ViSpec's 30, 3, 8)
    tree_depth: int = _key(_integer(1, MAX_GAMMA - 1), 3)
    tree_topk: int = _key(_integer(1, 64), 8)
    # CTRL's repetition penalty on the target's logits, as its generate applies it; null: the value of the target's
    # generation_config.json (Qwen2-VL's and Qwen2.5-VL's 1.05), 1.0: none
    repetition_penalty: float | None = _key(_optional(_number("a number > 0", lambda x: x > 0)), None)
    # the static KV state and compiled steps (decoding/compiled.py); off by default: on this CPU the demo
    # family's compile time outweighs the gain over a run of a few thousand tokens (docs/BENCHMARKS.md)
    compile: bool = _key(_boolean, False)


def _members(value: Any, path: str) -> tuple[str, ...]:
    """A list of distinct drafting letters (m, t, c, p), at least two."""
    expected = "a list of at least two distinct letters from m, t, c, p (e.g. [m, t])"
    if not isinstance(value, list) or len(value) < 2 or not all(isinstance(v, str) for v in value):
        _fail(path, expected, value)  # checked before the set below: a nested list is unhashable
    if len(set(value)) != len(value) or any(v not in MEMBER_LETTERS for v in value):
        _fail(path, expected, value)
    return tuple(value)


def _window(value: Any, path: str) -> int | None:
    """``all`` (None) or an integer h >= 1, the last h verified positions."""
    if value is None or value == "all":
        return None
    if not _is_int(value) or value < 1:
        _fail(path, 'an integer >= 1 or "all"', value)
    return value


@dataclass(frozen=True)
class EnsembleSpec:
    """TABED ensemble settings (TABED §5.1, App. B); used by ``tabed`` and static ensembles."""

    members: tuple[str, ...] = _key(_members, ("m", "t"))
    policy: str = _key(_choice(*POLICIES), "grid")
    distance: str = _key(_choice("kl", "tvd"), "kl")
    labels: str = _key(_choice("soft", "hard"), "soft")
    window: int | None = _key(_window, None)
    grid_steps: int = _key(_integer(1), 10)
    tau: float = _key(_number("a number > 0", lambda x: x > 0), 1.0)
    adaboost_c: float = _key(_number("a number >= 0", lambda x: x >= 0), 1.0)


@dataclass(frozen=True)
class CaptionerSpec(ModelSpec):
    """The captioning model for caption drafting (``c``): a ModelSpec plus how to prompt it."""

    prompt: str | None = _key(_optional(_string), None)
    max_new_tokens: int = _key(_integer(1), 32)


@dataclass(frozen=True)
class PoolingSpec:
    """Pooled drafting (``p``): the side of the 2-D average-pooling kernel (2: 576 -> 144 tokens)."""

    kernel: int = _key(_integer(1, 16), 2)


@dataclass(frozen=True)
class SsdSpec:
    """Self-speculative drafting (``ssd``, FastVLM): how many of the target's first decoder layers draft, and the
    imitation network (folder, hub id or ``mmspec:NAME``) trained to follow that layer, if any."""

    layer: int | None = _key(_optional(_integer(1)), None)  # in [1, L-1]; checked against the model when it loads
    imitation: str | None = _key(_optional(_string), None)  # FastVLM's imitation network after that layer

    def __post_init__(self) -> None:
        if self.imitation is not None and self.layer is None:
            raise ProfileError(f"ssd.imitation names an imitation network ({shorten(self.imitation)}) but ssd.layer "
                               f"is not set; set ssd.layer to the layer it was trained for")


@dataclass(frozen=True)
class HeadSpec:
    """A trained draft head (``eagle``, ``vispec``): folder, hub id or ``mmspec:NAME``; its kind and ViSpec's num_q.

    ``kind`` and ``num_q`` may be left out: the checkpoint says them (its ``mmspec`` block, or its tensors).
    """

    model: str = _key(_string)
    kind: str | None = _key(_choice(None, *HEAD_KINDS), None)
    num_q: int | None = _key(_optional(_integer(2, 64)), None)
    revision: str | None = _key(_optional(_string), None)


def _heads(value: Any, path: str) -> tuple[HeadSpec, ...]:
    """``head:`` is one head ({model, kind, num_q}) or a list of them, at most one per kind."""
    items = value if isinstance(value, list) else [value]
    heads = tuple(_build(HeadSpec, item, f"{path}[{i}]" if isinstance(value, list) else path)
                  for i, item in enumerate(items))
    kinds = [h.kind for h in heads]
    if len(heads) > 1 and (None in kinds or len(set(kinds)) != len(kinds)):
        _fail(path, "one head, or a list with one head per kind, each with its kind: (eagle, vispec, eagle3)", value)
    return heads


@dataclass(frozen=True)
class Profile:
    """A validated profile. ``name``/``source`` say where it came from; the rest are keys."""

    name: str
    source: str
    target: ModelSpec = _key(_section(ModelSpec))
    draft: ModelSpec | None = _key(_section(ModelSpec, optional=True), None)
    decoding: DecodingSpec = _key(_section(DecodingSpec), factory=DecodingSpec)
    drafter: str = _key(_string, "m")
    ensemble: EnsembleSpec = _key(_section(EnsembleSpec), factory=EnsembleSpec)
    captioner: CaptionerSpec | None = _key(_section(CaptionerSpec, optional=True), None)
    pooling: PoolingSpec = _key(_section(PoolingSpec), factory=PoolingSpec)
    ssd: SsdSpec = _key(_section(SsdSpec), factory=SsdSpec)
    head: tuple[HeadSpec, ...] = _key(lambda v, p: () if v is None else _heads(v, p), ())


# --------------------------------------------------------------------------- public API


#: mmspec's own package folder (``mmspec_cli/``): the built-in profiles and the shipped models live under it.
PACKAGE_DIR = Path(__file__).resolve().parents[1]


def builtin_profiles_dir() -> Path:
    """Directory of the built-in profiles.

    ``mmspec_cli/profiles/`` in a wheel install, else ``<repo root>/profiles`` (editable
    installs and checkouts).
    """
    packaged = PACKAGE_DIR / "profiles"
    return packaged if packaged.is_dir() else PACKAGE_DIR.parent / "profiles"


def list_profiles() -> list[str]:
    """Names of the built-in profiles, sorted."""
    folder = builtin_profiles_dir()
    if not folder.is_dir():
        return []
    return sorted({p.stem for p in folder.iterdir() if p.suffix in PROFILE_SUFFIXES and p.is_file()})


def _available() -> str:
    names = list_profiles()
    return f"built-in profiles: {', '.join(names)}" if names else "no built-in profiles found"


def _looks_like_path(value: str) -> bool:
    """A value is a path if it has a YAML suffix or a separator, or names an existing file.

    A regular file is read, and so is a named pipe, once: a FIFO, or the ``/dev/fd/63`` of a shell's process
    substitution (``--profile <(sed ... demo.yaml)``).
    """
    separators = {"/", os.sep, os.altsep} - {None}
    return (
        value.lower().endswith(PROFILE_SUFFIXES)
        or any(sep in value for sep in separators)
        or _readable_kind(Path(value))
    )


def _readable_kind(path: Path) -> bool:
    """A regular file or a named pipe (a FIFO, or a shell's ``<(...)``); not a folder, and not a device such as
    ``/dev/zero`` that would never end."""
    try:
        mode = path.stat().st_mode
    except (OSError, ValueError):
        return False
    return stat.S_ISREG(mode) or stat.S_ISFIFO(mode)


def _resolve(name_or_path: str) -> Path:
    """Turn a ``--profile`` value into the file to read, or raise :class:`ProfileError`."""
    if _looks_like_path(name_or_path):
        path = Path(name_or_path).expanduser()
        if not path.exists():
            raise ProfileError(
                f"profile file {name_or_path} doesn't exist; pass an existing YAML file or a "
                f"built-in name ({_available()})"
            )
        if not _readable_kind(path):
            what = "not a file but a folder" if path.is_dir() else "not a file or a pipe"
            raise ProfileError(f"profile {name_or_path} is {what}; pass a YAML file")
        return path  # a file, or a pipe: `--profile <(...)` (/dev/fd/63) is read like a file
    for suffix in PROFILE_SUFFIXES:
        path = builtin_profiles_dir() / f"{name_or_path}{suffix}"
        if path.is_file():
            return path
    raise ProfileError(
        f'unknown profile "{name_or_path}"; pass a built-in name or a YAML file path ({_available()})'
    )


class _AliasBomb(Exception):
    """A YAML document whose aliases expand past :data:`MAX_YAML_VALUES` values or contain themselves."""


class _ProfileLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses pathological alias expansion before building anything.

    Composing a document keeps each alias as a reference to its anchor's node, so a
    "billion laughs" file composes into a few dozen nodes; only what is built from them (and
    any message that prints them) would be exponential. The node graph is measured first.
    """

    def construct_document(self, node: yaml.Node) -> Any:
        _expanded_size(node, {}, set())
        return super().construct_document(node)


def _expanded_size(node: yaml.Node, sizes: dict[int, int], open_nodes: set[int]) -> int:
    """How many values ``node`` stands for with every alias written out; stops past :data:`MAX_YAML_VALUES`.

    ``sizes`` memoises shared nodes (so the walk is linear in the file); ``open_nodes`` are the
    nodes being measured, one of which met again is an alias inside its own anchor.
    """
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_nodes:
        raise _AliasBomb("has an alias inside its own anchor (a value that contains itself)")
    open_nodes.add(key)
    if isinstance(node, yaml.MappingNode):
        children = [child for pair in node.value for child in pair]
    else:
        children = node.value if isinstance(node, yaml.SequenceNode) else []
    total = 1
    for child in children:
        total += _expanded_size(child, sizes, open_nodes)
        if total > MAX_YAML_VALUES:
            raise _AliasBomb(f"expands, through its aliases, to more than {MAX_YAML_VALUES:,} values "
                             f"(a \"billion laughs\" bomb?)")
    open_nodes.discard(key)
    sizes[key] = total
    return total


def _read_yaml(path: Path) -> Any:
    """Load a profile file safely, turning every way that fails into a one-line ProfileError."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ProfileError(f"can't read profile {path}: {exc}; pass a readable UTF-8 YAML file") from None
    try:
        return yaml.load(text, Loader=_ProfileLoader)  # noqa: S506 - a SafeLoader subclass
    except _AliasBomb as exc:
        raise ProfileError(f"profile {path} {exc}; a profile holds a few dozen values, so write them out "
                           f"without nesting aliases") from None
    except RecursionError:
        raise ProfileError(f"profile {path} is nested too deeply to read; a profile is a few levels deep") from None
    except ValueError as exc:  # a scalar YAML can't build, e.g. an integer of more than 4300 digits
        raise ProfileError(f"profile {path} holds a value that can't be read ({shorten(str(exc))}); "
                           f"fix or remove that value") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        problem = " ".join(str(problem).split())
        raise ProfileError(f"profile {path} is not valid YAML{where}: {problem}; fix the syntax there") from None


def profile_from_dict(data: Any, name: str = "<dict>", source: str = "<dict>") -> Profile:
    """Validate plain data (as from ``yaml.safe_load``) into a :class:`Profile`."""
    return _build(Profile, data, name=name, source=source)


def load_profile(name_or_path: str | None) -> Profile:
    """Load a profile by built-in name or by file path (``None``: :data:`DEFAULT_PROFILE`)."""
    if name_or_path is None:
        name_or_path = DEFAULT_PROFILE
    if name_or_path is None:
        raise ProfileError(f"no profile given; pass --profile NAME|PATH ({_available()})")
    path = _resolve(name_or_path)
    data = _read_yaml(path)
    try:
        return profile_from_dict(data, name=path.stem, source=str(path))
    except ProfileError as exc:
        raise ProfileError(f"{exc} (in profile {path})") from None


@dataclass(frozen=True)
class Override:
    """A setting that a flag (``--gamma N``) and ``load_decoder(gamma=N)`` override.

    ``key`` is the profile key it sets (``"decoding.gamma"``; no dot: a top-level key); the
    rest is what the flag shows in ``--help``. The value goes through the key's own check.
    """

    key: str
    type: type
    metavar: str
    help: str


#: Every override, declared once: the CLI builds its decoding flags from this table
#: (``cli/options.py``), so a new decoding flag is one entry here plus its profile key.
OVERRIDES: dict[str, Override] = {
    "drafter": Override("drafter", str, "NAME", "Drafter, e.g. m, t, mt, tabed, ssd, eagle, vispec, eagle3, pld (prompt "
                                                "lookup, no draft model), or ar (no drafting); oracle is a benchmark "
                                                "tool (replays ar's output)."),
    "gamma": Override("decoding.gamma", int, "N", f"Draft tokens per block (1-{MAX_GAMMA})."),
    "gamma_schedule": Override("decoding.gamma_schedule", str, "|".join(SCHEDULES), (
        "Draft length per block: constant γ; heuristic (+2 after a full accept, -1 otherwise, at most γ); "
        "fastvlm (FastVLM Eq. 5, grows with the context from γ); cost (the γ of most tokens per second from the "
        "step costs `mmspec profile-latency` measured here and the acceptance so far; γ first).")),
    "ssd_layer": Override("ssd.layer", int, "N", "ssd: draft with the target's first N decoder layers "
                                                  "(see `mmspec select-layer`)."),
    "tree_width": Override("decoding.tree_width", int, "D", (
        f"Token trees: D branches per block (1-{MAX_TREE_WIDTH}), verified in one target forward; 1 = no tree.")),
    "tree": Override("decoding.tree", str, "|".join(TREE_KINDS), (
        "Token tree per block: chain; width (--tree-width branches); dynamic (EAGLE-2: --tree-topk children "
        "per node, --tree-depth expansions, --tree-budget nodes verified)."), ),
    "tree_budget": Override("decoding.tree_budget", int, "N", (
        f"Dynamic trees: nodes one target forward verifies, the root included (2-{MAX_TREE_BUDGET}; 30).")),
    "tree_depth": Override("decoding.tree_depth", int, "N", "Dynamic trees: expansion rounds; depth+1 levels (3)."),
    "tree_topk": Override("decoding.tree_topk", int, "K", "Dynamic trees: children per expanded node (8)."),
    "compile": Override("decoding.compile", bool, "", (
        "Run the target's and draft model's short steps compiled (torch.compile: inductor's C++ wrapper on CPU, "
        "CUDA graphs on CUDA) over a static KV state; the same greedy tokens on CPU (README: what holds on "
        "CUDA), compiled once per process and step size (off by default: see docs/BENCHMARKS.md).")),
    "max_new_tokens": Override("decoding.max_new_tokens", int, "N", "Tokens to generate per turn, at most."),
    "temperature": Override("decoding.temperature", float, "X", "0 for greedy decoding."),
    "top_p": Override("decoding.top_p", float, "X", "Nucleus sampling mass, in (0, 1]."),
    "top_k": Override("decoding.top_k", int, "N", "Sample from the N likeliest tokens."),
    "seed": Override("decoding.seed", int, "N", "Random seed for sampling (0 to 2^64 - 1)."),
    "int8_threshold": Override("target.quantization_threshold", float, "X", (
        "An 8-bit target's LLM.int8 outlier threshold: 0 (mmspec's default) rounds every verified token on its own, "
        "so every drafter gives the 8-bit target's own output; 6.0 (bitsandbytes' default) is the model its own "
        "generate runs, and then only ar is guaranteed to match it (README, Quantized models).")),
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def apply_overrides(profile: Profile, **overrides: Any) -> Profile:
    """Return ``profile`` with CLI values applied; ``None`` values (flag not given) are ignored.

    Values go through the same checks as the YAML, so errors read
    ``--gamma: expected an integer between 1 and 64, got 0``. Dynamic-tree overrides given with a tree that
    is not dynamic are refused (:func:`_check_dynamic_flags`), and so are tree settings that disagree
    (``choices.tree_conflict``: a flag is named as the flag, a value the profile holds by its key).
    """
    unknown = sorted(set(overrides) - set(OVERRIDES))
    if unknown:
        raise TypeError(f"unknown override(s) {', '.join(unknown)}; known: {', '.join(OVERRIDES)}")
    changes: dict[str | None, dict[str, Any]] = {}
    for name, value in overrides.items():
        if value is None:
            continue
        section, _, key = OVERRIDES[name].key.rpartition(".")
        section = section or None
        owner = Profile if section is None else type(getattr(profile, section))
        check = next(f for f in _keys(owner) if f.name == key).metadata["check"]
        changes.setdefault(section, {})[key] = check(value, _flag(name))
    top = changes.pop(None, {})
    for section, values in changes.items():
        try:
            top[section] = dataclasses.replace(getattr(profile, section), **values)
        except ProfileError as exc:  # a check across the section's keys: named by the flags given, and the section
            flags = ", ".join(_flag(name) for name, value in overrides.items()
                              if value is not None and OVERRIDES[name].key.startswith(f"{section}."))
            raise ProfileError(f"{flags}: {section}.{exc}") from None
    changed = dataclasses.replace(profile, **top)
    _check_dynamic_flags(changed.decoding, [name for name in DYNAMIC_TREE_FLAGS if overrides.get(name) is not None])
    conflict = tree_conflict(changed.decoding.tree, changed.decoding.tree_width,
                             [name for name in TREE_SETTINGS if overrides.get(name) is not None])
    if conflict:  # before any model loads, named as given: a flag as the flag, a profile value by its key
        raise InputError(conflict)
    return changed


#: The overrides that shape only a dynamic tree (EAGLE-2): given with any other tree, they would do nothing.
DYNAMIC_TREE_FLAGS = ("tree_budget", "tree_depth", "tree_topk")


def _check_dynamic_flags(decoding: DecodingSpec, given: list[str]) -> None:
    """Refuse ``--tree-budget/--tree-depth/--tree-topk`` (or ``load_decoder(tree_budget=...)``) given with a tree that
    is not dynamic, as a conflicting ``--tree``/``--tree-width`` pair is refused, instead of ignoring them.

    Only values given as overrides are refused: a profile may hold dynamic-tree settings (``decoding.tree_budget``)
    and still be run with ``--tree chain``; its settings then wait for ``--tree dynamic``.
    """
    if not given:
        return
    kind = tree_kind(decoding.tree, decoding.tree_width)
    if kind == "dynamic":
        return
    flags = "/".join(_flag(name) for name in given)
    drop = "drop it" if len(given) == 1 else "drop them"
    raise InputError(f"{flags} shape{'s' if len(given) == 1 else ''} dynamic trees only, and this run drafts a "
                     f"{kind}{' tree' if kind == 'width' else ''}; add --tree dynamic, or {drop}")


def profile_to_dict(profile: Profile) -> dict[str, Any]:
    """Plain data for ``yaml.safe_dump``; ``profile_from_dict`` of it gives the profile back."""

    def plain(obj: Any) -> Any:
        if dataclasses.is_dataclass(obj):
            return {f.name: plain(getattr(obj, f.name)) for f in _keys(type(obj))}
        if isinstance(obj, tuple):
            return [plain(item) for item in obj]
        return obj

    return plain(profile)
