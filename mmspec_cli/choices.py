"""The names and limits a user types, each defined once: profile keys, flags and the code read them here.

Importing this module imports nothing else (no torch), so ``mmspec --help`` and the profile
validator stay fast.
"""

from __future__ import annotations

#: Drafting methods that can be ensemble members (rows of one batched draft forward):
#: m multimodal, t text-only, c caption, p pooled (TABED §4, §6.1).
MEMBER_LETTERS = ("m", "t", "c", "p")

#: Trained draft heads that read the target's own features (``models/head.py``, ``drafters/head.py``,
#: ``mmspec train-head KIND``): EAGLE-2's head and ViSpec's. A head is its own drafter (named by its kind),
#: never an ensemble member.
HEAD_KINDS = ("eagle", "vispec")

#: ``ssd`` without the profile's imitation network (FastVLM's "draft without imitation"), to compare both in one run.
SSD_PLAIN = "ssd:plain"

#: A benchmarking drafter (``drafters/oracle.py``): it replays the target's greedy output of a first ``ar`` run, so
#: every draft is accepted and drafting costs nothing; what it gains over ``ar`` measures the engine itself.
ORACLE = "oracle"

#: Bench-only peer rows (``bench/peers.py``): names ``bench --drafters`` takes that no engine drafter has.
HF_ASSISTED = "hf-assisted"  # Hugging Face assisted generation
BENCH_PEERS = (HF_ASSISTED,)

#: Floating-point dtypes a model can be loaded in (``torch.<name>``).
DTYPES = ("float32", "float16", "bfloat16", "float64")

#: Weight quantization through bitsandbytes (``None``: none).
QUANTIZATIONS = (None, "8bit", "4bit")

#: Draft-length schedules (``decoding/schedules.py``).
SCHEDULES = ("constant", "heuristic", "fastvlm")

#: TABED weight policies (``drafters/weights.py``).
POLICIES = ("grid", "softmax", "adaboost", "random", "static")

#: Token trees: at most this many branches per block (``--tree-width``).
MAX_TREE_WIDTH = 8

#: Token-tree kinds (``--tree``): a plain chain, width-d branches (TABED §6.1), EAGLE-2 dynamic trees.
TREE_KINDS = ("chain", "width", "dynamic")


def tree_kind(tree: str | None, width: int) -> str:
    """The tree a block drafts: ``tree`` (``decoding.tree``, ``--tree``) when given, else a width tree for a
    ``width`` (``--tree-width``) above 1 and a chain otherwise, so ``--tree-width d`` alone keeps working."""
    return tree if tree is not None else ("width" if width > 1 else "chain")

#: Dynamic trees: the most nodes one target forward verifies (``--tree-budget``, the root included).
MAX_TREE_BUDGET = 512

#: The largest draft length γ a profile or ``--gamma`` accepts.
MAX_GAMMA = 64

#: ``mmspec train-head imitation``: FastVLM's imitation network for ``ssd`` (``models/imitation.py``).
IMITATION = "imitation"

#: ``train-head --loss``: ViSpec's code (10·L1 + 0.1·ListMLE) or its paper (cross-entropy); ``training/losses.py``.
TRAIN_LOSSES = ("vispec", "ce")
