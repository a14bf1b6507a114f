"""Training data: the target's own answers to the prompts of SOURCE, stored as JSONL (ViSpec §4.3).

ViSpec asks the target itself for long answers: each prompt gets :data:`LONG_ANSWER_SUFFIX`
appended ("Please answer with at least 1000 words.", ViSpec App., "Generation Prompts") and
the target answers it, sampled at a temperature, so that the head sees the target's own
continuations and the sampling breaks the one-to-one link between a hidden state and the next
token (ViSpec §4.3, Fig. 4). The suffix is a setting: the demo target was trained on short
answers and does not understand it, so the demo heads use none.

The file (``DIR.answers.jsonl`` beside the head's folder) starts with one header line holding the
settings, then one record per answered turn::

    {"id": "cat-1", "turn": 0, "prompt": "<the rendered prompt>", "answer_ids": [...], "eos": true, "error": null,
     "images": "<fingerprint of the images>"}

A conversation whose images can't be read (or whose prompt does not fit the context) gets one
record with ``error`` set and no answer, and is skipped. Records are appended batch by batch
(:func:`mmspec_cli.models.writing.append_durably`: a full disk cuts the file back to its last whole
record), so a killed generation resumes where it stopped and a second training reuses the answers.

**What is reused.** An answer is reused only while it is still the answer to the same input: its
record's prompt is the prompt rendered now (the question, the suffix, the history and the earlier
answers unchanged) and its images have the same content (:func:`.corpus.fingerprint`). Otherwise
the turn is answered again and the new record, appended, replaces the old one. A failed turn is
tried again on every run (its image may have been fixed); the same failure is not recorded twice.

Sampling is batched (``batch_size`` prompts, left-padded, one target forward per token) and
deterministic: each batch is a fixed slice of the conversations with its own seeded generator, so
a resumed run draws exactly what an uninterrupted one would have. Later turns of a conversation
are asked after its earlier turns' answers, one batch round per turn.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from mmspec_cli.decoding.engine import check_context, eos_ids
from mmspec_cli.errors import InputError, MmspecError
from mmspec_cli.models.loading import LoadedModel
from mmspec_cli.models.families import family_of
from mmspec_cli.models.prompts import ModelPrompt, process, render_prompt, shorten
from mmspec_cli.models.target_identity import canonical_name
from mmspec_cli.training.corpus import Conversation
from mmspec_cli.models.writing import WriteFailed, append_durably
from mmspec_cli.models.parts import with_cache

LONG_ANSWER_SUFFIX = "Please answer with at least 1000 words."  # ViSpec's data generation prompt
DEFAULT_TEMPERATURE = 1.0  # sampled, as ViSpec §4.3 argues (its released script decodes greedily)
DEFAULT_MAX_NEW_TOKENS = 1024  # ViSpec's data generation limit
FORMAT = 1


@dataclass(frozen=True)
class AnswerSettings:
    """How the target answers: ``temperature`` (0: greedy), at most ``max_new_tokens`` each, ``suffix``
    appended to every question, ``seed`` for the sampling, ``batch_size`` prompts per forward."""

    temperature: float = DEFAULT_TEMPERATURE
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    suffix: str = LONG_ANSWER_SUFFIX
    seed: int = 0
    batch_size: int = 16


@dataclass(frozen=True)
class Answer:
    """One answered turn (``error`` set: not answered, skipped); ``images`` the fingerprint of its images."""

    id: str
    turn: int
    prompt: str
    answer_ids: list[int]
    eos: bool
    error: str | None = None
    images: str | None = None  # None in files written before fingerprints: such answers are never reused


def answers_path(out: Path) -> Path:
    """``DIR.answers.jsonl`` beside the output folder ``DIR``."""
    return out.with_name(out.name + ".answers.jsonl")


def asked(question: str, suffix: str) -> str:
    return f"{question} {suffix}" if suffix else question


def prompt_text(processor: Any, conversation: Conversation, turn: int, earlier: Sequence[str], suffix: str,
                n_images: int) -> str:
    """The prompt of ``turn``: the history, then every question so far (each with the suffix) after the
    target's ``earlier`` answers, rendered as the engine renders a conversation (of its ``n_images`` images, each
    in the user turn that shows it: :meth:`Conversation.image_counts`)."""
    questions = [asked(q, suffix) for q in conversation.turns[:turn + 1]]
    return render_prompt(processor, questions, list(earlier), conversation.image_counts(n_images),
                         conversation.history)


class AnswerFile:
    """The JSONL file: its header checked against the settings, the records read back, new ones appended."""

    def __init__(self, path: Path, settings: AnswerSettings, target: str):
        self.path = path
        self.header = {"mmspec_answers": FORMAT, "target": canonical_name(target), **asdict(settings)}  # the batch size too: it
        # decides which prompts share a generator
        self.records: dict[tuple[str, int], Answer] = {}
        if path.is_file() and path.stat().st_size > 0:
            self._read()

    def _read(self) -> None:
        try:
            lines = self.path.read_text(encoding="utf-8").splitlines()
            header = json.loads(lines[0])
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, IndexError):
            header = None
        if not isinstance(header, dict) or header.get("mmspec_answers") != FORMAT:
            raise InputError(f"{shorten(str(self.path))} is not an answers file of mmspec train-head; "
                             f"move it away or pick another --out (or --answers)")
        if isinstance(header.get("target"), str):  # written as given by older versions: compare as the same target
            header["target"] = canonical_name(header["target"])
        if header != self.header:
            diff = ", ".join(f"{k} {header.get(k)!r} (now {v!r})" for k, v in self.header.items() if header.get(k) != v)
            raise InputError(f"{shorten(str(self.path))} holds answers generated with other settings ({diff}); "
                             f"delete it to generate them again, or train with its settings")
        for number, line in enumerate(lines[1:], start=2):
            try:
                record = Answer(**json.loads(line))
            except (json.JSONDecodeError, TypeError):
                if number == len(lines):  # a line cut off by a kill: generated again
                    self._truncate(len(lines) - 1, lines)
                    break
                raise InputError(f"{shorten(str(self.path))} line {number} is not an answer record; "
                                 f"delete the file to generate the answers again") from None
            self.records[(record.id, record.turn)] = record

    def _truncate(self, keep: int, lines: list[str]) -> None:
        self.path.write_text("".join(line + "\n" for line in lines[:keep]), encoding="utf-8")

    def current(self, key: tuple[str, int], prompt: str, images: str) -> bool:
        """Whether the stored answer of ``key`` answers this prompt about these images (module doc)."""
        record = self.records.get(key)
        return (record is not None and record.error is None and record.prompt == prompt
                and record.images == images)

    def answered(self) -> int:
        """How many records hold an answer."""
        return sum(r.error is None for r in self.records.values())

    def append(self, records: Sequence[Answer]) -> None:
        """Append ``records`` (a failure already recorded as it is, is not recorded again)."""
        records = [r for r in records if r.error is None or self.records.get((r.id, r.turn)) != r]
        if not records:
            return
        new = not self.path.is_file() or self.path.stat().st_size == 0
        lines = ([json.dumps(self.header)] if new else []) + [json.dumps(asdict(r)) for r in records]
        try:
            append_durably(self.path, "".join(line + "\n" for line in lines).encode("utf-8"))
        except WriteFailed as exc:
            kept = self.answered()
            raise WriteFailed(exc.path, f"{exc.reason}; the {kept} answer{'s' if kept != 1 else ''} written before "
                                        f"are kept and reused: free some space and run the same command "
                                        f"again") from None
        for record in records:
            self.records[(record.id, record.turn)] = record


def _batch_seed(seed: int, turn: int, batch: int) -> int:
    return ((seed * 1_000_003 + turn) * 1_000_003 + batch) % (2**63 - 1)


@torch.inference_mode()
def sample_batch(target: LoadedModel, prompts: Sequence[ModelPrompt], temperature: float, max_new_tokens: int,
                 generator: torch.Generator) -> list[list[int]]:
    """The target's answers to ``prompts`` in one batch: left-padded, cached, one forward per token,
    each token drawn from softmax(logits / temperature) (the argmax at temperature 0); cut after EOS."""
    model = target.model
    device = model.device
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    stops = eos_ids(target)
    width = max(len(p.ids) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt.ids):] = torch.tensor(prompt.ids)
        mask[row, width - len(prompt.ids):] = 1
    vision: dict[str, torch.Tensor] = {}
    for key in {k for p in prompts for k in p.vision} - {"mm_token_type_ids"}:  # per row: positions say it below
        vision[key] = torch.cat([p.vision[key] for p in prompts if key in p.vision]).to(device)
        if vision[key].is_floating_point():
            vision[key] = vision[key].to(model.dtype)
    ids, mask = ids.to(device), mask.to(device)
    positions, _ = family_of(model).batch_positions(model, [(p.ids, p.vision) for p in prompts], width,
                                                    device)  # (B, L), or (3, B, L) for M-RoPE
    cache = DynamicCache(config=model.config)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, **with_cache(cache),
                   use_cache=True, logits_to_keep=1, **vision).logits[:, -1]
    answers: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    for step in range(max_new_tokens):
        if temperature > 0:
            probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)
            tokens = torch.multinomial(probs, 1, generator=generator)[:, 0]
        else:
            tokens = logits.float().argmax(-1).cpu()
        for row, token in enumerate(tokens.tolist()):
            if not done[row]:
                answers[row].append(token)
                done[row] = token in stops
        if all(done) or step == max_new_tokens - 1:
            break
        mask = torch.cat([mask, torch.ones((len(prompts), 1), dtype=mask.dtype, device=device)], dim=1)
        positions = positions[..., -1:] + 1  # the next position of each row, on every axis
        logits = model(input_ids=tokens[:, None].to(device), attention_mask=mask, position_ids=positions,
                       **with_cache(cache), use_cache=True).logits[:, -1]
    return answers


def generate_answers(target: LoadedModel, target_name: str, conversations: Sequence[Conversation], path: Path,
                     settings: AnswerSettings, advance: Callable[[int], None] = lambda n: None) -> list[Answer]:
    """Answer every turn of ``conversations`` whose stored answer is missing or stale (module doc), append them
    to ``path``, return all records in conversation and turn order. ``advance(n)`` is told of every n turns done
    (or skipped)."""
    store = AnswerFile(path, settings, target_name)
    rounds = max(len(c.turns) for c in conversations)
    order: list[tuple[str, int]] = []
    failed: set[str] = set()
    for turn in range(rounds):
        items = [c for c in conversations if len(c.turns) > turn and c.id not in failed]
        for start in range(0, len(items), settings.batch_size):
            batch = items[start:start + settings.batch_size]
            asked = {c.id: _asked(target, store, c, turn, settings) for c in batch}
            missing = [c for c in batch if not (isinstance(asked[c.id], tuple)
                                                and store.current((c.id, turn), *asked[c.id]))]
            if missing:
                store.append(_answer_batch(target, batch, missing, turn, asked, settings,
                                           _batch_seed(settings.seed, turn, start // settings.batch_size)))
            advance(len(batch))
            for c in batch:
                order.append((c.id, turn))
                if store.records[(c.id, turn)].error is not None:
                    failed.add(c.id)
    return [store.records[key] for key in order]


def _asked(target: LoadedModel, store: AnswerFile, conversation: Conversation, turn: int,
           settings: AnswerSettings) -> tuple[str, str] | Answer:
    """What ``turn`` of ``conversation`` asks now: (prompt text, images' fingerprint), without decoding an image
    where the conversation can say so; or the failure record when its images can't be read."""
    try:
        n_images, images = conversation.images()
    except MmspecError as exc:
        return Answer(conversation.id, turn, "", [], False, str(exc))
    earlier = [target.tokenizer.decode(store.records[(conversation.id, t)].answer_ids, skip_special_tokens=True).strip()
               for t in range(turn)]
    return prompt_text(target.processor, conversation, turn, earlier, settings.suffix, n_images), images


def _answer_batch(target: LoadedModel, batch: Sequence[Conversation], missing: Sequence[Conversation], turn: int,
                  asked: dict[str, tuple[str, str] | Answer], settings: AnswerSettings, seed: int) -> list[Answer]:
    """Records of ``missing``. The batch is sampled again as a whole (its generator depends on all of it), unless
    none of ``missing`` can be asked (their images fail again): then only their failures are returned."""
    prepared: dict[str, tuple[str, str, ModelPrompt] | Answer] = {}

    def prepare(conversation: Conversation) -> None:
        ask = asked[conversation.id]
        if isinstance(ask, Answer):
            prepared[conversation.id] = ask
            return
        text, images = ask
        try:
            prompt = process(target.processor, text, conversation.shown(conversation.load_images(), turn))
            check_context(target.model.config, len(prompt.ids), settings.max_new_tokens,
                          limit_flag="--answer-tokens")
        except MmspecError as exc:
            prepared[conversation.id] = Answer(conversation.id, turn, text, [], False, str(exc), images)
            return
        prepared[conversation.id] = (text, images, prompt)

    for conversation in missing:
        prepare(conversation)
    if all(isinstance(prepared[c.id], Answer) for c in missing):
        return [prepared[c.id] for c in missing]
    for conversation in batch:
        if conversation.id not in prepared:
            prepare(conversation)
    ready = [(c, prepared[c.id]) for c in batch if not isinstance(prepared[c.id], Answer)]
    generator = torch.Generator().manual_seed(seed)
    outputs = sample_batch(target, [p for _, (_, _, p) in ready], settings.temperature, settings.max_new_tokens,
                           generator)
    stops = eos_ids(target)
    for (c, (text, images, _)), out in zip(ready, outputs):
        prepared[c.id] = Answer(c.id, turn, text, out, bool(out) and out[-1] in stops, None, images)
    return [prepared[c.id] for c in missing]
