"""Drafting methods, one module each, behind the :class:`Drafter` interface."""

from mmspec_cli.drafters.base import EMPTY_DRAFT, Draft, Drafter, NoDrafter
from mmspec_cli.drafters.registry import build_drafter, parse_drafter, parse_drafter_list

__all__ = ["Draft", "Drafter", "NoDrafter", "EMPTY_DRAFT", "build_drafter", "parse_drafter", "parse_drafter_list"]
