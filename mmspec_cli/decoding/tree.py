"""Token trees: their shape (:class:`TreeTopology`), and a tree fed into a KV cache (:class:`PendingTree`).

A tree's node numbers, the target's rows (``[root] + nodes``) and a cache's fed numbers are
made here; the drafting loops (``drafters/tree_drafting.py``) map a dynamic tree's nodes to the
fed numbers of the draft's cache (docs/ARCHITECTURE.md, "The tree topology").

**Topology.** A block's draft tree hangs off the *root*, the last verified token. Node ``i``
holds one drafted token and has a parent: an earlier node, or -1 for the root. The drafters
number nodes level by level (every node of depth 0, then of depth 1, ...), which is also the
order a width tree is fed in. A width-d tree (TABED §6.1) is one constructor: d chains of γ tokens,
node ``s·d + j`` being token ``s`` of branch ``j``. Any parent array whose parents come before
their children is a topology (EAGLE-2's dynamic trees change shape every block).

**Feeding a tree.** Fed after a cached prefix of ``base`` positions, a node attends to the
whole prefix and to its ancestors (itself included), and its position id is ``base + depth``
for a row with ``base`` real positions, so each branch computes exactly what it would compute
alone (SpecInfer, Miao et al. 2023; Medusa, Cai et al. 2024). The mask is handed to the model
as a prepared 4-D additive mask, which transformers passes to eager and sdpa attention as it
is; no transformers code is patched.

**The target's view.** The target scores the root and every node in ONE forward: it is fed
``[root] + nodes``, so node ``i`` is fed as ``i + 1`` (:func:`rooted_parents`, :func:`rooted`).

**Settling.** After verification only the accepted path stays in each cache:
:meth:`PendingTree.settle` moves those entries to follow the prefix and rolls the rest back
(:meth:`~mmspec_cli.decoding.kv_state.KVState.keep`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from mmspec_cli.choices import MAX_TREE_WIDTH, TREE_SETTINGS, tree_conflict, tree_kind
from mmspec_cli.decoding.kv_state import KVState
from mmspec_cli.errors import InputError, ModelLoadError
from mmspec_cli.models.families import family_of
from mmspec_cli.models.positions import TEXT_POSITIONS, Positions

MASKABLE_ATTENTION = ("eager", "sdpa")  # attention that takes a prepared 4-D additive mask as it is
ROOT = -1  # the parent of a depth-0 node


def check_tree_width(width: int) -> int:
    if not isinstance(width, int) or isinstance(width, bool) or not 1 <= width <= MAX_TREE_WIDTH:
        raise InputError(f"tree width {width!r} is outside [1, {MAX_TREE_WIDTH}]; use 1 (no tree) to "
                         f"{MAX_TREE_WIDTH} branches per block")
    return width


def check_tree_support(model) -> None:
    """Refuse a model whose decoder can't take a custom 4-D attention mask (token trees need one); its family
    (:mod:`mmspec_cli.models.families`) names the decoders that can."""
    text = model.config.get_text_config()
    kind = getattr(text, "model_type", None)
    decoders = family_of(model).tree_decoders
    attention = getattr(text, "_attn_implementation", None) or getattr(model.config, "_attn_implementation", None)
    if kind not in decoders or attention not in MASKABLE_ATTENTION:
        raise ModelLoadError(
            f"token trees need a decoder that takes a custom 4-D attention mask ({', '.join(decoders)} "
            f"with {' or '.join(MASKABLE_ATTENTION)} attention); {type(model).__name__} has {kind} with {attention} "
            f"attention; use --tree-width 1")


@dataclass(frozen=True)
class TreeSettings:
    """What tree a block drafts: ``kind`` chain, width (``width`` branches) or dynamic (EAGLE-2:
    ``topk`` children per expanded node, ``depth`` expansion rounds, ``budget`` nodes verified, root included)."""

    kind: str = "chain"
    width: int = 1
    budget: int = 30
    depth: int = 3
    topk: int = 8

    @classmethod
    def resolve(cls, tree: str | None, width: int = 1, budget: int = 30, depth: int = 3,
                topk: int = 8) -> "TreeSettings":
        """``tree`` None: a width tree when ``width`` > 1, else a chain (``--tree-width`` alone keeps working)."""
        check_tree_width(width)
        conflict = tree_conflict(tree, width, TREE_SETTINGS)  # the engine's keywords, named as the flags they are
        if conflict:
            raise InputError(conflict)
        return cls(tree_kind(tree, width), width, budget, depth, topk)

    @property
    def drafts_tree(self) -> bool:
        return self.kind != "chain"


def _depths(parents: Sequence[int]) -> tuple[int, ...]:
    depths: list[int] = []
    for node, parent in enumerate(parents):
        if not ROOT <= parent < node:
            raise ValueError(f"node {node}: parent {parent} is not an earlier node")
        depths.append(0 if parent == ROOT else depths[parent] + 1)
    return tuple(depths)


@dataclass(frozen=True)
class TreeTopology:
    """The shape of a draft tree: ``parents[i]`` is node i's parent (``ROOT`` = -1 for the root's children)."""

    parents: tuple[int, ...]
    depths: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "parents", tuple(self.parents))
        object.__setattr__(self, "depths", _depths(self.parents))

    @classmethod
    def width(cls, width: int, depth: int) -> "TreeTopology":
        """``width`` chains of ``depth`` tokens off the root: node s·width + j is token s of branch j."""
        return cls(tuple(ROOT if s == 0 else (s - 1) * width + j for s in range(depth) for j in range(width)))

    def __len__(self) -> int:
        return len(self.parents)

    def level(self, depth: int) -> list[int]:
        """The nodes at ``depth``, in node order."""
        return [node for node, d in enumerate(self.depths) if d == depth]

    def parents_of(self, nodes: Sequence[int]) -> list[int]:
        return [self.parents[node] for node in nodes]

    def path(self, node: int) -> list[int]:
        """The nodes from depth 0 down to ``node`` (the root itself is not a node)."""
        path = []
        while node != ROOT:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def leaves(self) -> list[int]:
        has_child = set(self.parents)
        return [node for node in range(len(self)) if node not in has_child]

    def branches(self) -> list[list[int]]:
        """Every root-to-leaf path, in leaf order (for a width tree: branch j is the j-th)."""
        return [self.path(leaf) for leaf in self.leaves()]

    def children(self, node: int) -> list[int]:
        """``node``'s children (``ROOT``: the depth-0 nodes), in node order."""
        return [child for child, parent in enumerate(self.parents) if parent == node]

    def extend(self, path: Sequence[int], scores: Sequence[float]) -> list[int]:
        """``path`` (from depth 0) continued down to a leaf through the best-scoring child each time."""
        path = list(path)
        children = self.children(path[-1] if path else ROOT)
        while children:
            path.append(min(children, key=lambda c: (-scores[c], c)))
            children = self.children(path[-1])
        return path

    def ancestors_mask(self, nodes: Sequence[int], fed: int) -> torch.Tensor:
        """(len(nodes), fed) bool: which of the first ``fed`` nodes each of ``nodes`` may attend to."""
        allowed = torch.zeros(len(nodes), fed, dtype=torch.bool)
        for row, node in enumerate(nodes):
            allowed[row, self.path(node)] = True
        return allowed


