"""``mmspec generate``: answer questions about images, showing how each block was verified."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from mmspec_cli.cli.options import Images, ProfileName, Questions, Threads, check_threads, decoding_flags
from mmspec_cli.models.images import load_images
from mmspec_cli.models.profiles import Profile, apply_overrides, load_profile
from mmspec_cli.models.prompts import check_questions


@decoding_flags(drafter=True)
def generate(
    images: Images = None,
    question: Questions = None,
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
    chosen = apply_overrides(load_profile(profile), **overrides)
    threads = check_threads(threads)
    from mmspec_cli.cli.display import is_terminal

    _run(chosen, pictures, questions, raw_prompt, live=is_terminal(sys.stdout) and not no_live, as_json=as_json,
         threads=threads)


def _run(profile: Profile, pictures: list, questions: list[str], raw_prompt: str | None, live: bool,
         as_json: bool, threads: int | None) -> None:
    """Load the models, decode, and show the result in the chosen output mode."""
    from mmspec_cli.cli import display  # the engine pulls in torch and transformers: import only when needed
    from mmspec_cli.api import decoder_from_profile

    from mmspec_cli.models.threads import apply_threads

    decoder = decoder_from_profile(profile, threads=None)  # threads: the CLI's choice, made below
    choice = apply_threads(threads, decoder.target.model)
    if as_json:
        generation = decoder.generate(pictures, questions, raw_prompt)
        typer.echo(json.dumps({**display.generation_json(generation, profile.name), "threads": choice.as_dict()}))
        return
    tokenizer = decoder.target.tokenizer
    view = display.LiveView(tokenizer, members=decoder.drafter.members) if live else display.PlainView(tokenizer)
    with view:
        for event in decoder.stream(pictures, questions, raw_prompt):
            view.handle(event)
