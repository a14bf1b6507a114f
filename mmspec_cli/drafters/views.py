"""How each ensemble member shows the turn's prompt to the draft model: one :class:`Row` each.

- ``m`` multimodal (TABED §4): the images through the draft's vision tower, and the text;
- ``t`` text-only (Gagrani; TABED App. I.2): each image becomes one newline token;
- ``c`` caption (TABED §6.1, App. I.2): each image becomes the tokens of "image: <caption>";
- ``p`` pooled (TABED §6.1; IbED §5.1): the images with vision features average-pooled
  ``kernel``×``kernel`` in their patch grid, the placeholder run shrunk to match (576 -> 144; a
  Qwen-VL image in its own merged grid, so each image keeps about a quarter of its tokens).

``t`` and ``c`` are tokenized by the target's tokenizer: the prompt is the target's text, and the draft reads target
ids (a language-only draft's tokenizer lacks the target's image tokens; :mod:`~mmspec_cli.models.vocabulary`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from mmspec_cli.drafters.captioner import Captioner
from mmspec_cli.models.loading import LoadedModel
from mmspec_cli.models.families import family_of
from mmspec_cli.models.prompts import process, replace_image_tokens, shrink_runs, text_only_ids
from mmspec_cli.drafters.rows import Row, pooled_token_count

RowView = Callable[[str, Sequence[Any]], Row]


def multimodal_row(draft: LoadedModel) -> RowView:
    def view(text: str, images: Sequence[Any]) -> Row:
        prompt = process(draft.processor, text, images)
        return Row(ids=prompt.ids, vision=dict(prompt.vision))

    return view


def text_only_row(target: LoadedModel) -> RowView:
    """In the target's ids (what the draft reads: :mod:`~mmspec_cli.models.vocabulary`), from the target's text."""
    return lambda text, images: Row(ids=text_only_ids(target.tokenizer, text, target.image_placeholder_ids,
                                                      len(images)))


def caption_row(target: LoadedModel, captioner: Captioner) -> RowView:
    def view(text: str, images: Sequence[Any]) -> Row:
        tokenizer = target.tokenizer
        captions = [tokenizer(f"image: {captioner.caption(img)}", add_special_tokens=False)["input_ids"] for img in images]
        return Row(ids=replace_image_tokens(tokenizer(text)["input_ids"], target.image_placeholder_ids, captions))

    return view


def pooled_row(draft: LoadedModel, kernel: int) -> RowView:
    image_id = draft.image_token_id
    family = family_of(draft.model)

    def view(text: str, images: Sequence[Any]) -> Row:
        prompt = process(draft.processor, text, images)
        if family.model_embeds_row_images:  # Qwen-VL: each image pooled in its own grid (rows.encoded_row_images)
            grid = prompt.vision.get("image_grid_thw")
            if grid is None:
                return Row(ids=prompt.ids)
            ids = shrink_runs(prompt.ids, image_id, family.pooled_token_counts(grid, kernel))
            vision = {k: v for k, v in prompt.vision.items() if k in ("pixel_values", "image_grid_thw")}
            return Row(ids=ids, vision=vision, pool=kernel)
        per_image = len([t for t in prompt.ids if t == image_id]) // max(len(images), 1)
        kept = pooled_token_count(per_image, kernel)
        unexpanded = draft.tokenizer(text)["input_ids"]
        ids = replace_image_tokens(unexpanded, image_id, [[image_id] * kept] * len(images))
        return Row(ids=ids, vision={k: v for k, v in prompt.vision.items() if k == "pixel_values"}, pool=kernel)

    return view
