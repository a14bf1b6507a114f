"""Running samples x drafters over one loaded :class:`~mmspec_cli.api.ModelSet`.

Samples run one after the other; within a sample every drafter runs in turn (so drafters
share the machine's conditions sample by sample, which keeps the walltime comparison fair).
Each drafter gets a fresh decoder per sample, and the sample's turns run as ONE conversation
(the engine's multi-turn ``generate``). A record is written as each turn finishes.

A sample's ``history`` (given earlier turns) opens every conversation; its turns are not
generated or recorded, and record turn numbers count the generated turns only.

Resuming: the turns already in the results file are not written again. If a later turn of a
sample is missing, the conversation is re-run from its first turn (the later turn needs the
earlier answers as context) and only the missing turns are written.

A sample that fails (an unreadable image, a prompt that does not fit, CUDA out of memory ...)
gets an error record per drafter and the run goes on. ``MMSPEC_DEBUG=1`` re-raises instead.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from mmspec_cli.api import ModelSet
from mmspec_cli.bench.peers import bench_decoder
from mmspec_cli.bench.progress import BenchProgress
from mmspec_cli.inputs.prompts import continue_prompt, paper_prompt
from mmspec_cli.bench.records import Record, ResultsFile, ResultsWriteError, engine_record, error_record
from mmspec_cli.bench.report import counted
from mmspec_cli.decoding.events import TurnFinished, TurnStarted
from mmspec_cli.errors import InputError, MmspecError
from mmspec_cli.models.prompts import image_placeholder, process
from mmspec_cli.inputs.samples import Sample, load_sample_images, load_turn_images
from mmspec_cli.decoding.conversation import images_shown
from mmspec_cli.choices import HEAD_KINDS, ORACLE, SSD_PLAIN
from mmspec_cli.models.profiles import profile_to_dict

WARMUP_TOKENS = 8


@dataclass(frozen=True)
class RunSettings:
    drafters: tuple[str, ...]
    max_turns: int | None  # --turns
    prompt_style: str  # default | paper
    gamma: int
    max_new_tokens: int
    temperature: float
    target: str = ""
    draft: str | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    ensemble: str = ""  # the profile's drafting settings (ensemble, pooling, a non-constant gamma schedule), as JSON
    threads: int | None = None  # CPU threads torch used (models/threads.py); None: its default (models on a GPU)
    #: an 8-bit target's LLM.int8 outlier threshold (``--int8-threshold``); None: the target is not 8-bit
    int8_threshold: float | None = None

    def record_fields(self) -> dict[str, Any]:
        """The settings each record carries (``--resume`` refuses a file made with others; ``int8_threshold``, null
        for a target that is not 8-bit, is compared where the file's records carry it: files of earlier releases
        do not)."""
        return {"gamma": self.gamma, "temperature": self.temperature, "max_new_tokens": self.max_new_tokens,
                "prompt_style": self.prompt_style, "target": self.target, "draft": self.draft, "top_p": self.top_p,
                "top_k": self.top_k, "seed": self.seed, "ensemble": self.ensemble, "threads": self.threads,
                "int8_threshold": self.int8_threshold}

    def turns(self, sample: Sample) -> int:
        return min(len(sample.turns), self.max_turns or len(sample.turns))


def drafting_settings(profile: Any, names: Sequence[str]) -> dict:
    """The drafting settings every record of a run carries (its ``ensemble`` field, as JSON), which ``--resume``
    compares key by key (bench/records.py ``other_settings``): the ensemble and pooling settings always; the γ
    schedule, the tree, ``--compile``, ssd's settings and the heads only when set or used, so that files made
    before a key existed stay resumable. The heads are those of the head drafters (``choices.HEAD_KINDS``: eagle,
    vispec, eagle3) that run, so a file made with one head is not continued with another."""
    decoding = profile.decoding
    plain = profile_to_dict(profile)
    drafting = {"ensemble": plain["ensemble"], "pooling": plain["pooling"]}
    if decoding.gamma_schedule != "constant":
        drafting["gamma_schedule"] = decoding.gamma_schedule
    if decoding.tree_width != 1:
        drafting["tree_width"] = decoding.tree_width
    if decoding.tree is not None:
        drafting["tree"] = {"kind": decoding.tree, **({"budget": decoding.tree_budget, "depth": decoding.tree_depth,
                                                      "topk": decoding.tree_topk} if decoding.tree == "dynamic" else {})}
    if {"ssd", SSD_PLAIN} & set(names):
        drafting["ssd"] = plain["ssd"]
    if decoding.compile:  # compiled and eager times are not mixed
        drafting["compile"] = True
    heads = [h for h in plain["head"] if h["kind"] in names or h["kind"] is None]
    if heads and set(names) & set(HEAD_KINDS):
        drafting["head"] = heads
    return drafting


def todo(samples: Sequence[Sample], settings: RunSettings, done: set[tuple[str, int, str]]) -> dict[tuple[str, str], list[int]]:
    """(sample id, drafter) -> the turns still to record."""
    out = {}
    for sample in samples:
        for drafter in settings.drafters:
            missing = [t for t in range(settings.turns(sample)) if (sample.id, t, drafter) not in done]
            if missing:
                out[(sample.id, drafter)] = missing
    return out


def check_resumed_history(samples: Sequence[Sample], records: Sequence[Record]) -> None:
    """Refuse to resume records whose conversations opened with another number of given turns
    than these samples' (a changed manifest or suite): their turn numbers mean other turns."""
    given = {s.id: len(s.history) for s in samples}
    for record in records:
        if record["id"] in given and "error" not in record and record.get("history_turns", 0) != given[record["id"]]:
            raise InputError(f"--out holds results of sample '{record['id']}' made after "
                             f"{counted(record.get('history_turns', 0), 'given history turn')}, but this run gives "
                             f"{given[record['id']]}; the manifest or suite changed, so choose another --out")


