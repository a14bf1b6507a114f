"""The results file: one JSON line per (sample, turn, drafter), appended and fsync'd as each turn ends.

A record::

    {"id", "category", "turn", "drafter", "token_ids", "text", "new_tokens", "blocks",
     "block_efficiency", "acceptance_rate", "wall_s", "tokens_per_s",
     "drafted", "accepted", "prompt_tokens", "gamma", "temperature", "max_new_tokens", "prompt_style",
     "target", "draft", "top_p", "top_k", "seed", "ensemble", "threads", "int8_threshold", "accepted_per_block",
     "members"?, "weights"?, "caption_s"?, "history_turns"?}

``weights`` (one list per block, in ``members`` order) appear for ensemble drafters;
``history_turns`` (how many given turns opened the conversation) for samples with a history. A
sample that failed is ``{"id", "category", "drafter", "error"}``. The extra keys make the
summary recomputable from the file alone: acceptance over several turns needs the counts,
Eq. (1) needs γ and the prompt length, the token check needs the temperature.

Each record is written with one ``write`` and fsync'd, so a kill can only leave a partial
LAST line. ``--resume`` drops that line and the error records (failed samples are retried),
rewriting the file atomically (temp file + ``os.replace``) before appending. A write that fails
(disk full) is cut off again where it began, and the run stops with :class:`ResultsWriteError`.

A run that fails before it writes any record (a manifest refused after the file was opened, a model that
can't load, every write failing, a Ctrl-C before the first turn ends) removes the file again if it created it,
so a failed run leaves nothing behind that wasn't there. A file that existed before the run (even an empty one)
is left as it was, and a run that ends normally keeps its file even with no record in it (a shard with no
samples), so ``--summarize`` finds every shard's file.

Only one process may write a results file at a time: two would both run the turns neither had
recorded yet and write them twice. The writer holds :class:`~mmspec_cli.models.file_lock.OutLock` on it for the
whole run (``FILE.lock`` beside it, holding the writer's PID), as ``train-head`` does on its folder and answers.
"""

from __future__ import annotations

import errno
import json
import math
import os
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mmspec_cli.bench.report import counted
from mmspec_cli.inputs.samples import Sample
from mmspec_cli.decoding.metrics import RunStats
from mmspec_cli.choices import BENCH_PEERS
from mmspec_cli.errors import InputError
from mmspec_cli.models.file_lock import OutLock, unwritable

if TYPE_CHECKING:  # the engine imports torch; the CLI imports this module before it needs torch
    from mmspec_cli.decoding.events import TurnResult

SETTINGS = ("gamma", "temperature", "max_new_tokens", "prompt_style", "target", "draft", "top_p", "top_k", "seed",
            "ensemble", "int8_threshold")
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


#: A record's accepted draft tokens of each verification round (block) of its turn, in order.
ROUNDS = "accepted_per_block"


def engine_record(sample: Sample, turn: int, drafter: str, result: "TurnResult", prompt_tokens: int | None,
                  settings: dict[str, Any], members: Sequence[str] = ()) -> Record:
    record = turn_record(sample, turn, drafter, result.token_ids, result.text, result.stats, prompt_tokens, settings,
                         members, [b.weights for b in result.blocks] if members else None)
    record[ROUNDS] = [block.accepted for block in result.blocks]  # what MMSpec's results files call acceptance_length
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
    numbered, end = _numbered_records(data, name)
    return [record for _, record in numbered], end


