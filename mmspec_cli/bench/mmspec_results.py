"""MMSpec (arXiv 2603.14989): its protocol (``bench --protocol mmspec``) and its results layout
(``bench --format mmspec --out DIR``), so that MMSpec's summary tooling reads mmspec's drafters beside its methods.

The protocol (:func:`apply_protocol`, :func:`bound_pixels`, :func:`check_samples`): temperature 0, 1,024 new tokens,
the images in the first turn only, and a Qwen-VL model's images bounded to 256·28·28 … 1280·28·28 pixels. A decoding
flag given on the command line still wins (a short ``--max-new-tokens`` run of the protocol). MMSpec's Vicuna-style
system prompt (:data:`SYSTEM_PROMPT`) is not applied: mmspec renders a turn's prompt through the chat template from
user and assistant turns only (``models/prompts.py``), with no place for a system message, so each model's template
adds its own default system message where it has one (Qwen-VL's does).

The layout: one file per drafter, ``DIR/<drafter>-temperature-<t>.jsonl`` (``ar`` is MMSpec's baseline), one line
per sample::

    {"question_id", "topic", "category", "answer_id", "model_id", "tstamp",
     "choices": [{"index": 0, "turns": [text per turn], "idxs": [verification rounds per turn],
                  "new_tokens": [...], "wall_time": [seconds per turn],
                  "acceptance_length": [[accepted draft tokens of each round] per turn]}]}

The run's own records (resumable, summarised as ever) go to ``DIR/bench.jsonl`` under bench's ``--out`` rules; each
carries ``accepted_per_block`` (:data:`~mmspec_cli.bench.records.ROUNDS`: the accepted count of each verification
round), which the results files are written from,
atomically, when the run ends. A sample is written for a drafter once all its turns are recorded. Nothing that was
in DIR is overwritten: a results file this run would write that already exists is refused before any model loads,
unless ``--resume`` continues the ``bench.jsonl`` it was written from.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from mmspec_cli.bench.records import ROUNDS, Record
from mmspec_cli.inputs.samples import Sample
from mmspec_cli.errors import InputError
from mmspec_cli.models.prompts import shorten

PROTOCOL = "mmspec"
FORMAT = "mmspec"
TEMPERATURE = 0.0
MAX_NEW_TOKENS = 1024
MIN_PIXELS = 256 * 28 * 28
MAX_PIXELS = 1280 * 28 * 28
#: MMSpec's system prompt (Vicuna's); not applied, see the module doc
SYSTEM_PROMPT = ("A chat between a curious human and an artificial intelligence assistant. The assistant gives "
                 "helpful, detailed, and polite answers to the human's questions.")
RECORDS_NAME = "bench.jsonl"


def check_protocol(value: str | None) -> None:
    if value is not None and value != PROTOCOL:
        raise InputError(f"--protocol: expected {PROTOCOL}, got '{shorten(value, 40)}'")


# --------------------------------------------------------------------------- the protocol


def apply_protocol(profile: Any) -> Any:
    """``profile`` with MMSpec's decoding: temperature 0, 1,024 new tokens (flags are applied after, and win)."""
    import dataclasses

    return dataclasses.replace(profile, decoding=dataclasses.replace(
        profile.decoding, temperature=TEMPERATURE, max_new_tokens=MAX_NEW_TOKENS))


