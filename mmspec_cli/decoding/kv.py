"""A model together with its KV cache and the token ids that cache holds.

Target and drafters talk to their models only through :class:`CachedModel.logits`: "give
me the logits of the last ``keep`` positions of this token sequence". The runner finds
the longest prefix already in the cache, crops the rest with transformers' own
``Cache.crop`` (the rollback after a rejected draft), and feeds only the new tokens. The
whole prefix is never re-run, except when the new part contains image placeholders
(their pixels must go through the vision tower with the full prompt).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from transformers import DynamicCache

from mmspec_cli.decoding.features import FeatureTrack
from mmspec_cli.decoding.rollback import crop_to
from mmspec_cli.decoding.tree import PendingTree
from mmspec_cli.errors import MmspecError


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two id sequences.

    One extends the other in the common case (a C-speed list compare); after a rejected
    draft the first difference is near the end, so the search walks back from there.
    """
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    start, step = n, 16
    while start > 0:
        start = max(0, n - step)
        if a[:start] == b[:start]:
            break
        step *= 8
    while a[start] == b[start]:  # start < n, and a difference lies before n
        start += 1
    return start


def same_tensors(a: Mapping[str, torch.Tensor] | None, b: Mapping[str, torch.Tensor] | None) -> bool:
    """Whether two sets of image tensors are the same images (identity first, then values)."""
    a, b = a or {}, b or {}
    if a.keys() != b.keys():
        return False
    for key in a:
        x, y = a[key], b[key]
        if x is y:
            continue
        if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)) or x.shape != y.shape or not torch.equal(x, y):
            return False
    return True


