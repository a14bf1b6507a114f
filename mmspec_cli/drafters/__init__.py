"""Drafting methods, one module each, behind the :class:`~mmspec_cli.decoding.drafter.Drafter` interface."""

from mmspec_cli.drafters.autoregressive import NoDrafter
from mmspec_cli.drafters.registry import build_drafter, parse_drafter, parse_drafter_list

__all__ = ["NoDrafter", "build_drafter", "parse_drafter", "parse_drafter_list"]
