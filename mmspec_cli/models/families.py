"""What differs between the model families mmspec runs: one adapter per family.

- :class:`LlavaFamily`: LLaVA-1.5, LLaVA-NeXT, LLaVA-OneVision (and any other image-text-to-text
  class with 1-D positions). Each image is one ``<image>`` placeholder in the prompt text, which the
  processor expands into the image's tokens; the language model reads 1-D positions.
- :class:`QwenVLFamily`: Qwen2-VL, Qwen2.5-VL, Qwen3-VL. Each image is
  ``<|vision_start|><|image_pad|><|vision_end|>`` in the prompt text, the processor repeats
  ``<|image_pad|>`` once per merged patch (the count follows the image's size), and the language model
  reads 3-D M-RoPE positions (:class:`~mmspec_cli.models.positions.MRopePositions`) whose offset δ after
  the images comes from transformers' own ``get_rope_index`` over the prompt: computed again for every
  prompt fed with its images, never taken from what the model object kept from an earlier call.

A family answers: the position ids of a prompt and the offset of what follows it
(:meth:`prompt_positions`), the position function after a prompt (:meth:`positions`), the token ids
one image is in the unexpanded prompt text (:meth:`image_placeholder_ids`: what a text-only or
caption view replaces), the positions of a batch of left-padded prompts (:meth:`batch_positions`),
how many images a processor's tensors hold and the tensors of some of them (:meth:`image_count`,
:meth:`images_in`: a later turn's new images are fed after the cached conversation),
whether batched draft rows hand the model its images to embed itself (``model_embeds_row_images``),
whether its decoder takes a custom 4-D mask for token trees (``tree_decoders``), and how a user makes the
images take fewer tokens when they overflow the context (:meth:`fewer_image_tokens`). :func:`family_of` picks
the adapter from the model's config.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mmspec_cli.models.positions import TEXT_POSITIONS, MRopePositions, Positions


class LlavaFamily:
    """LLaVA-1.5 / NeXT / OneVision: ``<image>`` placeholders, 1-D positions."""

    name = "llava"
    #: text decoders (``get_text_config().model_type``) that take a prepared 4-D additive mask
    tree_decoders: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3")
    #: whether batched draft rows (``drafters/rows.py``) give the model ids and its processor tensors, for its own
    #: forward to embed the images; False: mmspec embeds them (LLaVA-1.5 drafts, whose patch grid pooled rows pool)
    model_embeds_row_images = False

    def __init__(self, config: Any):
        self.config = config

    def positions(self, offset: int = 0) -> Positions:
        """The positions of tokens fed after a prompt whose rope offset is ``offset`` (always 0 here)."""
        return TEXT_POSITIONS

    def prompt_positions(self, model: Any, ids: Sequence[int], vision: Mapping[str, torch.Tensor],
                         device: Any) -> tuple[torch.Tensor, int]:
        """Position ids of a whole prompt fed with its images, and the offset of the tokens after it."""
        return TEXT_POSITIONS.chain(0, len(ids), device), 0

    def image_placeholder_ids(self, image_token_id: int) -> tuple[int, ...]:
        """The token ids one image is in the prompt text before the processor expands it."""
        return (image_token_id,)

    def fewer_image_tokens(self, images: int, room: int, role: str) -> str:
        """How to make ``images`` images fit in ``room`` vision tokens, for an error line. LLaVA's processors take
        no pixel bound: each image is a fixed number of tokens (LLaVA-1.5: a smaller image costs as much) or grows
        with its size (NeXT's and OneVision's tiles)."""
        return "pass fewer images" if self.fixed_image_tokens else "pass fewer or smaller images"

    @property
    def fixed_image_tokens(self) -> bool:
        """Whether every image costs the same number of tokens, whatever its size (LLaVA-1.5's one crop; NeXT and
        OneVision tile an image by its size)."""
        return getattr(self.config, "model_type", None) == "llava"

    #: the processor's tensors :meth:`images_in` can cut per image (each holds one entry per image on dim 0)
    image_keys: tuple[str, ...] = ("pixel_values", "image_sizes")

    def image_count(self, vision: Mapping[str, torch.Tensor]) -> int:
        """How many images a processor's tensors hold."""
        pixels = vision.get("pixel_values")
        return 0 if pixels is None else int(pixels.shape[0])

    def images_in(self, vision: Mapping[str, torch.Tensor], first: int, last: int,
                  tokens: slice) -> dict[str, torch.Tensor] | None:
        """The tensors of images ``first`` to ``last - 1`` of ``vision`` (the processor's output for a whole
        prompt), for the prompt segment ``tokens`` that holds exactly their placeholders; None when this
        family's tensors can't be cut per image (LLaVA-OneVision's ``batch_num_images``, say: its images are
        laid out for the whole set), and the whole prompt is then encoded again."""
        if set(vision) - set(self.image_keys):
            return None
        return {key: value[first:last] for key, value in vision.items()}

    def batch_positions(self, model: Any, prompts: Sequence[tuple[Sequence[int], Mapping[str, torch.Tensor]]],
                        width: int, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Position ids of prompts (ids, image tensors) left-padded to ``width``: (B, width), or (3, B, width) for
        M-RoPE; each row's own :meth:`prompt_positions`, padding at 0. And each row's rope offset (B, 1)."""
        rows, offsets = [], torch.zeros(len(prompts), 1, dtype=torch.long)
        for row, (ids, vision) in enumerate(prompts):
            own, offsets[row, 0] = self.prompt_positions(model, ids, vision, device)  # (..., 1, L)
            rows.append(own)
        positions = torch.zeros(*rows[0].shape[:-2], len(prompts), width, dtype=torch.long, device=device)
        for row, own in enumerate(rows):
            positions[..., row, width - own.shape[-1]:] = own[..., 0, :]
        return positions, offsets


class QwenVLFamily(LlavaFamily):
    """Qwen2-VL / Qwen2.5-VL / Qwen3-VL: vision start/pad/end markers, M-RoPE positions."""

    name = "qwen-vl"
    tree_decoders = ("qwen2_vl_text", "qwen2_5_vl_text", "qwen3_vl_text")
    model_embeds_row_images = True

    def positions(self, offset: int = 0) -> Positions:
        return MRopePositions(offset)

    def prompt_positions(self, model: Any, ids: Sequence[int], vision: Mapping[str, torch.Tensor],
                         device: Any) -> tuple[torch.Tensor, int]:
        """``get_rope_index`` over the prompt (Qwen2-VL §2.1): (3, 1, L) positions and δ = max + 1 − L."""
        grid = vision.get("image_grid_thw")
        if grid is None:  # no image: plain positions on the three axes
            return MRopePositions(0).chain(0, len(ids), device), 0
        input_ids = torch.tensor([list(ids)], dtype=torch.long, device=device)
        types = vision.get("mm_token_type_ids")  # the processor's, for the whole prompt: ``ids`` may stop short of
        if types is None:  # its last token (a tree drafter feeds that one as its root); else where the image token is
            types = (input_ids == self.config.image_token_id).int()
        types = types[..., :len(ids)]
        positions, deltas = model.model.get_rope_index(input_ids=input_ids, mm_token_type_ids=types.to(device),
                                                       image_grid_thw=grid.to(device))
        return positions, int(deltas.reshape(-1)[0])

    def image_placeholder_ids(self, image_token_id: int) -> tuple[int, ...]:
        return (self.config.vision_start_token_id, image_token_id, self.config.vision_end_token_id)

    def fewer_image_tokens(self, images: int, room: int, role: str) -> str:
        """An image takes at most ``max_pixels`` / (patch · merge)² tokens (``smart_resize`` keeps h·w under
        ``max_pixels``, in multiples of patch · merge): the ``max_pixels`` that fits ``room`` tokens shared
        evenly by ``images`` images, or a smaller image."""
        vision = self.config.vision_config
        patch = vision.patch_size if isinstance(vision.patch_size, int) else vision.patch_size[0]
        per_image = room // max(images, 1)
        bound = per_image * (patch * vision.spatial_merge_size) ** 2
        each = "each image" if images > 1 else "the image"
        return (f"set {role}.max_pixels in the profile to {bound} or less ({each} then takes at most {per_image} "
                f"tokens), or pass {'smaller images' if images > 1 else 'a smaller image'}")

    image_keys = ("pixel_values", "image_grid_thw", "mm_token_type_ids")

    def pooled_grid(self, grid: torch.Tensor, kernel: int) -> torch.Tensor:
        """``image_grid_thw`` (n, 3) of images whose merged patch grid is average-pooled ``kernel``×``kernel``
        (:meth:`pool_image_features`): each frame's (h/m, w/m) merged grid becomes (⌈h/m/k⌉, ⌈w/m/k⌉), given
        back in patches (× m) as the processor gives a grid, so ``get_rope_index`` lays the pooled tokens out as an
        image of that size."""
        merge = self.config.vision_config.spatial_merge_size
        t, h, w = grid.unbind(-1)
        return torch.stack([t, -(-(h // merge) // kernel) * merge, -(-(w // merge) // kernel) * merge], dim=-1)

    def pooled_token_counts(self, grid: torch.Tensor, kernel: int) -> list[int]:
        """How many vision tokens each image of ``grid`` keeps after pooling."""
        merge = self.config.vision_config.spatial_merge_size
        return [int(n) // merge ** 2 for n in self.pooled_grid(grid, kernel).prod(dim=-1)]

    def pool_image_features(self, features: torch.Tensor, grid: torch.Tensor, kernel: int) -> torch.Tensor:
        """One image's merged-token features (t·h'·w', H), in raster order over (t, h', w') as the vision tower
        gives them and ``get_rope_index`` places them, average-pooled ``kernel``×``kernel`` in each frame's grid
        (pooled drafting, TABED §6.1, in the image's own grid rather than LLaVA-1.5's fixed 24×24): (t·h''·w'', H).
        A side the kernel does not divide keeps its edge: those windows average the tokens they cover."""
        merge = self.config.vision_config.spatial_merge_size
        t, h, w = (int(x) for x in grid)
        frames = features.reshape(t, h // merge, w // merge, -1).permute(0, 3, 1, 2)  # (t, H, h', w')
        pooled = torch.nn.functional.avg_pool2d(frames, kernel_size=kernel, ceil_mode=True)
        return pooled.permute(0, 2, 3, 1).reshape(-1, features.shape[-1])

    def image_count(self, vision: Mapping[str, torch.Tensor]) -> int:
        grid = vision.get("image_grid_thw")
        return 0 if grid is None else int(grid.shape[0])

    def images_in(self, vision: Mapping[str, torch.Tensor], first: int, last: int,
                  tokens: slice) -> dict[str, torch.Tensor] | None:
        """Qwen's patches of all images are one (patches, D) tensor: image i holds t·h·w rows of it, from its
        ``image_grid_thw`` row; ``mm_token_type_ids`` is per token, cut to ``tokens``."""
        if set(vision) - set(self.image_keys) or "image_grid_thw" not in vision:
            return None
        grid = vision["image_grid_thw"]
        rows = [int(n) for n in grid.prod(dim=-1)]
        out = {"pixel_values": vision["pixel_values"][sum(rows[:first]):sum(rows[:last])],
               "image_grid_thw": grid[first:last]}
        if "mm_token_type_ids" in vision:
            out["mm_token_type_ids"] = vision["mm_token_type_ids"][..., tokens]
        return out


#: ``config.model_type`` of the Qwen-VL classes mmspec runs
QWEN_VL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")


def family_of(model_or_config: Any) -> LlavaFamily:
    """The adapter of a model (or its config)."""
    config = getattr(model_or_config, "config", model_or_config)
    if getattr(config, "model_type", None) in QWEN_VL_TYPES:
        return QwenVLFamily(config)
    return LlavaFamily(config)
