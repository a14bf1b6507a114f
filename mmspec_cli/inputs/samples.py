"""Benchmark samples: the :class:`Sample` type, JSONL manifests, and which samples a run takes.

A manifest has one JSON object per line::

    {"id": "cat-1", "images": ["img/cat.png"], "turns": ["What is it?", "Why?"], "category": "llava-w"}

``images`` are paths relative to the manifest's folder (or absolute), in prompt order; an
empty list makes a text-only sample. ``turns`` are the user questions of one conversation; a turn
may bring its own images, as ``{"question": "And this one?", "images": ["img/dog.png"]}``: they are
shown in that turn, after the conversation so far (whose cache the decoder keeps).
An optional ``"history": [["question", "answer"], ...]`` gives earlier turns as they are: they
open the conversation (the images in their first turn) but are not generated or measured;
``turns`` then continue it. A ``category`` naming a TABED dataset (``LLaVA-W``, ``DocVQA``,
``Spot-the-Diff``, ... see ``prompts.prompt_key_for``) takes that dataset's App. I.1 prompt
under ``--prompt-style paper``. Other keys (reference answers, ...) are ignored. Blank lines are
skipped. Every image file the samples of a run name, in any turn, must exist when the run starts
(:func:`check_image_files`: a typo costs no model load and leaves no error records); image files are
opened only when their sample runs, so a corrupt image fails that sample alone.

A folder in MMSpec's layout (``mmspec.jsonl`` beside ``images/``, :func:`read_mmspec_folder`) is read alike: one
record per line, ``{"id", "image", "turns", "topic", "category"?}``, ``topic`` taken as the category; ``image`` is a
file in ``images/`` (``x.jpg``, as MMSpec's own loader joins it) or a path from the folder (``images/x.jpg``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmspec_cli.errors import InputError
from mmspec_cli.models.images import load_image, to_rgb
from mmspec_cli.models.prompts import check_history, shorten
from mmspec_cli.inputs.prompts import prompt_key_for

REQUIRED = ("id", "images", "turns", "category")


@dataclass(frozen=True)
class Sample:
    """One conversation to benchmark. ``images`` are file paths or PIL images (from datasets);
    ``prompt_key`` names the TABED App. I.1 prompt used with ``--prompt-style paper``;
    ``history`` holds given (question, answer) turns before ``turns`` (not generated)."""

    id: str
    category: str
    turns: tuple[str, ...]
    images: tuple[Any, ...] = ()
    prompt_key: str | None = None
    history: tuple[tuple[str, str], ...] = ()
    turn_images: tuple[tuple[int, tuple[Any, ...]], ...] = ()  # (turn index, the images that turn brings)
    #: fields of the source kept to write results in its own layout (an MMSpec record's ``question_id`` as given,
    #: and its ``category``, ``topic`` being the sample's category); empty for the other sources
    source: tuple[tuple[str, Any], ...] = ()

    def brought(self, turns: int) -> dict[int, tuple[Any, ...]]:
        """The images each of the first ``turns`` turns brings: {turn index: images}."""
        return {index: images for index, images in self.turn_images if index < turns}

    def refuse_turn_images(self, command: str) -> None:
        """One line when a later turn brings images and ``command`` reads only the opening ones."""
        if self.turn_images:
            raise InputError(f"sample '{self.id}': a later turn brings images, which {command} does not read; "
                             f"move them to the sample's 'images' or leave the sample out")


def load_sample_images(sample: Sample) -> list:
    """The sample's opening images as RGB PIL images; a bad file raises the one-line InputError of ``images.py``."""
    return _load(sample.images)


def load_turn_images(sample: Sample, turns: int) -> dict[int, list]:
    """The images the first ``turns`` turns bring, as RGB PIL images: {turn index: images}."""
    return {index: _load(images) for index, images in sample.brought(turns).items()}