def bound_pixels(models: Any) -> list[str]:
    """Bound the images of each loaded Qwen-VL model (target, draft) to MMSpec's 256·28·28 … 1280·28·28 pixels, over
    the profile's own bounds; other families are left as they are. The roles bounded."""
    from types import SimpleNamespace

    from mmspec_cli.models.families import QWEN_VL_TYPES
    from mmspec_cli.models.loading import with_pixel_bounds

    bounded = []
    for role in ("target", "draft"):
        loaded = getattr(models, role, None)
        if loaded is None or getattr(loaded.model.config, "model_type", None) not in QWEN_VL_TYPES:
            continue
        spec = SimpleNamespace(model=loaded.name, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
        loaded.processor = with_pixel_bounds(loaded.processor, spec, role)  # in place: what shares it is bounded too
        bounded.append(role)
    return bounded


def check_samples(samples: Sequence[Sample]) -> None:
    """MMSpec shows the image in the first turn only: a sample whose later turn brings images is refused."""
    for sample in samples:
        sample.refuse_turn_images("--protocol mmspec (MMSpec shows images in the first turn only)")


# --------------------------------------------------------------------------- the run's records




# --------------------------------------------------------------------------- the folder


def results_name(drafter: str, temperature: float) -> str:
    return f"{drafter}-temperature-{float(temperature)}.jsonl"


def prepare_folder(out: str, drafters: Sequence[str], temperature: float, resume: bool) -> tuple[Path, bool]:
    """``--out DIR`` of ``--format mmspec``, checked before any model loads: (the folder, whether this call made it).
    A file, a folder whose parent is missing, or a results file this run would write already there (unless
    ``--resume`` continues the records it was written from) is refused in one line."""
    folder = Path(os.path.expanduser(out))
    shown = shorten(str(folder))
    if folder.exists() and not folder.is_dir():
        raise InputError(f"--out {shown} is a file; with --format mmspec, --out names a folder (made if missing) "
                         f"for MMSpec's results files")
    records = folder / RECORDS_NAME
    continuing = resume and records.is_file() and records.stat().st_size > 0
    if folder.is_dir() and not continuing:
        for drafter in drafters:
            name = results_name(drafter, temperature)
            if (folder / name).exists():
                raise InputError(f"--out {shown} already holds {name}, which this run would write; choose another "
                                 f"--out (its other files are left alone), or move that file away")
    if folder.is_dir():
        return folder, False
    if not folder.parent.is_dir():
        raise InputError(f"--out {shown}: folder {shorten(str(folder.parent))} doesn't exist; create it or pick "
                         f"another path")
    try:
        folder.mkdir()
    except OSError as exc:
        raise InputError(f"--out {shown} can't be made ({exc.strerror or type(exc).__name__}); "
                         f"choose a writable folder") from None
    return folder, True


def remove_if_empty(folder: Path) -> None:
    """The folder ``prepare_folder`` made, removed when the run left nothing in it (bench's --out rule)."""
    try:
        folder.rmdir()
    except OSError:
        pass  # not empty: what the run saved stays


# --------------------------------------------------------------------------- writing


def mmspec_lines(drafter: str, samples: Sequence[Sample], records: Iterable[Record], turns: dict[str, int]) -> list[dict]:
    """MMSpec's lines of ``drafter``: one per sample (in ``samples`` order) whose first ``turns[id]`` turns are all
    recorded; a sample that failed, or was cut short, is left out."""
    by_turn: dict[tuple[str, int], Record] = {}
    for record in records:
        if record.get("drafter") == drafter and "error" not in record:
            by_turn[(record["id"], record["turn"])] = record
    lines = []
    for sample in samples:
        wanted = [by_turn.get((sample.id, turn)) for turn in range(turns[sample.id])]
        if not wanted or any(r is None for r in wanted):
            continue
        lacking = next((r for r in wanted if ROUNDS not in r), None)
        if lacking is not None:
            raise InputError(f"--out {RECORDS_NAME}: the record of sample '{shorten(sample.id, 40)}' turn "
                             f"{lacking['turn'] + 1} ({drafter}) has no per-round counts (made without --format "
                             f"mmspec); run again into a new --out")
        source = dict(sample.source)
        choice = {"index": 0, "turns": [r["text"] for r in wanted], "idxs": [r["blocks"] for r in wanted],
                  "new_tokens": [r["new_tokens"] for r in wanted], "wall_time": [r["wall_s"] for r in wanted],
                  "acceptance_length": [list(r[ROUNDS]) for r in wanted]}
        lines.append({"question_id": source.get("question_id", sample.id), "topic": sample.category,
                      "category": source.get("category", sample.category), "answer_id": uuid.uuid4().hex,
                      "model_id": drafter, "choices": [choice], "tstamp": time.time()})
    return lines


def write_results(folder: Path, drafters: Sequence[str], temperature: float, samples: Sequence[Sample],
                  records: Sequence[Record], turns: dict[str, int]) -> list[Path]:
    """Write every drafter's results file into ``folder`` at once (each a temporary file renamed into place, so a
    failure leaves the folder as it was); the paths written."""
    from mmspec_cli.models.writing import write_atomically

    files = {}
    for drafter in drafters:
        text = "".join(json.dumps(line, ensure_ascii=False) + "\n"
                       for line in mmspec_lines(drafter, samples, records, turns)).encode("utf-8")
        files[folder / results_name(drafter, temperature)] = (lambda handle, text=text: handle.write(text))
    write_atomically(files)
    return list(files)