def failure_message(exc: BaseException) -> str:
    if isinstance(exc, MmspecError):
        return " ".join(str(exc).split())
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


class BenchRunner:
    def __init__(self, models: ModelSet, settings: RunSettings, results: ResultsFile, progress: BenchProgress):
        self.models = models
        self.settings = settings
        self.results = results
        self.progress = progress
        self.debug = os.environ.get("MMSPEC_DEBUG") == "1"
        self.fields = settings.record_fields()

    # ----------------------------------------------------------------- the loop

    def run(self, samples: Sequence[Sample], warmup: bool = True) -> None:
        pending = todo(samples, self.settings, self.results.done())
        warmed = not warmup
        for sample in samples:
            work = {d: pending[(sample.id, d)] for d in self.settings.drafters if (sample.id, d) in pending}
            if not work:
                continue
            try:
                images = load_sample_images(sample)
            except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
                self._fail(sample, work, exc)
                continue
            if not warmed:
                self.warm_up(sample, images)
                warmed = True
            for drafter, turns in work.items():
                self.progress.sample(sample.id, drafter)
                self._run_drafter(sample, images, drafter, turns)

    def _run_drafter(self, sample: Sample, images: list, drafter: str, turns: list[int]) -> None:
        written = 0
        try:
            for record in self.conversation(drafter, sample, images, max(turns) + 1):
                if record["turn"] in turns:
                    self.results.write(record)
                    self.progress.turn_done(record)
                    written += 1
        except ResultsWriteError:
            raise  # the results file is full or broken: nothing more can be recorded, so the run stops
        except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
            self._fail(sample, {drafter: turns[written:]}, exc)

    def _fail(self, sample: Sample, work: dict[str, list[int]], exc: Exception) -> None:
        if self.debug:
            raise exc
        for drafter, turns in work.items():
            self.results.write(error_record(sample, drafter, failure_message(exc)))
            self.progress.skip(len(turns))

    def warm_up(self, sample: Sample, images: list) -> None:
        """One short untimed, unrecorded first turn per drafter: CUDA context, kernels and caches
        get set up here instead of inside the first timed sample."""
        recorded = None  # ar's warm-up output, which oracle replays
        for drafter in self.settings.drafters:
            try:
                generation = self.decoder(drafter, recorded).generate(
                    images, list(sample.turns[:1]), history=sample.history,
                    max_new_tokens=min(WARMUP_TOKENS, self.settings.max_new_tokens))
                if drafter == "ar":
                    recorded = [turn.token_ids for turn in generation.turns]
            except Exception:  # noqa: BLE001 - the real run records the failure
                if self.debug:
                    raise

    def decoder(self, drafter: str, recorded: Any = None) -> Any:
        """A fresh decoder for ``drafter``: the engine's, or a peer's with the same signature (``hf-assisted``);
        ``recorded``: what ``oracle`` replays."""
        return bench_decoder(self.models, drafter, self.settings.gamma, self.settings.max_new_tokens, recorded)

    def recorded_by_ar(self, sample: Sample) -> list[list[int]] | None:
        """``ar``'s token ids of ``sample``'s turns, from its records (this run's or a resumed file's): what
        ``oracle`` replays; None if a turn has no record (``ar`` failed on the sample)."""
        turns = {r["turn"]: r["token_ids"] for r in self.results.records
                 if r.get("id") == sample.id and r.get("drafter") == "ar" and "error" not in r}
        n = self.settings.turns(sample)
        return [turns[t] for t in range(n)] if all(t in turns for t in range(n)) else None

    # ----------------------------------------------------------------- one conversation

    def conversation(self, drafter: str, sample: Sample, images: list, n_turns: int) -> Iterator[Record]:
        """The records of the first ``n_turns`` turns of ``sample`` with ``drafter``, as they finish."""
        recorded = None
        if drafter == ORACLE:
            recorded = self.recorded_by_ar(sample)
            if recorded is None:
                raise InputError("oracle replays ar's output of the sample, and ar has none (it failed)")
        decoder = self.decoder(drafter, recorded)
        if not self._paper(sample):
            brought = load_turn_images(sample, n_turns)
            events = decoder.stream(images, list(sample.turns[:n_turns]), history=sample.history, turn_images=brought)
            yield from self._records(events, drafter, sample, images, decoder.members, brought=brought)
            return
        sample.refuse_turn_images("--prompt-style paper (TABED's one-turn prompts; use --prompt-style default)")
        prompt, answer = None, ""
        base_seed = self.settings.seed
        for turn in range(n_turns):
            prompt = self._raw_prompt(sample, turn, prompt, answer, len(images))
            seed = None if base_seed is None else base_seed + turn  # each turn its own random stream
            events = decoder.stream(images, [], raw_prompt=prompt, seed=seed)
            for record in self._records(events, drafter, sample, images, decoder.members, turn=turn):
                answer = record["text"]
                yield record

    def _paper(self, sample: Sample) -> bool:
        return self.settings.prompt_style == "paper" and sample.prompt_key is not None

    def _raw_prompt(self, sample: Sample, turn: int, previous: str | None, answer: str, n_images: int) -> str:
        """Paper style: the paper's prompt for the conversation's first turn, the LLaVA-1.5 continuation
        after; given ``history`` turns come first, with their answers."""
        eos = self.models.target.tokenizer.eos_token or ""
        if turn == 0:
            questions = [q for q, _ in sample.history] + [sample.turns[0]]
            previous = paper_prompt(sample.prompt_key, questions[0], n_images,
                                    image_placeholder(self.models.target.processor))
            for (_, given), question in zip(sample.history, questions[1:]):
                previous = continue_prompt(previous, given, eos, question)
            return previous
        return continue_prompt(previous, answer, eos, sample.turns[turn])

    def _prompt_tokens(self, text: str, images: list) -> int:
        return len(process(self.models.target.processor, text, images).ids)

    def _records(self, events, drafter: str, sample: Sample, images: list, members: Sequence[str],
                 turn: int | None = None, brought: dict[int, list] | None = None) -> Iterator[Record]:
        """Records of the finished turns; ``brought``: the images later turns bring (their prompts show them)."""
        prompt_tokens = None
        for event in events:
            if isinstance(event, TurnStarted):
                shown = images_shown(images, brought or {}, event.turn)
                prompt_tokens = self._prompt_tokens(event.prompt, shown)  # outside the turn's timed part
            elif isinstance(event, TurnFinished):
                yield engine_record(sample, event.turn if turn is None else turn, drafter, event.result,
                                    prompt_tokens, self.fields, members)
