"""The importable entry point: a profile in, a ready :class:`SpeculativeDecoder` out.

    from mmspec_cli.api import load_decoder
    from mmspec_cli.images import load_images
    decoder = load_decoder("llava15-7b", drafter="m")
    generation = decoder.generate(load_images(["img.jpg"]), ["Describe the image."])
    print(generation.turns[0].text, generation.stats.block_efficiency)

CPU threads: loading applies the CLI's thread choice (``models/threads.py``: ``MMSPEC_THREADS``, 1 thread for a
small target such as the demo family's, else the cores the load average leaves idle; torch's default on a GPU),
since torch's own default can be tens of times slower on a busy machine. ``threads=N`` sets N threads instead;
``threads=None`` leaves torch's setting as it is (a program that chose it itself).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mmspec_cli.drafters.captioner import Captioner
from mmspec_cli.drafters import build_drafter, parse_drafter
from mmspec_cli.drafters.registry import (DrafterPlan, check_chain_only, missing_draft, require_captioner,
                                         require_vision_draft)
from mmspec_cli.drafters.ssd import check_layer, layer_count, require_layer
from mmspec_cli.decoding.compiled import compile_blocker
from mmspec_cli.decoding.engine import SpeculativeDecoder
from mmspec_cli.decoding.schedules import StepCosts
from mmspec_cli.errors import InputError
from mmspec_cli.models.head_files import load_head
from mmspec_cli.models.head_folders import with_article
from mmspec_cli.models.imitation import load_imitation
from mmspec_cli.models.loading import (LoadedModel, check_tokenizer_files, is_language_model, load_model,
                                       model_type_on_disk, pair_draft)
from mmspec_cli.models.profiles import HeadSpec, Profile, apply_overrides, load_profile
from mmspec_cli.models.prompts import shorten
from mmspec_cli.models.threads import ENV as THREADS_ENV, ThreadChoice, apply_threads, check_count
from mmspec_cli.decoding.sampling import SamplingParams

#: ``threads=`` of :meth:`ModelSet.load` and :func:`load_decoder`: make mmspec's thread choice, as the CLI does.
AUTO_THREADS = "auto"


@dataclass
class ModelSet:
    """The models a profile names, loaded once and shared by the decoders of several drafters."""

    profile: Profile
    target: LoadedModel
    draft: LoadedModel | None = None
    captioner: Captioner | None = None
    heads: dict[str, Any] = field(default_factory=dict)  # kind -> loaded DraftHead (eagle, vispec) or Eagle3Head (eagle3)
    imitation: Any = None  # FastVLM's imitation network for ssd.layer, when ssd.imitation names one
    threads: ThreadChoice | None = None  # the CPU thread choice made at loading; None: torch's setting left alone
    #: drafter -> the step costs ``--gamma-schedule cost`` chooses γ from (``bench/latency.run_step_costs``)
    step_costs: dict[str, StepCosts] = field(default_factory=dict)

    @classmethod
    def load(cls, profile: Profile, drafters: Sequence[str], threads: int | str | None = AUTO_THREADS) -> "ModelSet":
        """Load what ``drafters`` need: the draft only if one drafts, the captioner only for ``c``.

        Everything that can be refused (drafter names, missing captioner, an ``ssd.layer`` the
        target doesn't have, tokenizer mismatch) is refused here, before any decoding starts.

        ``threads``: ``"auto"`` (the default) sets torch's CPU threads by mmspec's choice for the target, as the
        CLI does without ``--threads`` (``models/threads.py``); an integer sets that many; ``None`` leaves torch's
        setting alone. The choice is kept in ``self.threads``.
        """
        if threads is not None and threads != AUTO_THREADS:
            check_count(threads, "threads")  # a bad count is refused before anything loads
        elif threads == AUTO_THREADS and os.environ.get(THREADS_ENV, "").strip():
            check_count(os.environ[THREADS_ENV], THREADS_ENV)
        plans = check_profile_runs(profile, drafters)
        decoding = profile.decoding
        head_specs = {p.head: head_spec(profile, p.head) for p in plans if p.head is not None}
        models = cls(profile, load_model(profile.target, "target", multi_gpu_ok=True))
        warn_unapplied_generation(models.target)
        if threads is not None:
            models.threads = apply_threads(None if threads == AUTO_THREADS else threads, models.target.model)
        if profile.ssd.layer is not None:  # a layer the target lacks is a mistake even when no ssd drafter runs
            check_layer(profile.ssd.layer, layer_count(models.target.model))
        if profile.ssd.imitation is not None and any(p.name == "ssd" for p in plans):
            models.imitation = load_imitation(profile.ssd.imitation, profile.ssd.layer, models.target)
        if any(p.needs_draft for p in plans) and profile.draft is not None:
            warn_if_self_draft(profile)
            models.draft = load_model(profile.draft, "draft", fallback_processor=models.target.processor)
            pair_draft(models.target, models.draft)
        if any(p.needs_captioner for p in plans):
            spec = profile.captioner
            models.captioner = Captioner(load_model(spec, "captioner"), spec.prompt, spec.max_new_tokens)
        for kind, spec in head_specs.items():
            models.heads[kind] = load_head(spec.model, spec.kind, spec.num_q, models.target, spec.revision,
                                            drafter=kind)
        if decoding.compile:
            check_compilable(models)
        return models

    def decoder(self, drafter: str, ssd_layer: int | None = None, imitation: Any = None,
                recorded: Sequence[Sequence[int]] | None = None,
                step_costs: StepCosts | None = None) -> SpeculativeDecoder:
        """A fresh decoder (own KV caches) for ``drafter`` over the shared models.

        ``ssd_layer`` replaces the profile's ``ssd.layer`` for this decoder (``select-layer`` tries several);
        ``imitation``, the imitation network ``ssd`` drafts through (default: the profile's, at its layer);
        ``recorded``, for ``oracle``: the token ids of each turn of a first ``ar`` run of the same input
        (:meth:`recorded_by_ar`); ``step_costs``, what ``--gamma-schedule cost`` chooses γ from (default:
        ``self.step_costs[drafter]``; none: the constant γ).
        """
        profile, decoding = self.profile, self.profile.decoding
        layer = profile.ssd.layer if ssd_layer is None else ssd_layer
        if imitation is None and layer == profile.ssd.layer:
            imitation = self.imitation
        return SpeculativeDecoder(
            self.target,
            build_drafter(drafter, self.target, self.draft, ensemble=profile.ensemble,
                          default_members=profile.ensemble.members, pool_kernel=profile.pooling.kernel,
                          captioner=self.captioner, seed=decoding.seed or 0, ssd_layer=layer,
                          head=self.heads.get(drafter),
                          imitation=imitation, recorded=recorded),
            gamma=decoding.gamma,
            max_new_tokens=decoding.max_new_tokens,
            sampling=SamplingParams(decoding.temperature, decoding.top_p, decoding.top_k),
            seed=decoding.seed,
            gamma_schedule=decoding.gamma_schedule,
            tree_width=decoding.tree_width,
            tree=decoding.tree,
            tree_budget=decoding.tree_budget,
            tree_depth=decoding.tree_depth,
            tree_topk=decoding.tree_topk,
            kv="compiled" if decoding.compile else "dynamic",
            step_costs=step_costs if step_costs is not None else self.step_costs.get(drafter),
            repetition_penalty=decoding.repetition_penalty,
        )


def check_profile_runs(profile: Profile, drafters: Sequence[str], needs_ar_first: bool = False,
                       flag: str = "--drafter") -> list[DrafterPlan]:
    """Refuse, before any model loads, every drafter of ``drafters`` that ``profile`` can't run, in one line each, and
    return their plans: an unknown name; a tree or sampling that a chain-only drafter can't do (and ``oracle``
    without ``ar`` before it when ``needs_ar_first``: bench and compare take ``ar``'s record); a draft model, a
    captioner, an ``ssd.layer`` or a head of the drafter's kind that the profile lacks; an image member (``m``,
    ``p``) over a language-only draft; ``--compile`` over a quantized model; a draft whose tokenizer can't be mapped
    onto the target's (from their files alone). ``ModelSet.load`` and ``bench`` (before it opens ``--out``) both run
    it; ``flag`` names the option a fix points to."""
    plans = [parse_drafter(name, profile.ensemble.members) for name in drafters]
    decoding = profile.decoding
    check_chain_only(list(drafters), decoding.temperature == 0, decoding.tree, decoding.tree_width,
                     needs_ar_first=needs_ar_first)
    language_draft = profile.draft is not None and is_language_model(model_type_on_disk(profile.draft))
    for plan in plans:
        if plan.needs_draft and profile.draft is None:
            raise missing_draft(plan.name, flag)
        require_captioner(plan, profile.captioner is not None)
        require_vision_draft(plan, language_draft, profile.draft.model if language_draft else "")
        if plan.self_speculative:
            require_layer(profile.ssd.layer)
        if plan.head is not None:
            head_spec(profile, plan.head)  # the profile names a head of that kind
    needs_draft = any(p.needs_draft for p in plans)
    check_compilable_profile(profile, needs_draft)
    if needs_draft:
        check_tokenizer_files(profile.target, profile.draft)  # another tokenizer: refused before any weights
    return plans


def check_compilable_profile(profile: Profile, needs_draft: bool) -> None:
    """What ``decoding.compile`` refuses from the profile alone, before loading: a quantized target, or a quantized
    draft that a drafter runs (bitsandbytes' layers are not compiled)."""
    if not profile.decoding.compile:
        return
    for role, spec in (("target", profile.target), ("draft", profile.draft if needs_draft else None)):
        if spec is not None and spec.quantization:
            raise InputError(f"--compile: the {role} model can't be compiled here: a quantized (bitsandbytes) model "
                             f"is not compiled ({role}.quantization: {spec.quantization}); run without --compile, "
                             f"or set {role}.quantization: null")


def check_compilable(models: ModelSet) -> None:
    """Refuse ``decoding.compile`` (``--compile``) in one line when the target or the draft model can't be
    compiled here (no C++ compiler, a device other than CPU or CUDA, a quantized model, sliding-window layers)."""
    for role, loaded in (("target", models.target), ("draft", models.draft)):
        why = None if loaded is None else compile_blocker(loaded.model)
        if why:
            raise InputError(f"--compile: the {role} model can't be compiled here: {why}; run without --compile")


def recorded_by_ar(models: ModelSet, images: Sequence[Any], questions: Sequence[str], raw_prompt: str | None = None,
                   history: Sequence[tuple[str, str]] = (),
                   turn_images: dict[int, Sequence[Any]] | None = None) -> list[list[int]]:
    """What ``oracle`` replays: the token ids of each turn of a first ``ar`` run of these inputs."""
    generation = models.decoder("ar").generate(images, questions, raw_prompt, history=history,
                                               turn_images=turn_images)
    return [turn.token_ids for turn in generation.turns]


def head_spec(profile: Profile, kind: str) -> HeadSpec:
    """The profile's head for drafter ``kind``: the one of that kind, or its only head when that one names no kind."""
    heads = profile.head
    chosen = [h for h in heads if h.kind == kind] or [h for h in heads if h.kind is None]
    if not chosen:
        have = ", ".join(f"{h.kind} ({shorten(h.model)})" for h in heads)
        raise InputError(f"drafter '{kind}' needs {with_article(kind)} head and the profile names "
                         f"{'only ' + have if have else 'no head'}; add `head: {{model: PATH, kind: {kind}}}` to the "
                         f"profile, or train one with `mmspec train-head {kind}`")
    return chosen[0]


#: generation_config settings that change which token ``generate`` picks and that mmspec's verification does not apply,
#: with the value that leaves them off
UNAPPLIED_GENERATION = {"no_repeat_ngram_size": 0, "min_new_tokens": None, "min_length": 0, "bad_words_ids": None,
                        "suppress_tokens": None, "begin_suppress_tokens": None, "sequence_bias": None,
                        "forced_bos_token_id": None, "forced_eos_token_id": None,
                        "exponential_decay_length_penalty": None, "watermarking_config": None}


def unapplied_generation_settings(generation_config: Any) -> dict[str, Any]:
    """What ``generation_config`` sets among :data:`UNAPPLIED_GENERATION` (its repetition penalty is applied:
    ``SpeculativeDecoder``)."""
    settings = {key: getattr(generation_config, key, None) for key in UNAPPLIED_GENERATION}
    return {key: value for key, value in settings.items()
            if value is not None and value != UNAPPLIED_GENERATION[key] and value != []}


def warn_unapplied_generation(target: LoadedModel) -> None:
    """One ``warning:`` line when the target's ``generation_config.json`` asks ``generate`` for a logits processor that
    mmspec does not apply: its output is then the target's decoding without it, as ``generate`` gives with it off."""
    settings = unapplied_generation_settings(target.model.generation_config)
    if settings:
        said = ", ".join(f"{key} {value}" for key, value in settings.items())
        off = ", ".join(f"{key}={UNAPPLIED_GENERATION[key]}" for key in settings)
        print(f"warning: {shorten(target.name)}'s generation_config.json sets {said}, which mmspec does not apply; "
              f"the output is the target's own without it, as generate(..., {off}) gives", file=sys.stderr)


def warn_if_self_draft(profile: Profile) -> None:
    """One ``warning:`` line on stderr when the draft is the target itself (same model and revision).

    Not an error (the output stays the target's), but every draft step then costs as much as a
    verification step, so drafting can't be faster than ``ar``.
    """
    target, draft = profile.target, profile.draft
    if draft is not None and (draft.model, draft.revision) == (target.model, target.revision):
        print(f"warning: the draft is the target itself ({shorten(draft.model)}), so drafting can't be faster "
              f"than ar; name a smaller model under draft: in the profile", file=sys.stderr)


def decoder_from_profile(profile: Profile, threads: int | str | None = AUTO_THREADS,
                         step_costs: StepCosts | None = None) -> SpeculativeDecoder:
    """Load the profile's models and build the decoder of its drafter (``threads``: as :meth:`ModelSet.load`;
    ``step_costs``: as :meth:`ModelSet.decoder`)."""
    return ModelSet.load(profile, [profile.drafter], threads=threads).decoder(profile.drafter, step_costs=step_costs)


def load_decoder(profile: str | None = None, *, threads: int | str | None = AUTO_THREADS,
                 step_costs: StepCosts | None = None, **overrides) -> SpeculativeDecoder:
    """``load_decoder("llava15-7b", drafter="t", gamma=3)``: a profile name or path plus flag overrides.

    CPU threads are set as the CLI sets them (the module docstring): ``threads="auto"`` by default, ``threads=N``
    for N threads, ``threads=None`` to leave torch's setting alone. Tree settings that disagree are refused before
    any model loads, as the CLI refuses them (a keyword is named as its flag, a profile value by its key).
    ``step_costs``: what ``gamma_schedule="cost"`` chooses γ from (``mmspec_cli.bench.latency.step_costs`` of a
    cached ``profile-latency`` result; without it the constant γ).
    """
    chosen = apply_overrides(load_profile(profile), **overrides)
    if chosen.decoding.gamma_schedule == "cost" and step_costs is None and chosen.drafter != "ar":
        print(f"note: gamma_schedule cost was given no step_costs; drafter {chosen.drafter} drafts the constant "
              f"γ = {chosen.decoding.gamma} (pass step_costs=: run_step_costs(profile, [drafter], device, threads)[0]"
              f"[drafter] of mmspec_cli.bench.latency, after mmspec profile-latency)", file=sys.stderr)
    return decoder_from_profile(chosen, threads=threads, step_costs=step_costs)
