"""Peers: decoders other than mmspec's engine, benchmarked as rows beside its drafters.

A peer has the engine's conversation signature: ``stream``/``generate`` over images and
questions (or a one-turn ``raw_prompt``), with ``history``, ``max_new_tokens`` and ``seed`` per
call, yielding :class:`TurnStarted`/:class:`TurnFinished` events. The bench runner therefore
treats it like any drafter's :class:`~mmspec_cli.decoding.engine.SpeculativeDecoder`.

``hf-assisted``: Hugging Face assisted generation (:mod:`.hf_assisted`), greedy, constant γ.
Importing this module imports no torch (the CLI checks profiles with it before loading).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from typing import Any

from mmspec_cli.choices import HF_ASSISTED
from mmspec_cli.decoding.conversation import conversation
from mmspec_cli.decoding.events import Event, Generation, TurnResult, collect
from mmspec_cli.decoding.metrics import RunStats
from mmspec_cli.errors import InputError


class HfAssistedPeer:
    """``target.generate(assistant_model=draft)`` turn by turn; blocks = target forward calls."""

    name = HF_ASSISTED
    members: tuple[str, ...] = ()

    def __init__(self, target: Any, draft: Any, gamma: int, max_new_tokens: int,
                 repetition_penalty: float | None = None):
        self.target, self.draft = target, draft
        self.gamma, self.max_new_tokens = gamma, max_new_tokens
        self.repetition_penalty = repetition_penalty  # the profile's override; None: the target's generation_config

    @staticmethod
    def check_models(target: Any, draft: Any) -> None:
        """Refuse a language-only draft with the target's vocabulary size: transformers then runs plain assisted
        decoding and hands the target's image inputs to the language model, which refuses them (5.24), and with
        both tokenizers it refuses universal assisted decoding for one tokenizer. (Sizes that differ run as
        universal assisted decoding: :func:`~.hf_assisted.assisted_generate`.)"""
        if draft.language_only and target.vocab_size == draft.vocab_size:
            raise InputError(f"hf-assisted can't run the language-only draft '{draft.name}' beside this target: "
                             f"transformers hands it the target's image inputs; drop hf-assisted, or use a "
                             f"vision-language draft")

    @staticmethod
    def check_profile(profile: Any) -> None:
        """Refuse, before any model loads, settings assisted generation does not have."""
        if profile.decoding.temperature != 0:
            raise InputError("hf-assisted runs greedy only; use --temperature 0 or drop hf-assisted")
        decoding = profile.decoding
        if decoding.tree_width != 1 or decoding.tree not in (None, "chain") or decoding.gamma_schedule != "constant":
            raise InputError("hf-assisted drafts a constant-γ chain; drop --tree/--tree-width/--gamma-schedule "
                             "(or decoding.tree/tree_width/gamma_schedule) or drop hf-assisted")

    def generate(self, images: Sequence[Any], questions: Sequence[str], raw_prompt: str | None = None,
                 on_event: Callable[[Event], None] | None = None, history: Sequence[tuple[str, str]] = (),
                 max_new_tokens: int | None = None, seed: int | None = None,
                 turn_images: Mapping[int, Sequence[Any]] | None = None) -> Generation:
        return collect(self.stream(images, questions, raw_prompt, history, max_new_tokens, seed, turn_images),
                       self.name, self.members, on_event)

    def stream(self, images: Sequence[Any], questions: Sequence[str], raw_prompt: str | None = None,
               history: Sequence[tuple[str, str]] = (), max_new_tokens: int | None = None,
               seed: int | None = None, turn_images: Mapping[int, Sequence[Any]] | None = None) -> Iterator[Event]:
        """Greedy, so ``seed`` changes nothing; each turn's prompt is rendered as the engine renders it."""
        limit = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        return conversation(self.target.processor, images, questions, raw_prompt, history,
                            lambda turn, question, text, shown: self._turn(question, text, shown, limit), turn_images)

    def _turn(self, question: str, text: str, images: Sequence[Any], limit: int) -> Generator[Event, None, TurnResult]:
        from mmspec_cli.bench.hf_assisted import assisted_generate  # torch: only when a peer runs

        yield from ()  # no events inside a turn: HF reports no blocks
        out = assisted_generate(self.target, self.draft, images, text, self.gamma, limit, self.repetition_penalty)
        stats = RunStats(new_tokens=len(out.token_ids), blocks=out.target_calls, drafted=0, accepted=0,
                         wall_s=out.wall_s)
        return TurnResult(question=question, text=out.text, token_ids=out.token_ids, stats=stats)


#: Peer name -> class; every other bench name is a drafter of the engine.
PEERS = {HF_ASSISTED: HfAssistedPeer}


def bench_decoder(models: Any, name: str, gamma: int, max_new_tokens: int, recorded: Any = None) -> Any:
    """A fresh decoder for a bench row: a peer by its name, else the engine with drafter ``name`` (``recorded``:
    what ``oracle`` replays, ``ar``'s token ids per turn)."""
    peer = PEERS.get(name)
    if peer is None:
        return models.decoder(name, recorded=recorded)
    return peer(models.target, models.draft, gamma, max_new_tokens, models.profile.decoding.repetition_penalty)
