"""``mmspec export-head``: write an EAGLE-3 head for vLLM, SGLang or the speculators format, and say how to serve it.

Everything happens in :func:`mmspec_cli.models.eagle3_exports.export_head` (pure layouts, checks, refusals, one atomic
write); this module reads the flags and prints the files written and the command that serves them. ``--to`` is
checked there first, before anything is read; ``--target`` names the target of a head that records none (only its
``config.json`` is read, when it is on this machine), so no model loads.
"""

from __future__ import annotations

from typing import Annotated

import typer


def export_head(
    head: Annotated[str, typer.Argument(metavar="HEAD", show_default=False, help=(
        "An EAGLE-3 head folder: as `mmspec train-head eagle3` writes it, SpecForge's checkpoint, or the speculators "
        "format."))],
    to: Annotated[str, typer.Option(metavar="vllm|sglang|speculators", show_default=False, help=(
        "The layout: vllm (--speculative-config), sglang (--speculative-draft-model-path), or speculators "
        "(`vllm serve DIR`)."))],
    out: Annotated[str, typer.Option(metavar="DIR", show_default=False, help=(
        "A new or empty folder for config.json and model.safetensors (a folder holding any file is refused)."))],
    target: Annotated[str | None, typer.Option(metavar="MODEL", help=(
        "The target's hub id or folder, for a head that does not record it (SpecForge's); its config.json is read "
        "when it is on this machine, nothing is loaded."))] = None,
) -> None:
    """Export an EAGLE-3 head for vLLM, SGLang or the speculators format, and print the command that serves it.

    The target's name and LM-head signature stay in the exported config.json, so mmspec still warns when the export is loaded for another target. Layer ids are written in each engine's convention (vLLM's = mmspec's; SGLang's = mmspec's − 1, only when they differ from its default).
    """
    from mmspec_cli.errors import ModelLoadError
    from mmspec_cli.models.eagle3_exports import export_head as export

    try:
        exported = export(head, to, out, target)
    except ModelLoadError as exc:  # the loader names the profile's key; here the head is the HEAD argument
        message = str(exc)
        raise ModelLoadError("HEAD: " + message[len("head.model: "):] if message.startswith("head.model: ")
                             else message) from None
    for path in exported.files:
        typer.echo(f"wrote {path}")
    typer.echo(f"serve it with:\n  {exported.command}")
    for note in exported.notes:
        typer.echo(f"note: {note}")
