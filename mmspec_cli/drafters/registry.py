"""Drafter names -> drafter objects.

Names: ``ar``; single methods ``m``, ``t``, ``c``, ``p``; static ensembles, any combination
of those letters without repeats (``mt``, ``mtc``, ``mtcp``, ...; IbED Alg. 1, equal
weights); ``tabed`` (members from the profile's ``ensemble.members``, default ``[m, t]``)
and ``tabed:LETTERS`` (TABED Alg. 1, weights from ``ensemble.policy``); ``ssd``, self-speculative
drafting with the target's first ``ssd.layer`` layers (FastVLM), through the profile's imitation network
when ``ssd.imitation`` names one (``ssd:plain``: never), which is never an ensemble member;
``eagle`` and ``vispec``, a trained draft head over the target's features (the profile's ``head:``),
never ensemble members either; ``oracle``, a benchmarking drafter that replays a first ``ar`` run's output
(:mod:`.oracle`; built from that recording, greedy only, chains only); ``pld``, prompt-lookup decoding
(:mod:`.pld`; no model drafts: it copies what followed an earlier occurrence of the last n-gram; chains only, never
an ensemble member).
``m`` and ``t`` alone run on the plain cached-model path, which works with any
image-text-to-text draft class; everything else runs as rows of one batched forward
(:mod:`.rows`), whose image rows need a LLaVA-1.5-style or a Qwen-VL draft.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mmspec_cli.drafters.captioner import Captioner
from mmspec_cli.models.profiles import EnsembleSpec
from mmspec_cli.choices import BENCH_PEERS, HEAD_KINDS, MEMBER_LETTERS, ORACLE, SSD_PLAIN, tree_kind
from mmspec_cli.errors import InputError
from mmspec_cli.models.head_folders import with_article
from mmspec_cli.models.loading import LoadedModel
from mmspec_cli.decoding.drafter import Drafter
from mmspec_cli.drafters.autoregressive import NoDrafter
from mmspec_cli.drafters.ensemble import EnsembleDrafter
from mmspec_cli.drafters.rows import check_row_images
from mmspec_cli.drafters.head import HeadDrafter
from mmspec_cli.drafters.oracle import NO_SAMPLING, NO_TREES as ORACLE_TREES, OracleDrafter
from mmspec_cli.drafters.pld import NO_TREES as PLD_TREES, PLD, PromptLookupDrafter
from mmspec_cli.drafters.ssd import SelfSpeculativeDrafter
from mmspec_cli.drafters.single import SingleModelDrafter, multimodal_view, text_only_view
from mmspec_cli.drafters.views import caption_row, multimodal_row, pooled_row, text_only_row

#: The drafters named as a whole rather than combined from member letters, as the refusals of an unknown or empty
#: name list them (tests/test_registry.py ties them to the README's drafter table).
WHOLE_NAMES = ("ar", "ssd", *HEAD_KINDS, PLD, ORACLE)


#: The kinds of drafter a name plans (:attr:`DrafterPlan.kind`). Three draft with a network, and their drafting is
#: priced by that network's step (Eq. (1)'s c, ``--gamma-schedule cost``) as ``profile-latency`` times it:
DRAFT_MODEL = "draft model"  # m, t, c, p and ensembles: T_q(B, S, 1), one draft-model forward over its B rows
HEAD = "head"  # eagle, vispec, eagle3: T_h(S), one step of the trained head
EARLY_EXIT = "early exit"  # ssd, ssd:plain: T_s(S), the target's first ssd.layer layers (ssd: and its imitation net)
#: ... and three draft with none:
NO_DRAFTING = "no drafting"  # ar
REPLAY = "replay"  # oracle: the target's own output of a first ar run
LOOKUP = "lookup"  # pld: what followed an earlier occurrence of the last n-gram
#: Every kind, with the draft step it is priced by (None: no network drafts). A new kind is added here, so it says
#: how it is priced; ``bench/latency.own_step`` is the one place that turns a step into a cached timing.
DRAFTER_KINDS = {DRAFT_MODEL: DRAFT_MODEL, HEAD: HEAD, EARLY_EXIT: EARLY_EXIT, NO_DRAFTING: None, REPLAY: None,
                 LOOKUP: None}
DRAFT_STEPS = tuple(step for step in DRAFTER_KINDS.values() if step is not None)


@dataclass(frozen=True)
class DrafterPlan:
    """What a drafter name means: its ``kind`` (one of :data:`DRAFTER_KINDS`), its ensemble members (a draft
    model's only) and whether their weights adapt (TABED) or stay equal."""

    name: str
    kind: str
    members: tuple[str, ...] = ()
    adaptive: bool = False

    def __post_init__(self) -> None:
        if self.kind not in DRAFTER_KINDS:
            raise ValueError(f"drafter '{self.name}' is planned as a {self.kind!r} drafter, which is no kind of "
                             f"registry.DRAFTER_KINDS; add it there with the draft step it is priced by")
        if bool(self.members) != (self.kind == DRAFT_MODEL):
            raise ValueError(f"drafter '{self.name}': a {self.kind} drafter has "
                             f"{'no members' if self.kind != DRAFT_MODEL else 'members'} (got {self.members})")

    @property
    def step(self) -> str | None:
        """The draft step this drafter's drafting is priced by (:data:`DRAFTER_KINDS`); None when no network drafts."""
        return DRAFTER_KINDS[self.kind]

    @property
    def needs_draft(self) -> bool:
        return self.kind == DRAFT_MODEL

    @property
    def needs_captioner(self) -> bool:
        return "c" in self.members

    @property
    def self_speculative(self) -> bool:
        """ssd: the target's own first layers draft; no draft model."""
        return self.kind == EARLY_EXIT

    @property
    def head(self) -> str | None:
        """The kind of trained head that drafts (eagle, vispec, eagle3: the drafter's name), or None."""
        return self.name if self.kind == HEAD else None

    @property
    def model_drafts(self) -> bool:
        """Whether a network runs to draft (a draft model, the target's first layers, a head): the step Eq. (1)'s c
        and the cost schedule price. ``ar`` drafts nothing; ``oracle`` replays and ``pld`` looks up, at no model's
        cost."""
        return self.step is not None


def priced_plan(name: str, default_members: tuple[str, ...] = ("m", "t")) -> DrafterPlan:
    """The plan drafter ``name``'s drafting is priced by (Eq. (1), ``profile-latency``): its own; for a bench peer row
    (Hugging Face's assisted generation, which drafts with the draft model on one row) a one-row draft model's.
    An unknown name is the one-line refusal :func:`parse_drafter` gives."""
    if name in BENCH_PEERS:
        return DrafterPlan(name, DRAFT_MODEL, ("m",))
    return parse_drafter(name, default_members)


def model_drafts(name: str) -> bool:
    """:attr:`DrafterPlan.model_drafts` of the drafter ``name`` as it is priced (:func:`priced_plan`: a bench peer
    row drafts with the draft model)."""
    return priced_plan(name).model_drafts


def _letters(name: str, letters: str) -> tuple[str, ...]:
    if PLD in letters:
        raise InputError(f"drafter '{name}': pld can't be an ensemble member (ensemble members are rows of the draft "
                         f"model's batch; pld runs no model, it copies from the prompt); use --drafter pld alone")
    for letter in letters:
        if letter == "s":
            raise InputError(f"drafter '{name}': ssd can't be an ensemble member (ensemble members are rows of the "
                             f"draft model's batch; ssd drafts with the target's own layers); use --drafter ssd alone")
        if letter in ("v", "e"):
            head = {"e": "eagle", "v": "vispec"}[letter]
            raise InputError(f"drafter '{name}': a draft head ({head}) can't be an ensemble member (ensemble members "
                             f"are rows of the draft model's batch; a head is another network over the target's "
                             f"features, with its own cache); use --drafter {head} alone")
        if letter not in MEMBER_LETTERS:
            raise InputError(f"drafter '{name}': unknown letter '{letter}'; combine m (multimodal), t (text-only), "
                             f"c (caption), p (pooled), e.g. mt or tabed:mtcp, or name a drafter of its own: "
                             f"{', '.join(WHOLE_NAMES)}")
        if letters.count(letter) > 1:
            raise InputError(f"drafter '{name}' repeats '{letter}'; name each member once, e.g. mt")
    return tuple(letters)


def parse_drafter(name: str, default_members: tuple[str, ...] = ("m", "t")) -> DrafterPlan:
    """Parse a drafter name; one-line InputError for unknown or repeated letters, and for bench-only peers."""
    if name in BENCH_PEERS:
        raise InputError(f"'{name}' is a bench-only peer row, not a drafter of generate or compare; "
                         f"run it beside the drafters with `mmspec bench SOURCE --drafters ar,{name}`")
    if name == "ar":
        return DrafterPlan(name, NO_DRAFTING)
    if name in ("ssd", SSD_PLAIN):
        return DrafterPlan(name, EARLY_EXIT)
    if name in HEAD_KINDS:
        return DrafterPlan(name, HEAD)
    if name == ORACLE:
        return DrafterPlan(name, REPLAY)
    if name == PLD:
        return DrafterPlan(name, LOOKUP)
    if name == "tabed":
        return DrafterPlan(name, DRAFT_MODEL, tuple(default_members), adaptive=True)
    if name.startswith("tabed:"):
        members = _letters(name, name.split(":", 1)[1])
        if len(members) < 2:
            raise InputError(f"drafter '{name}' needs at least two members, e.g. tabed:mt")
        return DrafterPlan(name, DRAFT_MODEL, members, adaptive=True)
    if not name:
        raise InputError(f"empty drafter name; choose m, t, c, p, a combination such as mt, tabed, or one of "
                         f"{', '.join(WHOLE_NAMES)}")
    return DrafterPlan(name, DRAFT_MODEL, _letters(name, name))


def parse_drafter_list(text: str, default_members: tuple[str, ...] = ("m", "t"), extra: tuple[str, ...] = ()) -> list[str]:
    """``"ar, m,tabed"`` -> ["ar", "m", "tabed"]: each name checked (``extra`` names pass as they are), no repeats."""
    names = [part.strip() for part in text.split(",")]
    if not text.strip():
        raise InputError("--drafters: no drafter given; pass e.g. --drafters ar,m,t,tabed")
    for name in names:
        if not name:
            raise InputError(f"--drafters {text!r} has an empty name; separate names with single commas, e.g. m,t")
        if name not in extra:
            parse_drafter(name, default_members)
        if names.count(name) > 1:
            raise InputError(f"--drafters names '{name}' more than once; name each drafter once")
    return names


#: Drafters that draft chains only, each with its refusal of a tree: a lookup or a replay gives one continuation.
CHAIN_ONLY = {ORACLE: ORACLE_TREES, PLD: PLD_TREES}


def check_chain_only(names: list[str], greedy: bool, tree: str | None, tree_width: int,
                     needs_ar_first: bool = True) -> None:
    """Refuse what the chain-only drafters among ``names`` can't do, before loading: a tree (``oracle``, ``pld``);
    and for ``oracle``, which replays ``ar``'s greedy chain, sampling and (``needs_ar_first``: bench and compare,
    which take ``ar``'s record) an order without ``ar`` before it."""
    for name in names:
        if name in CHAIN_ONLY and tree_kind(tree, tree_width) != "chain":
            raise InputError(CHAIN_ONLY[name])
    if ORACLE not in names:
        return
    if not greedy:
        raise InputError(NO_SAMPLING)
    if needs_ar_first and ("ar" not in names or names.index("ar") > names.index(ORACLE)):
        raise InputError("--drafters: oracle replays ar's output of the same sample; list ar before it, e.g. "
                         "--drafters ar,oracle,m")


def missing_draft(name: str, flag: str = "--drafter") -> InputError:
    """The refusal of drafter ``name``, which drafts with a draft model, under a profile that names none (``flag``: the
    option its fix points to)."""
    return InputError(f"drafter '{name}' needs a draft model; add a `draft:` section to the profile, or use {flag} ar")


def require_captioner(plan: DrafterPlan, has_captioner: bool) -> None:
    """Caption drafting needs the profile's captioner: one line naming the profile key otherwise."""
    if plan.needs_captioner and not has_captioner:
        raise InputError(f"drafter '{plan.name}' uses caption drafting (c) but the profile has no captioner; "
                         f"add `captioner: {{model: ...}}` to the profile")


#: the ensemble letters whose draft sees the images (a language-only draft can't be one)
SEEING_MEMBERS = ("m", "p")


def require_vision_draft(plan: DrafterPlan, language_only: bool, draft_name: str) -> None:
    """A language-only draft (a causal language model) drafts from the text: ``m`` and ``p`` are refused in one line."""
    seeing = [m for m in plan.members if m in SEEING_MEMBERS]
    if language_only and seeing:
        raise InputError(f"drafter '{plan.name}' has member {seeing[0]}, which shows the images to the draft, but "
                         f"draft.model '{draft_name}' is a language model with no vision part; use t or c "
                         f"(e.g. --drafter t, or tabed:tc with a captioner)")


def build_drafter(
    name: str,
    target: LoadedModel,
    draft: LoadedModel | None,
    ensemble: EnsembleSpec | None = None,
    default_members: tuple[str, ...] = ("m", "t"),
    pool_kernel: int = 2,
    captioner: Captioner | None = None,
    seed: int = 0,
    ssd_layer: int | None = None,
    head=None,
    imitation=None,
    recorded=None,
) -> Drafter:
    """The drafter ``name`` over the loaded models; ``head`` is the loaded draft head for ``eagle``/``vispec``,
    ``imitation`` the imitation network ``ssd`` drafts through (``ssd:plain`` never does), ``recorded`` the token
    ids per turn of a first ``ar`` run that ``oracle`` replays."""
    plan = parse_drafter(name, default_members)
    if plan.kind == LOOKUP:
        return PromptLookupDrafter(target)
    if plan.kind == REPLAY:
        if recorded is None:
            raise InputError("drafter 'oracle' replays the output of a first ar run of the same input; run ar first "
                             "(bench and compare: list ar before oracle in --drafters)")
        return OracleDrafter(recorded)
    if plan.kind == EARLY_EXIT:
        return SelfSpeculativeDrafter(target, ssd_layer, imitation if name == "ssd" else None, name=name)
    if plan.kind == HEAD:
        if head is None or head.kind != plan.head:
            raise InputError(f"drafter '{name}' needs {with_article(plan.head)} head; add `head: {{model: PATH, kind: "
                             f"{plan.head}}}` to the profile, or train one with `mmspec train-head {plan.head}`")
        return HeadDrafter(target, head)
    if plan.kind == NO_DRAFTING and plan.name == "ar":
        return NoDrafter()
    if plan.kind != DRAFT_MODEL:  # a name parse_drafter plans for and no branch above builds: a half-registered drafter
        raise ValueError(f"drafter '{name}' has a plan but build_drafter builds nothing for it; add its branch "
                         f"(docs/ARCHITECTURE.md, How to add a drafter), rather than let it run as ar")
    if draft is None:
        raise missing_draft(name)
    require_captioner(plan, captioner is not None)
    require_vision_draft(plan, draft.language_only, draft.name)
    if plan.members in (("m",), ("t",)):
        view = multimodal_view(draft) if plan.members == ("m",) else text_only_view(target)
        return SingleModelDrafter(name, draft, view, target_vocab=target.vocab_size)
    if {"m", "p"} & set(plan.members):
        check_row_images(draft.model, pooled="p" in plan.members)  # refuse drafts whose images rows can't feed, now
    views = {
        "m": lambda: multimodal_row(draft),
        "t": lambda: text_only_row(target),
        "c": lambda: caption_row(target, captioner),
        "p": lambda: pooled_row(draft, pool_kernel),
    }
    policy = ensemble or EnsembleSpec()
    if not plan.adaptive:
        policy = dataclasses.replace(policy, policy="static")
    return EnsembleDrafter(name, plan.members, [views[m]() for m in plan.members], draft,
                           target_vocab=target.vocab_size, policy=policy, seed=seed,
                           captioner=captioner if plan.needs_captioner else None)