def _load(images: Sequence[Any]) -> list:
    out = []
    for image in images:
        if isinstance(image, (str, Path)):
            out.append(load_image(image))
        else:
            out.append(to_rgb(image))  # as files are read: high bit depths scaled, transparency over white
    return out


def check_image_files(samples: Sequence[Sample], where: str) -> None:
    """Refuse, in one line, samples whose image files (opening or a later turn's) are missing or are folders: the
    first one and how many more. Only paths are looked up here (none is opened: a file that is not an image fails its
    sample alone); PIL images (datasets) need nothing."""
    missing = [(sample, turn, image) for sample in samples
               for turn, images in ((0, sample.images), *sample.turn_images) for image in images
               if isinstance(image, (str, Path)) and not os.path.isfile(os.path.expanduser(image))]
    if not missing:
        return
    sample, turn, image = missing[0]
    try:
        load_image(image)  # not a file: load_image says why (no file, a folder, a broken link, a name too long ...)
    except InputError as exc:
        why = str(exc)
    else:
        return  # it appeared in the meantime
    others = len(missing) - 1
    more = f" (and {others} more image{'s' if others > 1 else ''} missing)" if others else ""
    turn_words = f" turn {turn + 1}" if turn else ""
    raise InputError(f"{where}: sample '{shorten(sample.id, 40)}'{turn_words}: {why}{more}")


# --------------------------------------------------------------------------- manifests


def read_manifest(path: Path) -> list[Sample]:
    """Parse a JSONL manifest; any bad line is a one-line InputError naming its line number."""
    return _read_records(path, f"manifest {path}", lambda line, number: _parse_line(line, path, number),
                         '{"id": "1", "images": ["a.png"], "turns": ["Describe it."], "category": "demo"}')


def _read_records(path: Path, shown: str, parse, example: str) -> list[Sample]:
    """The samples of a JSONL file, one per non-empty line (``parse(line, number)``); an unreadable file, an id
    given twice or no record at all is one line."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{shown} could not be read ({type(exc).__name__}); pass a readable UTF-8 JSONL file") from exc
    samples: list[Sample] = []
    seen: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        sample = parse(line, number)
        if sample.id in seen:
            raise InputError(f"{shown} line {number}: id '{shorten(sample.id, 40)}' repeats line {seen[sample.id]}; "
                             f"give every sample its own id")
        seen[sample.id] = number
        samples.append(sample)
    if not samples:
        raise InputError(f"{shown} has no samples; write one JSON object per line (e.g. {example})")
    return samples


def _json_object(line: str, where: str, keys: Sequence[str]) -> Mapping[str, Any]:
    """One JSONL line's object; not JSON, or not an object, is one line naming ``where`` and the ``keys`` it needs."""
    try:
        data = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InputError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno}); "
                         f"each line must be one JSON object") from exc
    except RecursionError:  # nested past what the decoder takes: no sample is
        raise InputError(f"{where}: nested too deeply to read; each line must be one JSON object with keys "
                         f"{', '.join(keys)}") from None
    if not isinstance(data, Mapping):
        raise InputError(f"{where}: expected a JSON object with keys {', '.join(keys)}, got {type(data).__name__}")
    return data