def rooted_parents(topology: TreeTopology) -> list[int]:
    """Parents of ``[root] + nodes`` as the target is fed them: the root off the prefix, node i as i + 1."""
    return [ROOT] + [0 if parent == ROOT else parent + 1 for parent in topology.parents]


def rooted(nodes: Sequence[int]) -> list[int]:
    """The fed indices of the root and ``nodes`` in ``[root] + nodes``."""
    return [0] + [node + 1 for node in nodes]


def rooted_values(values: Sequence[float], root: float = 0.0) -> list[float]:
    """Per-node ``values`` laid out as the target is fed them, ``[root] + nodes``."""
    return [root] + list(values)


def unrooted(rows: Sequence[int]) -> list[int]:
    """The nodes at fed indices ``rows`` (none of them the root's 0) of ``[root] + nodes``."""
    return [row - 1 for row in rows]


# --------------------------------------------------------------------------- EAGLE-2 dynamic trees


def top_children(log_q: torch.Tensor, ids: torch.Tensor,
                 scores: torch.Tensor) -> tuple[list[int], list[int], list[float]]:
    """EAGLE-2's expansion (Li et al. 2024, "EAGLE-2", §4.1): every node's k likeliest children.

    log_q, ids: (n, k) the draft's k likeliest tokens after each of n nodes, likeliest first, and their
    log-probabilities; scores: (n,) the nodes' own scores (a root's is 0). A child's score is its parent's plus
    log q(child): the log of the draft's probability of the whole path. Returns, for the n·k children in order (node
    by node, likeliest first): the row of the parent, the token and the score.
    """
    cumulative = scores.to(log_q.device, torch.float64)[:, None] + log_q.to(torch.float64)  # scores may be on the CPU
    rows = torch.arange(log_q.shape[0])[:, None].expand_as(cumulative)
    return rows.flatten().tolist(), ids.flatten().tolist(), cumulative.flatten().tolist()


