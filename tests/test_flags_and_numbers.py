"""Issue 19, part 5 ("flags and numbers that mislead") and the bench items of part 3.

- dynamic-tree flags without ``--tree dynamic`` are refused, as conflicting ``--tree``/``--tree-width`` pairs are;
- Eq. (1) of ``ssd`` and ``ssd:plain`` uses ssd's own step (T_s), timed by ``profile-latency``;
- ``bench --summarize`` looks the latency cache up under the thread count of the records;
- ``load_decoder`` / ``ModelSet.load`` apply the CLI's thread choice;
- the progress bars keep their count, elapsed time and ETA at 80 and 60 columns;
- ``--profile <(...)`` (a pipe) is read like a file;
- a failed ``bench --out NEW`` leaves no empty file behind.

Tiny float64 LLaVA models of ``conftest.py`` on CPU; the summary tests use hand-made records.
"""

from __future__ import annotations

import io
import json
import os
import re
import threading
from pathlib import Path

import pytest
import torch
import yaml
from rich.console import Console
from typer.testing import CliRunner

from mmspec_cli.bench import latency
from mmspec_cli.bench import records as records_mod
from mmspec_cli.cli.app import app
from mmspec_cli.errors import InputError, ProfileError
from mmspec_cli.models.loading import resolve_device
from mmspec_cli.models.profiles import apply_overrides, load_profile, profile_from_dict

from tests.helpers import assert_one_line_error, save_images, write_profile

runner = CliRunner()
QUESTION = "what is in the image?"


# --------------------------------------------------------------------------- 1. dynamic-tree flags


BASE = {"target": {"model": "x"}}


@pytest.mark.parametrize("decoding, overrides, fragment", [
    ({}, {"tree_budget": 10}, "--tree-budget shapes dynamic trees only, and this run drafts a chain; add --tree "
                              "dynamic, or drop it"),
    ({}, {"tree_width": 3, "tree_depth": 2}, "--tree-depth shapes dynamic trees only, and this run drafts a width "
                                             "tree; add --tree dynamic, or drop it"),
    ({"tree": "dynamic"}, {"tree": "chain", "tree_topk": 4, "tree_budget": 9},
     "--tree-budget/--tree-topk shape dynamic trees only, and this run drafts a chain; add --tree dynamic, or drop them"),
    ({"tree": "width", "tree_width": 2}, {"tree_topk": 4}, "this run drafts a width tree"),
])
def test_dynamic_tree_flags_without_a_dynamic_tree_are_refused(decoding, overrides, fragment):
    with pytest.raises(InputError) as info:
        apply_overrides(profile_from_dict({**BASE, "decoding": decoding}), **overrides)
    assert fragment in str(info.value)


def test_dynamic_tree_flags_with_a_dynamic_tree_and_a_profiles_own_settings_are_kept():
    dynamic = apply_overrides(profile_from_dict(BASE), tree="dynamic", tree_budget=10, tree_depth=2, tree_topk=3)
    assert (dynamic.decoding.tree, dynamic.decoding.tree_budget, dynamic.decoding.tree_depth,
            dynamic.decoding.tree_topk) == ("dynamic", 10, 2, 3)
    in_profile = profile_from_dict({**BASE, "decoding": {"tree": "dynamic", "tree_budget": 12}})
    assert apply_overrides(in_profile, tree_topk=4).decoding.tree_topk == 4  # the profile's tree is dynamic
    # a profile holding dynamic settings, run with --tree chain: only flags the user gave are refused
    chain = apply_overrides(in_profile, tree="chain")
    assert chain.decoding.tree == "chain" and chain.decoding.tree_budget == 12


@pytest.mark.parametrize("command", ["generate", "compare", "bench"])
def test_the_commands_refuse_them_in_one_line_before_loading(command, tiny_dirs, tmp_path, no_model_loading):
    profile = write_profile(tmp_path / "p.yaml", tiny_dirs["target"], tiny_dirs["perturbed"], max_new_tokens=4)
    [image] = save_images(tmp_path, 1)
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps({"id": "a", "images": [image], "turns": [QUESTION], "category": "c"}) + "\n")
    head = {"generate": ["generate", image, "-q", QUESTION], "compare": ["compare", image, "-q", QUESTION],
            "bench": ["bench", str(manifest), "--out", str(tmp_path / "out.jsonl")]}[command]
    result = runner.invoke(app, [*head, "--profile", profile, "--tree-depth", "2"])
    assert_one_line_error(result, "--tree-depth shapes dynamic trees only, and this run drafts a chain; add --tree "
                                  "dynamic, or drop it")
    assert not (tmp_path / "out.jsonl").exists()


def test_load_decoder_refuses_the_same_keywords(tiny_dirs, tmp_path, no_model_loading):
    from mmspec_cli.api import load_decoder

    profile = write_profile(tmp_path / "p.yaml", tiny_dirs["target"], tiny_dirs["perturbed"])
    with pytest.raises(InputError, match="--tree-topk shapes dynamic trees only"):
        load_decoder(profile, tree_topk=4)