def _parse_line(line: str, path: Path, number: int) -> Sample:
    where = f"manifest {path} line {number}"
    data = _json_object(line, where, REQUIRED)
    missing = [key for key in REQUIRED if key not in data]
    if missing:
        raise InputError(f"{where}: missing {', '.join(repr(k) for k in missing)}; each line needs {', '.join(REQUIRED)}")
    sample_id, category, images, turns = data["id"], data["category"], data["images"], data["turns"]
    if not isinstance(sample_id, str) or not sample_id.strip():
        raise InputError(f"{where}: 'id' must be a non-empty string, got {json.dumps(sample_id)}")
    if not isinstance(category, str) or not category.strip():
        raise InputError(f"{where}: 'category' must be a non-empty string, got {json.dumps(category)}")
    if not isinstance(images, list) or not all(isinstance(i, str) and i for i in images):
        raise InputError(f"{where}: 'images' must be a list of file paths (relative to the manifest), "
                         f"got {json.dumps(images)[:80]}")
    if not isinstance(turns, list) or not turns:
        raise InputError(f"{where}: 'turns' must be a non-empty list of questions, got {json.dumps(turns)[:80]}")
    questions, brought = [], []
    for index, turn in enumerate(turns):
        question, extra = _parse_turn(turn, where, index)
        questions.append(question)
        if extra:
            brought.append((index, extra))
    try:
        history = check_history(data.get("history", []))
    except InputError as exc:
        raise InputError(f"{where}: {exc}") from None
    folder = path.parent

    def located(names: list[str]) -> tuple[Path, ...]:
        return tuple(Path(os.path.expanduser(i)) if os.path.isabs(os.path.expanduser(i)) else folder / i for i in names)

    opening = located(images) + tuple(p for index, extra in brought if index == 0 for p in located(extra))
    return Sample(id=sample_id, category=category, turns=tuple(questions), images=opening,
                  prompt_key=prompt_key_for(category), history=tuple(history),
                  turn_images=tuple((index, located(extra)) for index, extra in brought if index > 0))


def _parse_turn(turn: Any, where: str, index: int) -> tuple[str, list[str]]:
    """A turn of a manifest: a question, or {"question": ..., "images": [...]}; (question, image paths)."""
    if isinstance(turn, str) and turn.strip():
        return turn, []
    if isinstance(turn, Mapping) and isinstance(turn.get("question"), str) and turn["question"].strip():
        extra = turn.get("images", [])
        if isinstance(extra, list) and all(isinstance(i, str) and i for i in extra):
            return turn["question"], list(extra)
    raise InputError(f"{where}: turn {index + 1} must be a question or {{\"question\": ..., \"images\": [paths]}}, "
                     f"got {json.dumps(turn)[:80]}")


# --------------------------------------------------------------------------- MMSpec's layout

MMSPEC_FILE = "mmspec.jsonl"
MMSPEC_IMAGES = "images"
MMSPEC_REQUIRED = ("id", "image", "turns", "topic")  # ``category`` (MMSpec's source dataset) is kept when given


def read_mmspec_folder(folder: Path) -> list[Sample]:
    """The samples of a folder in MMSpec's layout: ``mmspec.jsonl`` beside ``images/``, ``topic`` as the category,
    the one image in the first turn. Anything wrong is one line naming the record (its line and id) and the fix."""
    path = folder / MMSPEC_FILE
    if not path.is_file():
        raise InputError(f"SOURCE {shorten(str(folder))} is a folder without {MMSPEC_FILE}, so not in MMSpec's layout "
                         f"({MMSPEC_FILE} beside {MMSPEC_IMAGES}/); pass such a folder, or a JSONL manifest file")
    return _read_records(path, str(path), lambda line, number: _mmspec_record(line, folder, path, number),
                         '{"id": "1", "image": "a.jpg", "turns": ["Describe it."], "topic": "general vqa"}')