def best(scores: Sequence[float], k: int) -> list[int]:
    """Indices of the ``k`` highest scores, best first; a tie goes to the earlier index."""
    return sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:k]


def rerank(parents: Sequence[int], scores: Sequence[float], keep: int) -> tuple[TreeTopology, list[int]]:
    """EAGLE-2's reranking: the ``keep`` candidates with the best scores, in creation order, as a tree.

    ``parents``/``scores`` describe every candidate in creation order (parents first). A child
    never scores above its parent (log q <= 0), and ties go to the earlier node, so the kept set
    holds every kept node's parent. Returns the tree and, per kept node, its candidate index.
    """
    kept = sorted(best(scores, keep))
    index = {old: new for new, old in enumerate(kept)}
    missing = [old for old in kept if parents[old] != ROOT and parents[old] not in index]
    if missing:
        raise ValueError(f"candidate {missing[0]} kept without its parent: scores must not grow along a path")
    return TreeTopology(tuple(ROOT if parents[old] == ROOT else index[parents[old]] for old in kept)), kept


def split_rooted(topology: TreeTopology, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``[root] + nodes`` (1 + n, ...) -> the root's (...) and each branch's along its path (d, γ, ...).

    Branch j, row t is the row of its t-th node: what the target says after that node.
    """
    paths = torch.tensor(topology.branches(), dtype=torch.long, device=values.device)  # (d, γ)
    return values[0], values[1:][paths]


# --------------------------------------------------------------------------- a tree inside a cache


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where ``allowed``, the dtype's minimum elsewhere (transformers' convention for 4-D masks)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


class PendingTree:
    """Tree nodes fed into a cache after ``base`` settled positions and not settled yet.

    Nodes are numbered in the order they are fed. A width tree is fed level by level in node
    order, so these are its node numbers; a dynamic tree feeds only the nodes it expands, and the
    drafting loop maps its nodes to these numbers (``TreeDrafts.fed``).
    """

    def __init__(self, base: int):
        self.base = base
        self.parents: list[int] = []
        self.tokens: list[int] = []

    def add(self, tokens: Sequence[int], parents: Sequence[int]) -> list[int]:
        """Append nodes with these tokens and parents (earlier nodes, or ``ROOT``); returns their numbers."""
        first = len(self.parents)
        self.parents.extend(parents)
        self.tokens.extend(tokens)
        _depths(self.parents)  # refuses a parent that is not an earlier node
        return list(range(first, len(self.parents)))

    def inputs(self, nodes: Sequence[int], dtype: torch.dtype, device, prefix: torch.Tensor | None = None,
               positions: Positions = TEXT_POSITIONS, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention mask (B, 1, n, W) and position ids (B, n) for feeding ``nodes``.

        ``prefix`` (B, base), 1 at each row's real positions (batched rows are left-padded), or
        None for one row with every position real; a node's position is its row's count of real
        prefix positions plus its depth (``positions.tree``). ``width`` W: the key length of the
        cache the nodes are fed into (a static state's capacity; default ``base + fed``); the
        columns after the fed nodes are hidden.
        """
        fed = len(self.parents)
        shape = TreeTopology(tuple(self.parents))
        prefix = torch.ones(1, self.base, dtype=torch.bool) if prefix is None else prefix.to("cpu", torch.bool)
        rows = prefix.shape[0]
        seen = shape.ancestors_mask(nodes, fed)  # (n, fed)
        parts = [prefix[:, None, :].expand(rows, len(nodes), self.base), seen[None].expand(rows, -1, -1)]
        if width is not None and width > self.base + fed:
            parts.append(torch.zeros(rows, len(nodes), width - self.base - fed, dtype=torch.bool))
        allowed = torch.cat(parts, dim=-1)  # (B, n, W)
        depths = torch.tensor([shape.depths[n] for n in nodes])  # (n,)
        start = prefix.long().sum(dim=1, keepdim=True)  # (B, 1)
        return additive_mask(allowed[:, None].to(device), dtype), positions.tree(start, depths).to(device)

    def settle(self, state: KVState, nodes: Sequence[int]) -> list[int]:
        """Keep the entries of ``nodes`` (a path from depth 0) after the prefix in ``state``; their tokens.

        Nodes of the path that were never fed (a drafter does not feed its tree's last level)
        are skipped: they are the path's tail.
        """
        fed = [node for node in nodes if node < len(self.parents)]
        state.keep(self.base, [self.base + node for node in fed])
        return [self.tokens[node] for node in fed]

    def drop(self, state: KVState) -> None:
        """Forget every node: the state holds the prefix alone again."""
        state.rollback(self.base)
