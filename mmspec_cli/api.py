"""The importable entry point: a profile in, a ready :class:`SpeculativeDecoder` out.

    from mmspec_cli.api import load_decoder
    from mmspec_cli.images import load_images
    decoder = load_decoder("llava15-7b", drafter="m")
    generation = decoder.generate(load_images(["img.jpg"]), ["Describe the image."])
    print(generation.turns[0].text, generation.stats.block_efficiency)
"""

from __future__ import annotations

from .drafters import build_drafter, check_drafter_name
from .engine import SpeculativeDecoder
from .models import check_compatible, load_model
from .profiles import Profile, apply_overrides, load_profile
from .sampling import SamplingParams


def decoder_from_profile(profile: Profile) -> SpeculativeDecoder:
    """Load the profile's models (the draft only if the drafter needs one) and build the decoder.

    Everything that can be refused (drafter name, missing draft, tokenizer mismatch) is
    refused here, before any decoding starts.
    """
    check_drafter_name(profile.drafter)
    target = load_model(profile.target, "target", multi_gpu_ok=True)
    draft = None
    if profile.drafter != "ar" and profile.draft is not None:
        draft = load_model(profile.draft, "draft")
        check_compatible(target, draft)
    decoding = profile.decoding
    return SpeculativeDecoder(
        target,
        build_drafter(profile.drafter, target, draft),
        gamma=decoding.gamma,
        max_new_tokens=decoding.max_new_tokens,
        sampling=SamplingParams(decoding.temperature, decoding.top_p, decoding.top_k),
        seed=decoding.seed,
    )


def load_decoder(profile: str | None = None, **overrides) -> SpeculativeDecoder:
    """``load_decoder("llava15-7b", drafter="t", gamma=3)``: a profile name or path plus flag overrides."""
    return decoder_from_profile(apply_overrides(load_profile(profile), **overrides))
