"""A conversation, turn by turn: each turn's prompt rendered from the questions and the answers so far.

Shared by the engine and by bench's peers (``bench/peers.py``), so every decoder renders a
turn's prompt the same way and reports it with the same events.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any

from mmspec_cli.decoding.events import Event, TurnFinished, TurnResult, TurnStarted
from mmspec_cli.models.prompts import check_history, check_questions, check_raw_prompt, render_prompt

#: Runs one turn (turn number, question, prompt text): yields the turn's own events, returns its result.
TurnRunner = Callable[[int, str, str], Generator[Event, None, TurnResult]]


def conversation(processor: Any, images: Sequence[Any], questions: Sequence[str], raw_prompt: str | None,
                 history: Sequence[tuple[str, str]], run_turn: TurnRunner) -> Iterator[Event]:
    """Yield TurnStarted, the turn's events and TurnFinished for every turn.

    ``raw_prompt`` (one turn) replaces the chat template; ``history`` holds earlier (question,
    answer) turns given as they are, not generated, the images belonging to its first turn.
    Inputs are checked when the first event is asked for.
    """
    questions = check_questions(questions, raw_prompt)
    history = check_history(history, raw_prompt)
    if raw_prompt is not None:
        check_raw_prompt(raw_prompt, processor, len(images))
    answers: list[str] = []
    for turn, question in enumerate(questions):
        text = raw_prompt if raw_prompt is not None else render_prompt(processor, questions, answers, len(images),
                                                                       history)
        yield TurnStarted(turn=turn, question=question, prompt=text)
        result = yield from run_turn(turn, question, text)
        answers.append(result.text)
        yield TurnFinished(turn=turn, result=result)
