"""What many test modules share: tiny-model profiles and saved test images, the one-line error check, and
a speculative decoder of the tiny models (``speculative_decoder``, ``decode``)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch
import yaml

from typer.testing import CliRunner

from mmspec_cli.cli.app import app
from mmspec_cli.decoding.engine import SpeculativeDecoder
from mmspec_cli.drafters import build_drafter
from mmspec_cli.models.prompts import render_prompt
from tests import tiny

QUESTION = "what is in the image?"
FOLLOW_UP = "and how many shapes are there?"
MAX_NEW = 24
#: Where the shared tiny models (``tests/conftest.py``) and the quantized family load: the CPU, or the device
#: ``MMSPEC_TEST_DEVICE`` names (``cuda`` runs the engine's tests on a GPU; what the tests assert is the same).
DEVICE = os.environ.get("MMSPEC_TEST_DEVICE", "cpu")


def write_profile(path: Path, target: str, draft: str, **decoding) -> str:
    """A float64 CPU profile for the tiny ``target``/``draft`` directories; ``decoding`` keys as given."""
    spec = {"dtype": "float64", "device": "cpu"}
    data = {"target": {"model": target, **spec}, "draft": {"model": draft, **spec}, "decoding": decoding}
    path.write_text(yaml.safe_dump(data))
    return str(path)


def save_images(root: Path, n: int) -> list[str]:
    """``tiny.images(n)`` saved as root/img0.png, root/img1.png, ...; their paths."""
    paths = []
    for i, image in enumerate(tiny.images(n)):
        paths.append(str(root / f"img{i}.png"))
        image.save(paths[-1])
    return paths


def cli(*args: str):
    """``mmspec ARGS`` through typer's runner, its stdout and stderr apart."""
    return CliRunner().invoke(app, list(args))


def tiny_files(root: Path, tiny_dirs: dict, images: int = 2, **decoding) -> dict:
    """The files most CLI tests start from, written to ``root``: ``images`` saved test images (``save_images``) and
    ``profile``, the tiny target with the perturbed draft (``write_profile``, ``decoding`` keys as given)."""
    return {"root": root, "images": save_images(root, images),
            "profile": write_profile(root / "tiny.yaml", tiny_dirs["target"], tiny_dirs["perturbed"], **decoding)}


def one_hot_logits(ids: Sequence[int], vocab: int = 8) -> torch.Tensor:
    """(len(ids), vocab) logits: row i is 5 at ids[i] and −5 elsewhere, so its argmax is ids[i]."""
    logits = torch.full((len(ids), vocab), -5.0)
    logits[torch.arange(len(ids)), torch.tensor(ids)] = 5.0
    return logits


def speculative_decoder(target, drafter, draft=None, gamma: int = 3, max_new_tokens: int = MAX_NEW,
                        build: dict | None = None, **decoding) -> SpeculativeDecoder:
    """A decoder of the loaded ``target`` drafting with ``drafter``: a Drafter, or a drafter name built over the
    loaded ``draft`` by ``build_drafter`` with the ``build`` keywords (ssd_layer, ensemble, captioner, ...).
    ``decoding``: the decoder's other keywords (sampling, tree_width, tree, ...)."""
    if isinstance(drafter, str):
        drafter = build_drafter(drafter, target, draft, **(build or {}))
    return SpeculativeDecoder(target, drafter, gamma=gamma, max_new_tokens=max_new_tokens, **decoding)


def decode(target, drafter, draft=None, n_images: int = 1, questions: Sequence[str] = (QUESTION,), **options):
    """The :func:`speculative_decoder`'s generation (every turn) for ``n_images`` test images and ``questions``."""
    return speculative_decoder(target, drafter, draft, **options).generate(tiny.images(n_images), list(questions))


def assert_one_line_error(result, fragment: str, code: int = 2, stdout_allowed: bool = False,
                          loading_bars: bool = True) -> str:
    """Exit ``code`` and one ``error:`` line on stderr holding ``fragment``, last on stderr, with no traceback and
    no rich box; the line. ``stdout_allowed``: a command that printed results before failing may have stdout.
    ``loading_bars``: transformers' "Loading weights" progress lines may come before it. ``warning:`` and
    ``note:`` lines (a busy machine; profile-latency's notice that it compiles) may come before it too."""
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr, result.exception)
    if not stdout_allowed:
        assert result.stdout == ""
    [line] = [line for line in result.stderr.splitlines()  # a "warning:" or a "note:" may come first
              if line and not line.startswith(("warning: ", "note: "))
              and not (loading_bars and line.startswith("Loading weights"))]
    assert line.startswith("error: ") and fragment in line, line
    assert result.stderr.endswith(line + "\n")
    assert "Traceback" not in result.stderr and "╭" not in result.stderr
    return line