def _numbered_records(data: bytes, name: str) -> tuple[list[tuple[int, Record]], int]:
    """:func:`parse_lines` with each record's line number."""
    end = data.rfind(b"\n") + 1  # everything after the last newline is a partial write
    records = []
    for number, line in enumerate(data[:end].split(b"\n")[:-1], start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:  # nested past the decoder's depth
            raise InputError(f"{name} line {number} is not valid JSON ({type(exc).__name__}); "
                             f"is it an mmspec bench results file?") from exc
        if not isinstance(record, dict) or "id" not in record or "drafter" not in record:
            raise InputError(f"{name} line {number} is not an mmspec bench record (no id/drafter)")
        missing = [k for k in ("category", *(REQUIRED if "error" not in record else ())) if k not in record]
        if missing:
            raise InputError(f"{name} line {number} lacks {', '.join(missing)}; is it an mmspec bench results file?")
        wrong = record_fault(record)
        if wrong:
            raise InputError(f"{name} line {number}: {wrong}; it is not a record mmspec bench wrote (was it edited?): "
                             f"restore the line, or remove it and run bench --resume to record that turn again")
        records.append((number, record))
    return records, end


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _amount(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def _text(value: Any) -> bool:
    return isinstance(value, str)


def _counts(value: Any) -> bool:
    return isinstance(value, list) and all(map(_count, value))


def _or_none(check):
    return lambda value: value is None or check(value)


#: What each field of a record holds, as bench writes it (:func:`turn_record`, :func:`error_record`), checked where
#: the field is present (files of earlier releases lack some): name -> (check, what it must be).
FIELDS = {
    "id": (lambda v: _text(v) and v != "", "a non-empty string"),
    "category": (_text, "a string"),
    "drafter": (lambda v: _text(v) and v != "", "a non-empty string"),
    "error": (_text, "a string"),
    "turn": (_count, "an integer >= 0"),
    "token_ids": (_counts, "a list of token ids (integers >= 0)"),
    "text": (_text, "a string"),
    **{name: (_count, "an integer >= 0") for name in ("new_tokens", "blocks")},
    **{name: (_or_none(_count), "an integer >= 0 or null")
       for name in ("drafted", "accepted", "prompt_tokens", "gamma", "max_new_tokens", "top_k", "seed", "threads",
                    "history_turns")},
    "wall_s": (_amount, "a number >= 0"),
    **{name: (_or_none(_amount), "a number >= 0 or null")
       for name in ("tokens_per_s", "block_efficiency", "acceptance_rate", "temperature", "top_p", "caption_s",
                    "int8_threshold")},
    **{name: (_or_none(_text), "a string or null") for name in ("prompt_style", "target", "draft")},
    "ensemble": (lambda v: v is None or v == "" or isinstance(_drafting(v), dict),
                 "the run's drafting settings, a JSON object as text"),
    ROUNDS: (_counts, "a list of integers >= 0"),
    "members": (lambda v: isinstance(v, list) and all(map(_text, v)), "a list of member letters"),
    "weights": (lambda v: isinstance(v, list) and all(w is None or (isinstance(w, list) and all(map(_amount, w)))
                                                      for w in v), "a list of weight lists (or nulls)"),
}


def record_fault(record: Record) -> str | None:
    """What is wrong with ``record`` as a results record (a field of the wrong kind, token counts that disagree),
    in words; None when nothing is."""
    for name, (check, expected) in FIELDS.items():
        if name in record and not check(record[name]):
            return f"{name} must be {expected}, got {_shown(record[name], 40)}"
    if "error" in record:
        return None
    if len(record["token_ids"]) != record["new_tokens"]:
        return f"new_tokens is {record['new_tokens']} but token_ids holds {len(record['token_ids'])}"
    if record["new_tokens"] and not record["blocks"]:
        return f"{record['new_tokens']} new tokens in 0 blocks"
    if ROUNDS in record and record["drafter"] not in BENCH_PEERS and len(record[ROUNDS]) != record["blocks"]:
        # (a peer row, Hugging Face's assisted generation, reports no blocks: its ROUNDS is empty, its blocks the
        # target's calls)
        return f"blocks is {record['blocks']} but {ROUNDS} holds {len(record[ROUNDS])}"
    return None


def read_records(paths: Iterable[str | Path]) -> list[Record]:
    """All records of one or more results files (a partial last line of each is ignored), refused where they
    can't be summarised together (:func:`check_one_kind`)."""
    located: list[tuple[str, Record]] = []
    given: dict[tuple[int, int], str] = {}
    for path in paths:
        try:
            data = Path(path).read_bytes()
            stat = os.stat(path)
        except OSError as exc:
            raise InputError(f"results file {path} could not be read ({type(exc).__name__}: {exc.strerror or exc})") from exc
        identity = (stat.st_dev, stat.st_ino)
        if identity in given:
            raise InputError(f"results file {path} is given twice (as {given[identity]} before); pass each file once")
        given[identity] = str(path)
        numbered, _ = _numbered_records(data, str(path))
        located.extend((f"{path} line {number}", record) for number, record in numbered)
    check_one_kind(located)
    return [record for _, record in located]


def made_compiled(record: Record) -> bool:
    """Whether ``record`` was made with ``--compile`` (its drafting settings say so; an error record never is)."""
    try:
        drafting = json.loads(record.get("ensemble") or "{}")
    except (json.JSONDecodeError, TypeError):
        return False
    return isinstance(drafting, dict) and drafting.get("compile") is True


def check_one_kind(located: Sequence[tuple[str, Record]]) -> None:
    """Refuse records that would make a wrong summary together; ``located``: (where, record) in file order.

    The choice is to refuse, in one line naming where, rather than to summarise the parts apart, where the
    rows would need a label of their kind that every reader of the table (and of its JSON and CSV) must heed:

    - records made with ``--compile`` and without: compiled and eager times are not summarised together
      (README); their speedups and Eq. (1) come from different latencies;
    - a (sample, turn, drafter) recorded twice (or a sample's failure with a drafter): two runs' records
      joined (``cat a.jsonl a.jsonl``) would count each turn twice and compare ``ar`` with itself.
    """
    kinds: dict[bool, str] = {}
    for where, record in located:
        if "error" not in record:
            kinds.setdefault(made_compiled(record), where)
    if len(kinds) > 1:
        raise InputError(f"{kinds[True]} was made with --compile and {kinds[False]} without; compiled and eager "
                         f"times are not summarised together: summarise the files of each kind apart")
    seen: dict[tuple, tuple[str, Any]] = {}
    for where, record in located:
        failed = "error" in record
        found = (str(record["id"]), None if failed else str(record["turn"]), str(record["drafter"]))
        if found in seen:
            first, category = seen[found]
            what = (f"the failure of sample '{found[0]}' with drafter '{found[2]}'" if failed else
                    f"sample '{found[0]}' turn {found[1]} drafter '{found[2]}'")
            if record.get("category") != category:  # one id in two sources, not one run twice
                raise InputError(f"{where} and {first} both hold {what}, of categories {record.get('category')!r} "
                                 f"and {category!r}: the runs' sources use the same ids, and the summary pairs "
                                 f"records by id; summarise each run's file apart, or give the samples distinct ids")
            raise InputError(f"{where} repeats {what} of {first}: two runs' records were joined; remove the "
                             f"repeated run's records, or summarise each run's file apart")
        seen[found] = (where, record.get("category"))


# --------------------------------------------------------------------------- writing


class ResultsWriteError(InputError):
    """The results file stopped taking records (disk full, I/O error). The run stops: every later record
    would fail the same way, so the runner lets this through instead of recording it as the sample's failure."""


class ResultsFile:
    """Appends records to ``path`` (or keeps them in memory when ``path`` is None), holding its lock."""

    def __init__(self, path: Path | None, records: list[Record], fd: int | None, lock: "OutLock | None" = None,
                 created: bool = False):
        self.path = path
        self.records = records  # everything in the file: resumed records, then this run's
        self._fd = fd  # unbuffered, O_APPEND: nothing is left in a buffer to fail again at close
        self._lock = lock
        self.created = created  # this run made the file (it did not exist before)
        self.written = 0  # records this run wrote
        self.removed = False  # the run failed before writing any record, and the file it made was removed

    @classmethod
    def open(cls, path: str | Path | None, resume: bool, settings: dict[str, Any]) -> "ResultsFile":
        """Lock ``path``, check it can be written (before any model loads) and, with ``resume``, take its records."""
        if path is None:
            return cls(None, [], None)
        path = Path(os.path.expanduser(str(path)))
        if path.is_dir():
            raise InputError(f"--out {path} is a directory; pass a file path such as {path}/results.jsonl")
        lock = OutLock.acquire(path)
        try:
            records: list[Record] = []
            if path.is_file() and path.stat().st_size > 0:
                if not resume:
                    raise InputError(f"--out {path} already exists; pass --resume to continue it, "
                                     f"or choose another file")
                records = _prepare_resume(path, settings)
            fd, created = _open_append(path)
        except BaseException:
            if lock is not None:
                lock.release()
            raise
        return cls(path, records, fd, lock, created)

    def done(self) -> set[tuple[str, int, str]]:
        return {key(r) for r in self.records if "error" not in r}

    def saved(self) -> int:
        """How many records the file holds now, counted in the file: a Ctrl-C can land after a line is written
        and before ``records`` knows it (during the fsync, which takes a while)."""
        if self.path is None or not self.path.is_file():
            return len(self.records)
        return sum(1 for line in self.path.read_bytes().split(b"\n")[:-1] if line.strip())

    def write(self, record: Record) -> None:
        """Append ``record`` as one line and fsync it; on failure cut the file back to where the line began."""
        if self._fd is not None:
            data = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
            start = os.fstat(self._fd).st_size
            try:
                self._append(data)
                _sync(self._fd)
            except OSError as exc:
                self._cut(start)
                raise self._write_error(exc) from None
            self.written += 1
        self.records.append(record)

    def _append(self, data: bytes) -> None:
        """Write all of ``data`` (``os.write`` may write less than asked, e.g. as the disk fills)."""
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view):]

    def _cut(self, size: int) -> None:
        """Drop a partly written line; where that fails (a device), the readers drop a partial last line."""
        try:
            os.ftruncate(self._fd, size)
        except OSError:
            pass

    def _write_error(self, exc: OSError) -> ResultsWriteError:
        saved = f"the run stopped with {counted(len(self.records), 'record')} saved"
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            what = "the disk is full" if exc.errno == errno.ENOSPC else "the disk quota is used up"
            return ResultsWriteError(f"--out {self.path}: {what}, so {saved}; free some space and run the same "
                                     f"command with --resume to continue")
        return ResultsWriteError(f"--out {self.path} could not be written ({exc.strerror or type(exc).__name__}), "
                                 f"so {saved}; once it can be written, run the same command with --resume to continue")

    def close(self, failed: bool = False) -> None:
        """Close the file and release its lock; ``failed``: the run stopped with an error (or a Ctrl-C), so a file
        it created and wrote no record to is removed (under the lock, before the lock is let go)."""
        if failed and self.created and self.written == 0 and self._fd is not None:
            self._remove_if_empty()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _remove_if_empty(self) -> None:
        try:
            if os.fstat(self._fd).st_size == 0 and os.path.samestat(os.fstat(self._fd), os.stat(self.path)):
                os.unlink(self.path)
                self.removed = True
        except OSError:
            pass  # gone or not removable: nothing more to do

    def __enter__(self) -> "ResultsFile":
        return self

    def __exit__(self, exc_type, *exc_info) -> None:
        self.close(failed=exc_type is not None)


