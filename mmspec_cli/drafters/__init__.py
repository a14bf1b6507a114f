"""Drafting methods, one module each, behind the :class:`Drafter` interface."""

from .base import EMPTY_DRAFT, Draft, Drafter, NoDrafter
from .registry import DRAFTER_NAMES, build_drafter, check_drafter_name, parse_drafter

__all__ = ["Draft", "Drafter", "NoDrafter", "EMPTY_DRAFT", "DRAFTER_NAMES", "build_drafter", "check_drafter_name", "parse_drafter"]
