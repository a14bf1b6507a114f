"""Synthetic demo data: scenes of coloured shapes and task families mirroring TABED §4.1.

Pure Python + Pillow, deterministic from integer seeds. See :mod:`.scenes` for the scene
generator and renderer, :mod:`.tasks` for the task families, suites and manifests.
"""

from mmspec_cli.demo.scenes import (COLOURS, KINDS, POSITIONS, SIZES, Change, Scene, Shape, Story, change, make_story,
                                    random_scene, render)
from mmspec_cli.demo.tasks import (FAMILIES, HELDOUT_SEED_START, NUMBER_WORDS, QUALITY_SEEDS, SUITE_SEEDS, SUITES,
                                   TRAIN_SEEDS, QualityQuestion, Sample, answer_correct, caption, keyword_match,
                                   make_sample, quality_questions, suite, to_manifest, training_corpus, word_count)

__all__ = [
    "COLOURS", "KINDS", "POSITIONS", "SIZES", "Change", "Scene", "Shape", "Story", "change", "make_story",
    "random_scene", "render", "FAMILIES", "HELDOUT_SEED_START", "NUMBER_WORDS", "QUALITY_SEEDS", "SUITE_SEEDS",
    "SUITES", "TRAIN_SEEDS", "QualityQuestion", "Sample", "answer_correct", "caption", "keyword_match",
    "make_sample", "quality_questions", "suite", "to_manifest", "training_corpus", "word_count",
]
