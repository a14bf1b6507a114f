"""SOURCE -> samples: a JSONL manifest path, a folder in MMSpec's layout, a built-in suite name, or a Hugging Face
dataset id.

Resolution order: an existing file is a manifest; an existing folder is MMSpec's layout (``mmspec.jsonl`` beside
``images/``, :func:`~.samples.read_mmspec_folder`; a folder without ``mmspec.jsonl`` is refused); a name in
:data:`SUITES` is a suite; a known dataset id (``owner/name[:subset]``, see :mod:`.hub`) is loaded with ``datasets``.
Anything else is refused with one line listing what would have been accepted.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

from mmspec_cli.errors import InputError
from mmspec_cli.inputs import hub
from mmspec_cli.inputs.samples import Sample, read_manifest, read_mmspec_folder
from mmspec_cli.models.images import is_image_file
from mmspec_cli.models.prompts import shorten

DEMO_SUITES = ("demo-single", "demo-pair", "demo-story", "demo-followup")


def demo_suite(name: str, n: int | None = None) -> list[Sample]:
    """The first ``n`` samples (default ``tasks.DEFAULT_SUITE_SIZE``) of a held-out synthetic suite
    (:mod:`mmspec_cli.demo`): its images rendered, its name as category.

    A conversation measures its last turn: the earlier turns are given as history with their
    reference answers. So ``demo-followup`` measures the follow-up turns alone, as TABED Table 1
    reports second turns apart from first turns (a first turn here is a ``demo-single`` task).
    """
    from mmspec_cli.demo import scenes, tasks

    return [Sample(id=s.id, category=name, turns=(s.questions[-1],),
                   images=tuple(scenes.render(scene, scenes.DISPLAY_SIZE) for scene in s.images),
                   history=tuple(s.turns[:-1]))
            for s in tasks.suite(name, n)]


#: Built-in suites: name -> function building the samples (TABED §4.1's input scenarios, generated).
#: Each takes the number of samples per suite (None: the default size).
SUITES: dict[str, Callable[[int | None], list[Sample]]] = {
    name: (lambda n=None, name=name: demo_suite(name, n)) for name in DEMO_SUITES}
SUITES["demo-all"] = lambda n=None: [sample for name in DEMO_SUITES for sample in demo_suite(name, n)]


def resolve(source: str, limit: int | None = None, other_suites: Sequence[str] = ()) -> list[Sample]:
    """The samples SOURCE names, the first ``limit`` of them. For ``demo-all`` that is the first
    ``limit`` of each suite, so a short run still covers every scenario; a dataset stops reading there.
    ``other_suites``: names the caller resolves itself (train-head's ``demo-train``), listed with the known
    suites when SOURCE names nothing."""
    if not source.strip():  # Path("") is the current folder: an empty argument would read whatever is here
        raise InputError("SOURCE is empty; pass a JSONL manifest, a folder in MMSpec's layout, a suite such as "
                         "demo-single or a dataset id")
    path = Path(os.path.expanduser(source))
    if is_image_file(path):  # else read as a manifest, it would fail to decode as text
        raise InputError(f"SOURCE {shorten(source)} is an image, and a SOURCE is a set of samples: pass a JSONL "
                         f"manifest, a suite such as demo-single or a dataset id (for one image, use `mmspec "
                         f"generate IMAGE -q QUESTION`)")
    if path.is_file():
        return read_manifest(path)[:limit]
    if path.is_dir():
        return read_mmspec_folder(path)[:limit]
    if source in SUITES:
        return SUITES[source](limit)
    if hub.is_known(source):
        return hub.load(source, limit)
    datasets = ", ".join(hub.DATASETS)
    raise InputError(f"SOURCE '{source}' is neither an existing manifest file, nor a known suite "
                     f"(known suites: {', '.join(sorted((*SUITES, *other_suites)))}), nor a supported dataset id "
                     f"({datasets}, with :SUBSET where needed)")
