"""Drafter names -> drafter objects."""

from __future__ import annotations

from ..errors import InputError
from ..models import LoadedModel
from .base import Drafter, NoDrafter
from .single import SingleModelDrafter, multimodal_view, text_only_view

DRAFTER_NAMES = ("ar", "m", "t")


def check_drafter_name(name: str) -> str:
    if name not in DRAFTER_NAMES:
        raise InputError(f"unknown drafter '{name}'; choose one of: {', '.join(DRAFTER_NAMES)}")
    return name


def build_drafter(name: str, target: LoadedModel, draft: LoadedModel | None) -> Drafter:
    check_drafter_name(name)
    if name == "ar":
        return NoDrafter()
    if draft is None:
        raise InputError(f"drafter '{name}' needs a draft model; add a `draft:` section to the profile, or use --drafter ar")
    view = multimodal_view(draft) if name == "m" else text_only_view(draft)
    return SingleModelDrafter(name, draft, view, target_vocab=target.vocab_size)