def _sync(fd: int) -> None:
    """fsync, except on a special file that can't be synced (``/dev/null``: EINVAL), where there is nothing to keep."""
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise


def _open_append(path: Path) -> tuple[int, bool]:
    """An unbuffered append descriptor of ``path``, and whether this call created the file."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
    try:
        try:
            return os.open(path, flags | os.O_EXCL, 0o644), True
        except FileExistsError:
            return os.open(path, flags, 0o644), False
    except OSError as exc:
        raise unwritable(path, exc) from None


def _prepare_resume(path: Path, settings: dict[str, Any]) -> list[Record]:
    """The finished records of ``path``; a partial last line and error records are removed from the file."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InputError(f"--out {path} can't be read to resume ({exc.strerror or type(exc).__name__})") from None
    numbered, end = _numbered_records(data, f"--out {path}")
    check_one_kind([(f"--out {path} line {number}", record) for number, record in numbered])
    records = [record for _, record in numbered]
    for record in records:
        for name in SETTINGS:
            if name in record and name in settings and record[name] != settings[name]:
                raise InputError(other_settings(path, name, record[name], settings[name]))
    kept = [r for r in records if "error" not in r]
    if end != len(data) or len(kept) != len(records):
        _rewrite(path, kept)
    return kept


#: a drafting setting's value when the records do not carry it (it is written only when not the default)
DRAFTING_DEFAULTS = {"compile": False, "gamma_schedule": "constant", "tree_width": 1}
_UNSET = object()


