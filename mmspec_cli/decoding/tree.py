"""Token trees in a KV cache: which earlier tokens each new token may see, where it sits, and what is kept.

A block's tree is fed after a cached prefix of ``base`` positions, possibly over several
forward calls (the draft adds one level per step). Each tree node has a parent: another
node, or -1 for a node hanging directly off the prefix. A node attends to the whole prefix
and to its ancestors (itself included), and its position id is ``base + depth`` (depth 0
for a child of the prefix), so each branch computes exactly what it would compute alone
(SpecInfer, Miao et al. 2023; Medusa, Cai et al. 2024). The mask is handed to the model as
a prepared 4-D additive mask, which transformers passes to eager and sdpa attention as it
is; no transformers code is patched.

Nodes are cached in the order they were fed. After verification only the accepted path is
kept: :func:`keep_positions` moves those entries to follow the prefix and crops the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache

from mmspec_cli.errors import InputError, ModelLoadError

MAX_TREE_WIDTH = 8
#: Decoders whose attention takes a prepared 4-D additive mask as it is (eager and sdpa attention).
MASKABLE_DECODERS = ("llama", "mistral", "qwen2")
MASKABLE_ATTENTION = ("eager", "sdpa")


def check_tree_width(width: int) -> int:
    if not isinstance(width, int) or isinstance(width, bool) or not 1 <= width <= MAX_TREE_WIDTH:
        raise InputError(f"tree width {width!r} is outside [1, {MAX_TREE_WIDTH}]; use 1 (no tree) to "
                         f"{MAX_TREE_WIDTH} branches per block")
    return width


def check_tree_support(model) -> None:
    """Refuse a model whose decoder can't take a custom 4-D attention mask (token trees need one)."""
    text = getattr(model.config, "text_config", None) or model.config
    kind = getattr(text, "model_type", None)
    attention = getattr(text, "_attn_implementation", None) or getattr(model.config, "_attn_implementation", None)
    if kind not in MASKABLE_DECODERS or attention not in MASKABLE_ATTENTION:
        raise ModelLoadError(
            f"token trees need a decoder that takes a custom 4-D attention mask ({', '.join(MASKABLE_DECODERS)} "
            f"with {' or '.join(MASKABLE_ATTENTION)} attention); {type(model).__name__} has {kind} with {attention} "
            f"attention; use --tree-width 1")


@dataclass
class Tree:
    """The nodes fed so far after a prefix of ``base`` cached positions."""

    base: int
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)

    def add(self, parents: Sequence[int]) -> list[int]:
        """Append nodes with these parents (indices of earlier nodes, or -1); returns their indices."""
        first = len(self.parents)
        for parent in parents:
            if not -1 <= parent < len(self.parents):
                raise ValueError(f"parent {parent} is not an earlier node")
            self.parents.append(parent)
            self.depths.append(0 if parent < 0 else self.depths[parent] + 1)
        return list(range(first, len(self.parents)))

    def ancestors(self, node: int) -> list[int]:
        """``node`` and its ancestors, root first."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def visible(self, nodes: Sequence[int]) -> torch.Tensor:
        """(len(nodes), len(self.parents)) bool: which fed nodes each of ``nodes`` may attend to."""
        allowed = torch.zeros(len(nodes), len(self.parents), dtype=torch.bool)
        for row, node in enumerate(nodes):
            allowed[row, self.ancestors(node)] = True
        return allowed


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where ``allowed``, the dtype's minimum elsewhere (transformers' convention for 4-D masks)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


def tree_mask(tree: Tree, nodes: Sequence[int], dtype: torch.dtype, device, prefix: torch.Tensor | None = None) -> torch.Tensor:
    """The additive mask (B, 1, len(nodes), base + fed nodes) for feeding ``nodes`` (the last ones added).

    ``prefix`` (B, base) bool says which prefix positions each row may see (left padding of
    batched rows); None means all of them, one row.
    """
    prefix = torch.ones(1, tree.base, dtype=torch.bool) if prefix is None else prefix.to("cpu", torch.bool)
    rows = prefix.shape[0]
    seen = tree.visible(nodes)  # (n, fed)
    allowed = torch.cat([prefix[:, None, :].expand(rows, len(nodes), tree.base),
                         seen[None].expand(rows, -1, -1)], dim=-1)  # (B, n, base + fed)
    return additive_mask(allowed[:, None].to(device), dtype)


def tree_inputs(tree: Tree, nodes: Sequence[int], dtype: torch.dtype, device,
                prefix: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention mask (B, 1, n, base + fed) and position ids (B, n) for feeding ``nodes``.

    ``prefix`` (B, base), 1 at each row's real positions (batched rows are left-padded), or None
    for one row with every position real; a node's position is its row's count of real prefix
    positions plus its depth.
    """
    depths = torch.tensor([tree.depths[n] for n in nodes])  # (n,)
    start = torch.tensor([[tree.base]]) if prefix is None else prefix.to("cpu").long().sum(dim=1, keepdim=True)
    return tree_mask(tree, nodes, dtype, device, prefix), (start + depths[None, :]).to(device)  # (B, n)


def keep_positions(cache: Cache, start: int, positions: Sequence[int]) -> None:
    """Keep cache positions [0, start) followed by ``positions`` (ascending, all >= start); drop the rest.

    Only the accepted path of a tree stays. The moved entries are copied into place (their
    values are unchanged), then the cache is cropped with ``Cache.crop``.
    """
    positions = list(positions)
    if positions and positions != list(range(start, start + len(positions))):
        for layer in cache.layers:
            index = torch.tensor(positions, device=layer.keys.device)
            layer.keys[..., start:start + len(positions), :] = layer.keys.index_select(-2, index)
            layer.values[..., start:start + len(positions), :] = layer.values.index_select(-2, index)
    excess = cache.get_seq_length() - (start + len(positions))
    if excess > 0:
        cache.crop(-excess)  # Cache.crop takes a negative count
