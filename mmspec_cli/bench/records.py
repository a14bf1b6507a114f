"""The results file: one JSON line per (sample, turn, drafter), appended and fsync'd as each turn ends.

A record::

    {"id", "category", "turn", "drafter", "token_ids", "text", "new_tokens", "blocks",
     "block_efficiency", "acceptance_rate", "wall_s", "tokens_per_s",
     "drafted", "accepted", "prompt_tokens", "gamma", "temperature", "max_new_tokens", "prompt_style",
     "target", "draft", "top_p", "top_k", "seed", "ensemble", "members"?, "weights"?, "caption_s"?,
     "history_turns"?}

``weights`` (one list per block, in ``members`` order) appear for ensemble drafters;
``history_turns`` (how many given turns opened the conversation) for samples with a history. A
sample that failed is ``{"id", "category", "drafter", "error"}``. The extra keys make the
summary recomputable from the file alone: acceptance over several turns needs the counts,
Eq. (1) needs γ and the prompt length, the token check needs the temperature.

Each record is written with one ``write`` and flushed, so a kill can only leave a partial
LAST line. ``--resume`` drops that line and the error records (failed samples are retried),
rewriting the file atomically (temp file + ``os.replace``) before appending.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from mmspec_cli.errors import InputError
from mmspec_cli.decoding.metrics import RunStats
from mmspec_cli.bench.samples import Sample

if TYPE_CHECKING:  # the engine imports torch; the CLI imports this module before it needs torch
    from mmspec_cli.decoding.events import TurnResult

SETTINGS = ("gamma", "temperature", "max_new_tokens", "prompt_style", "target", "draft", "top_p", "top_k", "seed",
            "ensemble")
REQUIRED = ("turn", "token_ids", "new_tokens", "blocks", "wall_s")  # in every record that is not an error

Record = dict[str, Any]


def turn_record(sample: Sample, turn: int, drafter: str, token_ids: Sequence[int], text: str, stats: RunStats,
                prompt_tokens: int | None, settings: dict[str, Any], members: Sequence[str] = (),
                weights: Sequence[Sequence[float] | None] | None = None) -> Record:
    """The record of one finished turn."""
    record: Record = {"id": sample.id, "category": sample.category, "turn": turn, "drafter": drafter,
                      "token_ids": list(token_ids), "text": text, **stats.as_dict(),
                      "drafted": stats.drafted, "accepted": stats.accepted, "prompt_tokens": prompt_tokens, **settings}
    if members:
        record["members"] = list(members)
        record["weights"] = [None if w is None else list(w) for w in (weights or [])]
    if sample.history:
        record["history_turns"] = len(sample.history)  # turn numbers count from after these
    return record


def engine_record(sample: Sample, turn: int, drafter: str, result: "TurnResult", prompt_tokens: int | None,
                  settings: dict[str, Any], members: Sequence[str] = ()) -> Record:
    record = turn_record(sample, turn, drafter, result.token_ids, result.text, result.stats, prompt_tokens, settings,
                         members, [b.weights for b in result.blocks] if members else None)
    if result.caption_s:
        record["caption_s"] = result.caption_s  # captioning time, not in wall_s
    return record


def error_record(sample: Sample, drafter: str, message: str) -> Record:
    return {"id": sample.id, "category": sample.category, "drafter": drafter, "error": message}


def key(record: Record) -> tuple[str, int, str]:
    return record["id"], record["turn"], record["drafter"]


# --------------------------------------------------------------------------- reading


def parse_lines(data: bytes, name: str) -> tuple[list[Record], int]:
    """Records of the complete lines of ``data`` and the byte length they span (a partial last line is left out)."""
    end = data.rfind(b"\n") + 1  # everything after the last newline is a partial write
    records = []
    for number, line in enumerate(data[:end].split(b"\n")[:-1], start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise InputError(f"{name} line {number} is not valid JSON ({type(exc).__name__}); "
                             f"is it an mmspec bench results file?") from exc
        if not isinstance(record, dict) or "id" not in record or "drafter" not in record:
            raise InputError(f"{name} line {number} is not an mmspec bench record (no id/drafter)")
        missing = [k for k in REQUIRED if k not in record] if "error" not in record else []
        if missing:
            raise InputError(f"{name} line {number} lacks {', '.join(missing)}; is it an mmspec bench results file?")
        records.append(record)
    return records, end


def read_records(paths: Iterable[str | Path]) -> list[Record]:
    """All records of one or more results files (a partial last line of each is ignored)."""
    records: list[Record] = []
    for path in paths:
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise InputError(f"results file {path} could not be read ({type(exc).__name__}: {exc.strerror or exc})") from exc
        records.extend(parse_lines(data, str(path))[0])
    return records


# --------------------------------------------------------------------------- writing


class ResultsFile:
    """Appends records to ``path`` (or keeps them in memory when ``path`` is None)."""

    def __init__(self, path: Path | None, records: list[Record], handle: TextIO | None):
        self.path = path
        self.records = records  # everything in the file: resumed records, then this run's
        self._handle = handle

    @classmethod
    def open(cls, path: str | Path | None, resume: bool, settings: dict[str, Any]) -> "ResultsFile":
        """Check ``path`` can be written (before any model loads) and, with ``resume``, take its records."""
        if path is None:
            return cls(None, [], None)
        path = Path(os.path.expanduser(str(path)))
        if path.is_dir():
            raise InputError(f"--out {path} is a directory; pass a file path such as {path}/results.jsonl")
        records: list[Record] = []
        if path.exists() and path.stat().st_size > 0:
            if not resume:
                raise InputError(f"--out {path} already exists; pass --resume to continue it, or choose another file")
            records = _prepare_resume(path, settings)
        try:
            handle = open(path, "a", encoding="utf-8")
        except OSError as exc:
            raise InputError(f"--out {path} can't be written ({exc.strerror or type(exc).__name__}); "
                             f"choose a writable file path") from None
        return cls(path, records, handle)

    def done(self) -> set[tuple[str, int, str]]:
        return {key(r) for r in self.records if "error" not in r}

    def write(self, record: Record) -> None:
        self.records.append(record)
        if self._handle is not None:
            self._handle.write(json.dumps(record, ensure_ascii=False) + "\n")
            self._handle.flush()
            os.fsync(self._handle.fileno())

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    def __enter__(self) -> "ResultsFile":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _prepare_resume(path: Path, settings: dict[str, Any]) -> list[Record]:
    """The finished records of ``path``; a partial last line and error records are removed from the file."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InputError(f"--out {path} can't be read to resume ({exc.strerror or type(exc).__name__})") from None
    records, end = parse_lines(data, f"--out {path}")
    for record in records:
        for name in SETTINGS:
            if name in record and name in settings and record[name] != settings[name]:
                raise InputError(f"--out {path} holds results made with {name} {record[name]} but this run uses "
                                 f"{settings[name]}; resume with the same settings, or choose another --out")
    kept = [r for r in records if "error" not in r]
    if end != len(data) or len(kept) != len(records):
        _rewrite(path, kept)
    return kept


def _rewrite(path: Path, records: list[Record]) -> None:
    """Replace ``path`` by ``records`` atomically: a crash leaves either the old or the new file."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise InputError(f"--out {path} can't be rewritten to resume ({exc.strerror or type(exc).__name__})") from None