def own_generate(target, questions: Sequence[str], answers: Sequence[str], counts: int | Sequence[int],
                 images: Sequence, max_new_tokens: int = MAX_NEW) -> list[int]:
    """THE reference of every greedy test: the target's own ``generate(do_sample=False)`` on the prompt mmspec builds
    for the turn after ``answers``, its user turns showing ``counts`` of ``images`` in order (an int: all of them in
    the first turn), the images passed as one sample, as ``apply_chat_template(tokenize=True)`` passes them."""
    text = render_prompt(target.processor, questions, answers, counts if isinstance(counts, int) else list(counts))
    return generate_from_text(target, text, images, max_new_tokens)


def generate_from_text(target, text: str, images: Sequence, max_new_tokens: int = MAX_NEW) -> list[int]:
    """The target's own ``generate(do_sample=False)`` on ``text`` as given (a rendered or a raw prompt) with
    ``images`` as one sample: the new token ids."""
    inputs = target.processor(images=[list(images)] if images else None, text=text, return_tensors="pt")
    inputs = inputs.to(target.model.device)
    out = target.model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def uncached_forward(model, ids: Sequence[int], vision: dict, **options):
    """ONE forward of ``model`` over ``ids`` without a cache, with a prompt's ``vision`` inputs (floating ones in the
    model's dtype), on the model's device: the from-scratch reference that tests of cached drafting compare with."""
    inputs = {k: v.to(model.device, model.dtype) if v.is_floating_point() else v.to(model.device)
              for k, v in vision.items()}
    return model(input_ids=torch.tensor([list(ids)], device=model.device), **inputs, **options)


def reference(target, questions: Sequence[str], answers: Sequence[str], n_images: int,
              max_new_tokens: int = MAX_NEW) -> list[int]:
    """:func:`own_generate` over ``n_images`` of the tiny test images."""
    return own_generate(target, questions, answers, n_images, tiny.images(n_images), max_new_tokens)


def image_in_second_turn(target, drafter, draft, opening: Sequence, brought: Sequence, max_new_tokens: int = MAX_NEW,
                         **options) -> tuple[list[list[int]], list[list[int]]]:
    """Two turns, the second bringing ``brought`` after ``opening``: mmspec's token ids of each turn, and the
    target's own ``generate`` of each turn's prompt."""
    decoder = speculative_decoder(target, drafter, draft, gamma=options.pop("gamma", 4),
                                  max_new_tokens=max_new_tokens, **options)
    first, second = decoder.generate(list(opening), [QUESTION, FOLLOW_UP], turn_images={1: list(brought)}).turns
    own = [own_generate(target, [QUESTION], [], [len(opening)], opening, max_new_tokens),
           own_generate(target, [QUESTION, FOLLOW_UP], [first.text], [len(opening), len(brought)],
                        list(opening) + list(brought), max_new_tokens)]
    return [first.token_ids, second.token_ids], own


def begin_turn(decoder: SpeculativeDecoder, text: str, images: Sequence, room: int = 64) -> None:
    """The engine's turn start, for a test that drives ``decoder``'s drafter by hand: the drafter is given the turn
    with the decoder's cached target, and the block's next verification feeds the prompt."""
    from mmspec_cli.decoding.drafter import TurnStart
    from mmspec_cli.models.prompts import process

    decoder.step.begin_turn()
    prompt = process(decoder.target.processor, text, images)
    decoder.drafter.begin_turn(TurnStart(text, images, decoder.cached_target, room, prompt))


def after_block(decoder: SpeculativeDecoder, prompt, verified: list[int], kept: int = 0) -> None:
    """What a block leaves for the next one, for a test that drives a drafter by hand: the drafter keeps ``kept`` of
    its drafts, and the target holds the prompt and every ``verified`` token but the last."""
    from mmspec_cli.decoding.drafter import Kept

    decoder.drafter.roll_back(Kept(kept))
    decoder.cached_target.hold(prompt.ids + verified[:-1], vision=prompt.vision, prompt_len=len(prompt.ids))
    decoder.step.prompt_fed = True


def chain(gamma: int):
    """A block's request for a chain of ``gamma`` tokens."""
    from mmspec_cli.decoding.drafter import DraftShape

    return DraftShape(gamma)
