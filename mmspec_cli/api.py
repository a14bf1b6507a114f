"""The importable entry point: a profile in, a ready :class:`SpeculativeDecoder` out.

    from mmspec_cli.api import load_decoder
    from mmspec_cli.images import load_images
    decoder = load_decoder("llava15-7b", drafter="m")
    generation = decoder.generate(load_images(["img.jpg"]), ["Describe the image."])
    print(generation.turns[0].text, generation.stats.block_efficiency)
"""

from __future__ import annotations

from .captioner import Captioner
from .drafters import build_drafter, parse_drafter
from .engine import SpeculativeDecoder
from .ensemble import PolicyConfig
from .errors import InputError
from .models import check_compatible, load_model
from .profiles import Profile, apply_overrides, load_profile
from .sampling import SamplingParams


def decoder_from_profile(profile: Profile) -> SpeculativeDecoder:
    """Load the profile's models (the draft only if the drafter needs one) and build the decoder.

    Everything that can be refused (drafter name, missing draft, tokenizer mismatch) is
    refused here, before any decoding starts.
    """
    plan = parse_drafter(profile.drafter, profile.ensemble.members)
    if plan.needs_captioner and profile.captioner is None:
        raise InputError(f"drafter '{plan.name}' uses caption drafting (c) but the profile has no captioner; "
                         f"add `captioner: {{model: ...}}` to the profile")
    target = load_model(profile.target, "target", multi_gpu_ok=True)
    draft = None
    if plan.needs_draft and profile.draft is not None:
        draft = load_model(profile.draft, "draft")
        check_compatible(target, draft)
    captioner = None
    if plan.needs_captioner:
        spec = profile.captioner
        captioner = Captioner(load_model(spec, "captioner"), spec.prompt, spec.max_new_tokens)
    decoding = profile.decoding
    return SpeculativeDecoder(
        target,
        build_drafter(profile.drafter, target, draft, ensemble=policy_config(profile),
                      default_members=profile.ensemble.members, pool_kernel=profile.pooling.kernel,
                      captioner=captioner, seed=decoding.seed or 0),
        gamma=decoding.gamma,
        max_new_tokens=decoding.max_new_tokens,
        sampling=SamplingParams(decoding.temperature, decoding.top_p, decoding.top_k),
        seed=decoding.seed,
    )


def policy_config(profile: Profile) -> PolicyConfig:
    e = profile.ensemble
    return PolicyConfig(policy=e.policy, distance=e.distance, labels=e.labels, window=e.window,
                        grid_steps=e.grid_steps, tau=e.tau, adaboost_c=e.adaboost_c)


def load_decoder(profile: str | None = None, **overrides) -> SpeculativeDecoder:
    """``load_decoder("llava15-7b", drafter="t", gamma=3)``: a profile name or path plus flag overrides."""
    return decoder_from_profile(apply_overrides(load_profile(profile), **overrides))
