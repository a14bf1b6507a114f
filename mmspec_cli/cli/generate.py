"""``mmspec generate``: answer questions about images, showing how each block was verified."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from mmspec_cli.choices import ORACLE
from mmspec_cli.decoding.conversation import RAW_PROMPT_WITH_TURN_IMAGES
from mmspec_cli.errors import InputError
from mmspec_cli.cli.options import (Images, ProfileName, Questions, Threads, TurnImages, check_threads, decoding_flags,
                                    parse_turn_images, step_costs)
from mmspec_cli.models.images import load_images
from mmspec_cli.models.profiles import Profile, apply_overrides, load_profile
from mmspec_cli.models.prompts import check_questions


@decoding_flags(drafter=True)
def generate(
    images: Images = None,
    question: Questions = None,
    turn_image: TurnImages = None,
    profile: ProfileName = None,
    raw_prompt: Annotated[str | None, typer.Option(metavar="TEXT", help=(
        "The whole prompt of one turn, bypassing the chat template; one <image> per image."))] = None,
    no_live: Annotated[bool, typer.Option("--no-live", help="Print plain text even on a terminal.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object: texts, token ids, blocks, stats.")] = False,
    threads: Threads = None,
    *,
    overrides: dict,
) -> None:
    """Answer questions about images with lossless speculative decoding.

    Flags override the profile; inputs and flag values are checked before any model is loaded.
    """
    pictures = load_images(images or [])
    questions = question or []
    check_questions(questions, raw_prompt)
    if turn_image and raw_prompt is not None:
        raise InputError(RAW_PROMPT_WITH_TURN_IMAGES)
    brought = {index: load_images(paths) for index, paths in parse_turn_images(turn_image, len(questions)).items()}
    chosen = apply_overrides(load_profile(profile), **overrides)
    threads = check_threads(threads)
    from mmspec_cli.cli.display import is_terminal

    _run(chosen, pictures, questions, raw_prompt, live=is_terminal(sys.stdout) and not no_live, as_json=as_json,
         threads=threads, turn_images=brought)


def _run(profile: Profile, pictures: list, questions: list[str], raw_prompt: str | None, live: bool,
         as_json: bool, threads: int | None, turn_images: dict[int, list] | None = None) -> None:
    """Load the models, decode, and show the result in the chosen output mode."""
    from mmspec_cli.cli import display  # the engine pulls in torch and transformers: import only when needed
    from mmspec_cli.api import decoder_from_profile

    from mmspec_cli.models.threads import apply_threads

    display.forget_compiling()
    if profile.drafter == ORACLE:
        decoder, choice = _oracle_decoder(profile, pictures, questions, raw_prompt, threads, turn_images)
    else:
        decoder = decoder_from_profile(profile, threads=None)  # threads: the CLI's choice, made below
        choice = apply_threads(threads, decoder.target.model)
        costs = step_costs(profile, [profile.drafter], decoder.target.model.device, threads)  # after the threads
        decoder.step_costs = costs.get(profile.drafter)
    if as_json:
        generation = decoder.generate(pictures, questions, raw_prompt, turn_images=turn_images)
        quantized = {} if decoder.target.int8_threshold is None else {"int8_threshold": decoder.target.int8_threshold}
        typer.echo(json.dumps({**display.generation_json(generation, profile.name), "threads": choice.as_dict(),
                               **quantized}))
    else:
        tokenizer, model = decoder.target.tokenizer, display.model_note(decoder.target)
        view = display.LiveView(tokenizer, members=decoder.members, model=model) if live else \
            display.PlainView(tokenizer, model=model)
        with view:
            for event in decoder.stream(pictures, questions, raw_prompt, turn_images=turn_images):
                view.handle(event)
    display.report_compiling()


def _oracle_decoder(profile: Profile, pictures: list, questions: list[str], raw_prompt: str | None,
                    threads: int | None, turn_images: dict[int, list] | None = None):
    """``--drafter oracle`` (a benchmark tool): a first ``ar`` run records the target's output, untimed and not
    shown; the oracle then replays it (``drafters/oracle.py``)."""
    import time

    from mmspec_cli.api import ModelSet, recorded_by_ar
    from mmspec_cli.models.threads import apply_threads

    models = ModelSet.load(profile, ["ar", ORACLE], threads=None)
    choice = apply_threads(threads, models.target.model)
    start = time.perf_counter()
    recorded = recorded_by_ar(models, pictures, questions, raw_prompt, turn_images=turn_images)
    typer.echo(f"note: oracle replays the target's output of a first ar run ({sum(map(len, recorded))} tokens in "
               f"{time.perf_counter() - start:.1f} s, not counted); it is a benchmark tool", err=True)
    costs = step_costs(profile, [ORACLE], models.target.model.device, threads).get(ORACLE)
    return models.decoder(ORACLE, recorded=recorded, step_costs=costs), choice