class CachedModel:
    """Runs ``model`` incrementally over growing (and sometimes rolled-back) token sequences."""

    def __init__(self, model: torch.nn.Module, role: str, image_token_id: int | None):
        self.model = model
        self.role = role
        self.image_token_id = image_token_id
        self.device = model.device
        self.cache = DynamicCache(config=model.config)
        self.ids: list[int] = []  # the token ids whose keys/values the cache holds, in order
        self.vision: Mapping[str, torch.Tensor] = {}  # the image tensors behind the cached placeholders
        self.tree: PendingTree | None = None  # a token tree fed after ``ids`` and not settled yet
        self.features: FeatureTrack | None = None  # the model's own features at ``ids``, when a draft head reads them

    def track_features(self) -> FeatureTrack:
        """From now on keep the model's input embeddings and last hidden states of every cached position."""
        if self.features is None:
            self.reset()  # what is cached already was fed without them
            self.features = FeatureTrack(self.model)
        return self.features

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self.ids = []
        self.vision = {}
        self.tree = None
        if self.features is not None:
            self.features.clear()

    def truncate(self, length: int) -> None:
        """Keep only the first ``length`` cached positions (a self-speculative drafter then extends them)."""
        self._drop_tree()
        self._crop(length)
        self.ids = self.ids[:length]

    def _crop(self, length: int) -> None:
        crop_to(self.cache, length)
        if self.features is not None:
            self.features.crop(length)

    # ----------------------------------------------------------------- token trees (tree.PendingTree)

    def hold(self, ids: Sequence[int], vision: Mapping[str, torch.Tensor] | None = None,
             prompt_len: int | None = None) -> None:
        """Make the cache hold exactly ``ids``, feeding only what it lacks (nothing if it holds them already)."""
        self._drop_tree()
        prompt_len = len(ids) if prompt_len is None else prompt_len
        images_end = _placeholders_end(ids[:prompt_len], self.image_token_id)
        held = common_prefix_length(self.ids, ids) == len(ids) and len(ids) > 0
        if held and (not images_end or same_tensors(self.vision, vision)):
            self._crop(len(ids))
            self.ids = list(ids)
            return
        self.logits(ids, keep=1, vision=vision, prompt_len=prompt_len)

    @torch.inference_mode()
    def tree_logits(self, tokens: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """Feed tree nodes after the held ids (``parents``: earlier node indices, -1 for the held ids);
        logits (n, V) of every node. Nodes fed by earlier calls stay visible to their descendants."""
        if self.tree is None:
            self.tree = PendingTree(base=len(self.ids))
        nodes = self.tree.add(tokens, parents)
        mask, positions = self.tree.inputs(nodes, self.model.dtype, self.device)  # (1, 1, n, base + fed), (1, n)
        input_ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)  # (1, n)
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                         past_key_values=self.cache, use_cache=True, logits_to_keep=0)
        if self.features is not None:
            self.features.hold_tree()
        return out.logits[0]  # (n, V)

    @torch.inference_mode()
    def keep_path(self, nodes: Sequence[int]) -> None:
        """Settle the tree: keep the entries of ``nodes`` (one path from the tree's top) after the held ids."""
        if self.tree is not None:
            fed = [node for node in nodes if node < len(self.tree.parents)]
            self.ids = self.ids + self.tree.settle(self.cache, nodes)
            self.tree = None
            if self.features is not None:
                self.features.settle_tree(fed)

    def _drop_tree(self) -> None:
        if self.tree is not None:
            self.tree.drop(self.cache)
            self.tree = None
            if self.features is not None:
                self.features.drop_tree()

    @torch.inference_mode()
    def logits(self, ids: Sequence[int], keep: int = 1, vision: Mapping[str, torch.Tensor] | None = None,
               prompt_len: int | None = None) -> torch.Tensor:
        """Logits (keep, V) for the last ``keep`` positions of ``ids``; the cache then holds all of ``ids``.

        ``vision`` holds the processor's image tensors for the image placeholders in the first
        ``prompt_len`` ids (default: all of ``ids``). Image ids after the prompt (drafted or
        generated) are ordinary tokens, as in transformers' own ``generate``. When the part to
        feed reaches back into the prompt's placeholders, the prompt is encoded again from the
        start with its pixels, never spliced.
        """
        self._drop_tree()
        prompt_len = len(ids) if prompt_len is None else prompt_len
        images_end = _placeholders_end(ids[:prompt_len], self.image_token_id)
        reuse = common_prefix_length(self.ids, ids)
        if reuse and images_end:
            if not same_tensors(self.vision, vision):
                reuse = 0  # same placeholder ids, other images: the cached image positions are stale
            else:
                self.vision = dict(vision or {})  # the same images: identity checks succeed from now on
        reuse = min(reuse, len(ids) - keep)  # positions whose logits we need must be fed
        if reuse < images_end:
            self.reset()
            segments = [(0, prompt_len, vision or {}), (prompt_len, len(ids), {})]
        else:
            self._crop(reuse)
            segments = [(reuse, len(ids), {})]
        parts = [self._forward(ids[start:stop], images, wanted=min(stop - start, max(0, keep - (len(ids) - stop))))
                 for start, stop, images in segments if stop > start]
        self.ids = list(ids)
        if images_end:
            self.vision = dict(vision or {})
        return torch.cat([p for p in parts if p is not None])  # (keep, V)

    def _forward(self, ids: Sequence[int], images: Mapping[str, torch.Tensor], wanted: int) -> torch.Tensor | None:
        """Feed ``ids`` (with ``images`` for their placeholders); logits of the last ``wanted`` positions."""
        input_ids = torch.tensor([list(ids)], dtype=torch.long, device=self.device)  # (1, n)
        try:
            out = self.model(
                input_ids=input_ids,
                past_key_values=self.cache,
                use_cache=True,
                logits_to_keep=max(wanted, 1),  # 0 would mean "all positions" to transformers
                **{k: to_model(v, self.model) for k, v in images.items()},
            )
        except torch.cuda.OutOfMemoryError as exc:
            raise MmspecError(
                f"CUDA ran out of memory in the {self.role} model; set {self.role}.quantization: 4bit "
                f"(or 8bit), a smaller dtype such as float16, or a shorter prompt"
            ) from exc
        if self.features is not None:
            self.features.extend()
        return out.logits[0, -wanted:] if wanted else None


def _placeholders_end(ids: Sequence[int], image_token_id: int | None) -> int:
    """One past the last image placeholder in ``ids`` (0 when there is none)."""
    if image_token_id is None or image_token_id not in ids:
        return 0
    return len(ids) - list(reversed(ids)).index(image_token_id)


def to_model(value: torch.Tensor, model: torch.nn.Module) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        return value
    if value.is_floating_point():
        return value.to(device=model.device, dtype=model.dtype)
    return value.to(model.device)
