"""Hugging Face datasets of TABED App. J as benchmark samples (needs ``pip install 'mmspec[datasets]'``).

SOURCE is ``owner/name`` or ``owner/name:subset``; one sample (one turn) per row:

- ``lmms-lab/llava-bench-in-the-wild``: split train; ``image``, ``question``, id ``question_id``;
- ``lmms-lab/MMVet``: split test; ``image``, ``question``, id ``question_id``;
- ``lmms-lab/POPE``: split test; ``image``, ``question``, id ``question_id``;
- ``lmms-lab/LMMs-Eval-Lite:CONFIG`` (e.g. ``docvqa_val``): split lite; ``image``, ``question``,
  id ``questionId`` or ``question_id``; the category is the config;
- ``lmms-lab/LLaVA-NeXT-Interleave-Bench:SUB_TASK`` (``Spot-the-Diff``, ``IEdit``,
  ``MagicBrush``, ``PororoSV``, ``VIST``, ...; ``CONFIG/SUB_TASK`` for a config other than
  ``in_domain``): split test; the rows whose ``sub_task`` matches; the non-null ``image_0`` ..
  ``image_15``, ``question``, id ``sample_id``; the category is the sub-task.

Where these come from: the dataset ids are TABED App. J's links; the configs, splits and
field names are those of lmms-eval's task files for the same datasets
(``llava-in-the-wild.yaml``/``utils.py``: split ``train``, ``image``, ``question``,
``question_id``; ``mmvet.yaml``/``utils.py``: split ``test``, ``image`` (may be null: a
text-only sample here), ``question``, ``question_id``; ``pope.yaml``/``utils.py``: split ``test``,
``image``, ``question``, ``question_id``; ``docvqa_val_lite.yaml``: config ``docvqa_val``,
split ``lite``, ``questionId``; ``llava_interleave_bench/in_domain.yaml``, ``utils.py``:
config ``in_domain``, split ``test``, ``image_{i}``, ``question``, ``sub_task``,
``sample_id``) and the Interleave-Bench dataset card (features ``image_0`` .. ``image_11``
in ``in_domain``).

NOT TESTED against the real datasets: the machine mmspec is developed on has no access
to the Hugging Face hub. The adapters are tested on hand-made rows with those field names.
The sub-task names are those lmms-eval's ``utils.py`` groups its scores by (``Spot-the-Diff``,
``IEdit``, ``MagicBrush``, ``PororoSV``, ``VIST``). Unknown: whether all five are in ``in_domain``
(pass ``out_of_domain/SUB_TASK`` otherwise); which LMMs-Eval-Lite config holds TABED's 100 POPE samples (``lmms-lab/POPE`` is
the full set); whether Interleave-Bench questions carry inline ``<image>`` markers (they are
removed either way: the chat template places the images, or the paper prompt does).
Interleave-Bench's ``in_domain`` parquet is about 3 GB, so it is streamed and filtered row
by row, stopping after ``--limit`` matches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from itertools import islice
from typing import Any

from mmspec_cli.errors import InputError
from mmspec_cli.inputs.prompts import strip_image_markers
from mmspec_cli.inputs.samples import Sample

INSTALL_HINT = "pip install 'mmspec[datasets]'"
MAX_INTERLEAVE_IMAGES = 16

Row = Mapping[str, Any]


@dataclass(frozen=True)
class HubSpec:
    """How to load one dataset id and turn its rows into samples."""

    split: str
    to_sample: Callable[[Row, int, str | None], Sample]
    subset: str = "none"  # "none": no subset; "config": the subset is the config; "sub_task": a row filter
    default_config: str | None = None
    streaming: bool = False
    example: str = ""


def _row_id(row: Row, index: int, *keys: str) -> str:
    for key in keys:
        if row.get(key) is not None:
            return str(row[key])
    return str(index)


def _single_image(category: str, prompt_key: str | None, *id_keys: str) -> Callable[[Row, int, str | None], Sample]:
    def convert(row: Row, index: int, subset: str | None) -> Sample:
        return Sample(id=_row_id(row, index, *id_keys), category=category,
                      turns=(strip_image_markers(str(row["question"])),),
                      images=(row["image"],) if row.get("image") is not None else (), prompt_key=prompt_key)

    return convert


def _lite(row: Row, index: int, subset: str | None) -> Sample:
    config = subset or "lite"
    key = "docvqa" if config.startswith("docvqa") else "pope" if config.startswith("pope") else None
    return _single_image(config, key, "questionId", "question_id", "id")(row, index, subset)


#: Interleave-Bench sub_task -> paper prompt key (PororoSV and VIST need captions: default style)
INTERLEAVE_PROMPTS = {"Spot-the-Diff": "spot-the-diff", "IEdit": "iedit", "MagicBrush": "magicbrush"}


def _interleave(row: Row, index: int, subset: str | None) -> Sample:
    images = tuple(row[f"image_{i}"] for i in range(MAX_INTERLEAVE_IMAGES) if row.get(f"image_{i}") is not None)
    sub_task = str(row.get("sub_task") or (subset or "interleave").split("/")[-1])
    return Sample(id=f"{sub_task}-{_row_id(row, index, 'sample_id')}", category=sub_task,
                  turns=(strip_image_markers(str(row["question"])),), images=images,
                  prompt_key=INTERLEAVE_PROMPTS.get(sub_task))


DATASETS: dict[str, HubSpec] = {
    "lmms-lab/llava-bench-in-the-wild": HubSpec("train", _single_image("llava-w", "llava-w", "question_id")),
    "lmms-lab/MMVet": HubSpec("test", _single_image("mmvet", "mmvet", "question_id")),
    "lmms-lab/POPE": HubSpec("test", _single_image("pope", "pope", "question_id")),
    "lmms-lab/LMMs-Eval-Lite": HubSpec("lite", _lite, subset="config", example="docvqa_val"),
    "lmms-lab/LLaVA-NeXT-Interleave-Bench": HubSpec("test", _interleave, subset="sub_task", default_config="in_domain",
                                                    streaming=True, example="Spot-the-Diff"),
}


def split_source(source: str) -> tuple[str, str | None]:
    """``owner/name:subset`` -> (``owner/name``, ``subset``)."""
    name, _, subset = source.partition(":")
    return name, subset or None


def is_known(source: str) -> bool:
    return split_source(source)[0] in DATASETS


def rows_to_samples(spec: HubSpec, rows: Iterable[Row], subset: str | None, limit: int | None) -> list[Sample]:
    """Convert rows (filtered by ``sub_task`` where the subset is one) into at most ``limit`` samples."""
    sub_task = subset.split("/", 1)[-1] if spec.subset == "sub_task" and subset else None
    chosen: Iterator[tuple[int, Row]] = ((i, row) for i, row in enumerate(rows)
                                         if sub_task is None or row.get("sub_task") == sub_task)
    samples = [spec.to_sample(row, index, subset) for index, row in islice(chosen, limit)]
    ids = [s.id for s in samples]
    if len(set(ids)) != len(ids):  # ids must be unique for --resume; fall back to row order
        samples = [replace(s, id=f"{s.id}#{n}") for n, s in enumerate(samples)]
    return samples


def load(source: str, limit: int | None = None) -> list[Sample]:
    """Download (or read from the datasets cache) the rows of ``source`` and convert them."""
    name, subset = split_source(source)
    spec = DATASETS[name]
    if spec.subset != "none" and not subset:
        raise InputError(f"dataset {name} needs a subset: {name}:SUBSET, e.g. {name}:{spec.example}")
    if spec.subset == "none" and subset:
        raise InputError(f"dataset {name} has no subsets; pass it as {name}")
    try:
        import datasets
    except ImportError:
        raise InputError(f"SOURCE {source} is a Hugging Face dataset and needs the datasets package: "
                         f"{INSTALL_HINT}; or pass a local JSONL manifest") from None
    config = spec.default_config
    if spec.subset == "config":
        config = subset
    elif spec.subset == "sub_task" and subset and "/" in subset:
        config = subset.split("/", 1)[0]
    try:
        rows = datasets.load_dataset(name, config, split=spec.split, streaming=spec.streaming)
        if limit is not None and not spec.streaming and spec.subset != "sub_task":
            rows = rows.select(range(min(limit, len(rows))))
        samples = rows_to_samples(spec, rows, subset, limit)
    except InputError:
        raise
    except Exception as exc:  # network, missing config, changed schema: one line, not a traceback
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise InputError(f"could not load dataset {source} ({type(exc).__name__}: {first}); it needs access to the "
                         f"Hugging Face hub (or a datasets cache); or pass a local JSONL manifest") from exc
    if not samples:
        raise InputError(f"dataset {source} gave no samples; check the subset name (e.g. {name}:{spec.example})"
                         if spec.subset != "none" else f"dataset {source} gave no samples")
    return samples