def other_settings(path: Path, name: str, recorded: Any, current: Any) -> str:
    """The line refusing to resume ``path``, whose records were made with setting ``name`` = ``recorded``, with
    ``current``. The drafting settings (one JSON text, ``ensemble``) are compared key by key, so the line names
    the one that differs (``--compile``, ``tree_width``, ``ensemble.members`` ...) instead of quoting the JSON."""
    fix = "resume with the same settings, or choose another --out"
    before, now = (_drafting(recorded), _drafting(current)) if name == "ensemble" else (None, None)
    if before is None or now is None:
        return _differs(path, name, recorded, current, fix)
    if before["compile"] != now["compile"]:
        made, fix = ("with", "add --compile") if before["compile"] else ("without", "drop --compile")
        return f"--out {path} was made {made} --compile; {fix} to resume it, or pass a new --out"
    for key in sorted(set(before) | set(now)):
        old, new = before.get(key, _UNSET), now.get(key, _UNSET)
        if old == new:
            continue
        if _one_each(old, new):  # the heads: one of each kind in both, compared as one mapping each
            old, new = old[0], new[0]
        if isinstance(old, dict) and isinstance(new, dict):  # the one key inside that differs: ensemble.members
            inner = next(k for k in sorted(set(old) | set(new)) if old.get(k, _UNSET) != new.get(k, _UNSET))
            return _differs(path, f"{key}.{inner}", old.get(inner, _UNSET), new.get(inner, _UNSET), fix)
        return _differs(path, key, _kind(old), _kind(new), fix)
    return _differs(path, name, recorded, current, fix)  # the same settings written differently


