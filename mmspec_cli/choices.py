"""The names and limits a user types, each defined once: profile keys, flags and the code read them here.

Importing this module imports nothing else (no torch), so ``mmspec --help`` and the profile
validator stay fast.
"""

from __future__ import annotations

#: Drafting methods that can be ensemble members (rows of one batched draft forward):
#: m multimodal, t text-only, c caption, p pooled (TABED §4, §6.1).
MEMBER_LETTERS = ("m", "t", "c", "p")

#: Trained draft heads that read the target's own features (``models/head.py``, ``models/eagle3.py``,
#: ``drafters/head.py``, ``mmspec train-head KIND``): EAGLE-2's head, ViSpec's and EAGLE-3's. A head is its own
#: drafter (named by its kind), never an ensemble member.
HEAD_KINDS = ("eagle", "vispec", "eagle3")
EAGLE3 = "eagle3"

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

#: Draft-length schedules (``decoding/schedules.py``); ``cost`` picks each block's γ from the step costs
#: ``profile-latency`` measured on this machine.
SCHEDULES = ("constant", "heuristic", "fastvlm", "cost")

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


#: The tree settings that must agree, each as (profile key, flag): a message names a setting the way it was given.
TREE_SETTINGS = {"tree": ("decoding.tree", "--tree"), "tree_width": ("decoding.tree_width", "--tree-width")}


def tree_conflict(tree: str | None, width: int, flags: tuple[str, ...] | list[str] | set[str] = ()) -> str | None:
    """Why ``tree`` (``decoding.tree``) and ``width`` (``decoding.tree_width``) can't go together, in one line with
    its fix, or None when they can: a chain has one branch, a width tree two or more, a dynamic tree shapes itself.

    A setting named in ``flags`` was given as a flag and is named as one (``--tree-width 3``); the other came from
    the profile and is named by its key (``decoding.tree_width: 3``). The fix is a flag when any flag was given
    (a flag overrides the profile), else a change to the profile.
    """
    given = set(flags)

    def said(name: str, value: object) -> str:
        key, flag = TREE_SETTINGS[name]
        if name in given:
            return f"{flag} {value}"
        return f"the profile's {key}: {value}" if given else f"{key}: {value}"

    def named(name: str) -> str:
        key, flag = TREE_SETTINGS[name]
        return flag if given else f"{key}:"

    def change(name: str, value: object, default: object) -> str:
        key, flag = TREE_SETTINGS[name]
        if not given:
            return f"set {key}: {value} in the profile"
        if name in given:
            return f"drop {flag}" if value == default else f"use {flag} {value}"
        return f"add {flag} {value}"

    kind = tree_kind(tree, width)
    if kind == "chain" and width > 1:
        fix = (f"{change('tree_width', 1, 1)}, or {change('tree', 'width', None)}" if given else
               "in the profile, set decoding.tree_width: 1 or decoding.tree: width")
        return f"{said('tree', 'chain')} and {said('tree_width', width)} disagree; {fix}"
    if kind == "width" and width < 2:
        return f"{said('tree', 'width')} needs {named('tree_width')} 2 or more (branches per block)"
    if kind == "dynamic" and width > 1:
        topk = "--tree-topk" if given else "decoding.tree_topk"
        return (f"{said('tree', 'dynamic')} shapes its own tree, {said('tree_width', width)} does not apply; "
                f"{change('tree_width', 1, 1)} ({topk} sets its breadth)")
    return None


#: Dynamic trees: the most nodes one target forward verifies (``--tree-budget``, the root included).
MAX_TREE_BUDGET = 512

#: The largest draft length γ a profile or ``--gamma`` accepts.
MAX_GAMMA = 64

#: ``mmspec train-head imitation``: FastVLM's imitation network for ``ssd`` (``models/imitation.py``).
IMITATION = "imitation"

#: ``train-head --loss``: ViSpec's code (10·L1 + 0.1·ListMLE) or its paper (cross-entropy); ``training/losses.py``.
TRAIN_LOSSES = ("vispec", "ce")
