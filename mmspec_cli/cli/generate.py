"""``mmspec generate``: answer questions about images, showing how each block was verified."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from mmspec_cli.cli.options import (Gamma, GammaScheduleName, Images, MaxNewTokens, ProfileName, Questions, Seed,
                                    SsdLayer, TreeWidth, Temperature, TopK, TopP)
from mmspec_cli.models.images import load_images
from mmspec_cli.models.profiles import Profile, apply_overrides, load_profile
from mmspec_cli.models.prompts import check_questions


def generate(
    images: Images = None,
    question: Questions = None,
    profile: ProfileName = None,
    drafter: Annotated[str | None, typer.Option(metavar="NAME", help="Drafter, e.g. m, t, mt, tabed, or ar (no drafting).")] = None,
    gamma: Gamma = None,
    gamma_schedule: GammaScheduleName = None,
    ssd_layer: SsdLayer = None,
    tree_width: TreeWidth = None,
    max_new_tokens: MaxNewTokens = None,
    temperature: Temperature = None,
    top_p: TopP = None,
    top_k: TopK = None,
    seed: Seed = None,
    raw_prompt: Annotated[str | None, typer.Option(metavar="TEXT", help=(
        "The whole prompt of one turn, bypassing the chat template; one <image> per image."))] = None,
    no_live: Annotated[bool, typer.Option("--no-live", help="Print plain text even on a terminal.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object: texts, token ids, blocks, stats.")] = False,
) -> None:
    """Answer questions about images with lossless speculative decoding.

    Flags override the profile; inputs and flag values are checked before any model is loaded.
    """
    pictures = load_images(images or [])
    questions = question or []
    check_questions(questions, raw_prompt)
    chosen = apply_overrides(load_profile(profile), drafter=drafter, gamma=gamma, gamma_schedule=gamma_schedule,
                             ssd_layer=ssd_layer, tree_width=tree_width,
                             max_new_tokens=max_new_tokens,
                             temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    _run(chosen, pictures, questions, raw_prompt, live=sys.stdout.isatty() and not no_live, as_json=as_json)


def _run(profile: Profile, pictures: list, questions: list[str], raw_prompt: str | None, live: bool,
         as_json: bool) -> None:
    """Load the models, decode, and show the result in the chosen output mode."""
    from mmspec_cli.cli import display  # the engine pulls in torch and transformers: import only when needed
    from mmspec_cli.api import decoder_from_profile

    decoder = decoder_from_profile(profile)
    if as_json:
        generation = decoder.generate(pictures, questions, raw_prompt)
        typer.echo(json.dumps(display.generation_json(generation, profile.name)))
        return
    tokenizer = decoder.target.tokenizer
    view = display.LiveView(tokenizer, members=decoder.drafter.members) if live else display.PlainView(tokenizer)
    with view:
        for event in decoder.stream(pictures, questions, raw_prompt):
            view.handle(event)