def _one_each(old: Any, new: Any) -> bool:
    """Whether ``old`` and ``new`` are lists of one mapping each (a run's one head)."""
    return all(isinstance(v, list) and len(v) == 1 and isinstance(v[0], dict) for v in (old, new))


def _drafting(text: Any) -> dict[str, Any] | None:
    """The drafting settings of a record with the defaults of those written only when set; None if unreadable."""
    try:
        settings = json.loads(text) if isinstance(text, str) else None
    except json.JSONDecodeError:
        return None
    return {**DRAFTING_DEFAULTS, **settings} if isinstance(settings, dict) else None


def _kind(value: Any) -> Any:
    """A setting as a line names it: a tree by its kind, anything else as it is."""
    return value["kind"] if isinstance(value, dict) and "kind" in value else value


def _differs(path: Path, name: str, recorded: Any, current: Any, fix: str) -> str:
    if recorded is _UNSET:
        return f"--out {path} holds results made without {name}, but this run sets it to {_shown(current)}; {fix}"
    if current is _UNSET:
        return f"--out {path} holds results made with {name} {_shown(recorded)}, which this run does not set; {fix}"
    return f"--out {path} holds results made with {name} {_shown(recorded)} but this run uses {_shown(current)}; {fix}"


def _shown(value: Any, limit: int = 60) -> str:
    """A setting's value as an error line quotes it: text as it is, anything else as JSON; long ones cut in the
    middle (model paths differ least there)."""
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= limit else text[: limit // 2 - 1] + "..." + text[-(limit // 2 - 2):]


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