def _mmspec_record(line: str, folder: Path, path: Path, number: int) -> Sample:
    where = f"{path} line {number}"
    data = _json_object(line, where, MMSPEC_REQUIRED)
    record_id = data.get("id")
    if "id" in data and (isinstance(record_id, bool) or not isinstance(record_id, (str, int))
                         or not str(record_id).strip()):
        raise InputError(f"{where}: 'id' must be a non-empty string or an integer, got {json.dumps(record_id)[:40]}")
    if "id" in data:
        where = f"{where} (record '{shorten(str(record_id), 40)}')"
    missing = [key for key in MMSPEC_REQUIRED if key not in data]
    if missing:
        raise InputError(f"{where}: missing {', '.join(repr(k) for k in missing)}; each MMSpec record needs "
                         f"{', '.join(MMSPEC_REQUIRED)}")
    image, turns, topic, category = data["image"], data["turns"], data["topic"], data.get("category", data["topic"])
    if not isinstance(topic, str) or not topic.strip():
        raise InputError(f"{where}: 'topic' must be a non-empty string, got {json.dumps(topic)[:40]}")
    if not isinstance(category, str) or not category.strip():
        raise InputError(f"{where}: 'category' must be a non-empty string, got {json.dumps(category)[:40]}")
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise InputError(f"{where}: 'turns' must be a non-empty list of questions, got {json.dumps(turns)[:80]}")
    if not isinstance(image, str) or not image.strip():
        raise InputError(f"{where}: 'image' must be a file name in {MMSPEC_IMAGES}/, got {json.dumps(image)[:80]}")
    return Sample(id=str(record_id), category=topic, turns=tuple(turns), images=(_mmspec_image(image, folder, where),),
                  prompt_key=None, source=(("question_id", record_id), ("category", category)))


def _mmspec_image(image: str, folder: Path, where: str) -> Path:
    """An MMSpec record's image: ``images/<image>`` (MMSpec's own loader's join), else ``<image>`` from the folder
    (``images/x.jpg``); absolute paths as they are. A file in neither place is refused naming both."""
    name = os.path.expanduser(image)
    places = [Path(name)] if os.path.isabs(name) else [folder / MMSPEC_IMAGES / name, folder / name]
    for place in places:
        if os.path.lexists(place):  # a broken link or unreadable file is found here, and load_image says why later
            return place
    if len(places) == 1:
        raise InputError(f"{where}: image '{shorten(image, 60)}' does not exist; correct the record's 'image'")
    looked = " nor ".join(shorten(str(p), 60) for p in places)
    raise InputError(f"{where}: image '{shorten(image, 60)}' is missing (neither {looked} exists); put the file in "
                     f"{shorten(str(folder / MMSPEC_IMAGES), 60)}/ or correct the record's 'image'")


# --------------------------------------------------------------------------- selection


def parse_shard(value: str | None, env: Mapping[str, str] = os.environ) -> tuple[int, int] | None:
    """``--shard i/n`` -> (i, n); ``auto`` reads RANK/WORLD_SIZE (torchrun, accelerate) or
    LOCAL_RANK/LOCAL_WORLD_SIZE; None when not given."""
    if value is None:
        return None
    if value == "auto":
        for rank_key, size_key in (("RANK", "WORLD_SIZE"), ("LOCAL_RANK", "LOCAL_WORLD_SIZE")):
            if env.get(rank_key) is not None and env.get(size_key) is not None:
                return _check_shard(env[rank_key], env[size_key], f"--shard auto ({rank_key}/{size_key})")
        raise InputError("--shard auto: RANK and WORLD_SIZE (or LOCAL_RANK and LOCAL_WORLD_SIZE) are not set; "
                         "launch with torchrun or accelerate launch, or pass --shard i/n")
    parts = value.split("/")
    if len(parts) != 2:
        raise InputError(f"--shard: expected i/n (e.g. 0/4) or auto, got '{value}'")
    return _check_shard(parts[0], parts[1], "--shard")


def _check_shard(index: str, count: str, flag: str) -> tuple[int, int]:
    try:
        i, n = int(index), int(count)
    except ValueError:
        raise InputError(f"{flag}: expected integers i/n with 0 <= i < n, got '{index}/{count}'") from None
    if n < 1 or not 0 <= i < n:
        raise InputError(f"{flag}: expected 0 <= i < n and n >= 1, got {i}/{n}")
    return i, n


def select(samples: Sequence[Sample], limit: int | None = None, shard: tuple[int, int] | None = None) -> list[Sample]:
    """The first ``limit`` samples, then every n-th of them starting at i (shard i/n)."""
    chosen = list(samples[:limit] if limit is not None else samples)
    if shard is not None:
        i, n = shard
        chosen = chosen[i::n]
    return chosen
