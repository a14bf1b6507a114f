"""A conversation, turn by turn: each turn's prompt rendered from the questions and the answers so far.

Shared by the engine and by bench's peers (``bench/peers.py``), so every decoder renders a
turn's prompt the same way and reports it with the same events.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from typing import Any

from mmspec_cli.decoding.events import Event, TurnFinished, TurnResult, TurnStarted
from mmspec_cli.errors import InputError
from mmspec_cli.models.prompts import check_history, check_questions, check_raw_prompt, render_prompt

#: Runs one turn (turn number, question, prompt text, the images its prompt shows, in order): yields the turn's
#: own events, returns its result.
TurnRunner = Callable[[int, str, str, list], Generator[Event, None, TurnResult]]


def conversation(processor: Any, images: Sequence[Any], questions: Sequence[str], raw_prompt: str | None,
                 history: Sequence[tuple[str, str]], run_turn: TurnRunner,
                 turn_images: Mapping[int, Sequence[Any]] | None = None) -> Iterator[Event]:
    """Yield TurnStarted, the turn's events and TurnFinished for every turn.

    ``raw_prompt`` (one turn) replaces the chat template; ``history`` holds earlier (question,
    answer) turns given as they are, not generated. ``images`` open the conversation (in its first
    user turn, history's if any); ``turn_images`` maps a question's index in ``questions`` to the
    images it brings, shown in its own user turn after everything before. Each turn's prompt shows
    the images so far, in order. Inputs are checked when the first event is asked for.
    """
    questions = check_questions(questions, raw_prompt)
    history = check_history(history, raw_prompt)
    turn_images = check_turn_images(turn_images, len(questions), raw_prompt)
    if raw_prompt is not None:
        check_raw_prompt(raw_prompt, processor, len(images))
    counts = images_per_user_turn(len(images), turn_images, len(history), len(questions))
    answers: list[str] = []
    for turn, question in enumerate(questions):
        shown = images_shown(images, turn_images, turn)
        text = raw_prompt if raw_prompt is not None else render_prompt(processor, questions, answers, counts, history)
        yield TurnStarted(turn=turn, question=question, prompt=text)
        result = yield from run_turn(turn, question, text, shown)
        answers.append(result.text)
        yield TurnFinished(turn=turn, result=result)


#: Why turn images and ``--raw-prompt`` don't go together (the CLI refuses them before loading, the engine again).
RAW_PROMPT_WITH_TURN_IMAGES = ("--raw-prompt gives one turn with its images; drop --turn-image, or give the images "
                               "as arguments")


def images_per_user_turn(opening: int, turn_images: Mapping[int, Sequence[Any]], history: int,
                         questions: int) -> list[int]:
    """How many images each user turn shows (``render_prompt``'s ``n_images``): the ``opening`` ones in the first
    (history's, if any), then each question's own (``turn_images``: question index -> the images it brings)."""
    counts = [0] * (history + questions)
    counts[0] += opening
    for index, brought in turn_images.items():
        counts[history + index] += len(brought)
    return counts


def images_shown(images: Sequence[Any], turn_images: Mapping[int, Sequence[Any]], turn: int) -> list:
    """The images turn ``turn``'s prompt shows, in order: the opening ones, then those each turn up to it brought."""
    return list(images) + [image for index in sorted(turn_images) if index <= turn for image in turn_images[index]]


def check_turn_images(turn_images: Mapping[int, Sequence[Any]] | None, questions: int,
                      raw_prompt: str | None) -> dict[int, list]:
    """``turn_images`` as {question index: images}, each index one of the questions'; refused with ``raw_prompt``."""
    if not turn_images:
        return {}
    if raw_prompt is not None:
        raise InputError(RAW_PROMPT_WITH_TURN_IMAGES)
    checked = {}
    for index, brought in turn_images.items():
        if not isinstance(index, int) or not 0 <= index < questions:
            raise InputError(f"an image is given for question {index + 1 if isinstance(index, int) else index!r}, "
                             f"but there {'is' if questions == 1 else 'are'} {questions} question"
                             f"{'s' * (questions != 1)} (-q); number the question from 1, as in --turn-image 2:PATH")
        checked[index] = list(brought)
    return checked
