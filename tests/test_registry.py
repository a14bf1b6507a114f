"""The drafter registry (``drafters/registry.py``): what a drafter name means, and each refusal of a name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mmspec_cli.drafters import build_drafter
from mmspec_cli.drafters.registry import NO_DRAFTING, WHOLE_NAMES, DrafterPlan, model_drafts, parse_drafter
from mmspec_cli.errors import InputError

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


@pytest.mark.parametrize("name, fragment", [
    ("mx", "unknown letter 'x'"), ("mtm", "repeats 'm'"), ("tabed:mm", "repeats 'm'"), ("tabed:m", "at least two"),
    ("tabed:mq", "unknown letter 'q'"), ("", "empty drafter name"),
])
def test_bad_drafter_names_are_one_line_errors(name, fragment):
    with pytest.raises(InputError, match=fragment) as info:
        parse_drafter(name)
    assert "\n" not in str(info.value)


def test_a_name_planned_but_never_built_is_not_run_as_ar(tiny_models, monkeypatch):
    """A drafter registered in ``parse_drafter`` alone would fall through to ``ar``'s NoDrafter and look lossless
    while drafting nothing; ``build_drafter`` says so instead."""
    from mmspec_cli.drafters import registry

    monkeypatch.setattr(registry, "parse_drafter", lambda name, members=("m", "t"): DrafterPlan(name, NO_DRAFTING))
    with pytest.raises(ValueError, match="drafter 'repeat' has a plan but build_drafter builds nothing for it"):
        registry.build_drafter("repeat", tiny_models["target"], tiny_models["perturbed"])
    assert type(registry.build_drafter("ar", tiny_models["target"], None)).__name__ == "NoDrafter"


def test_an_unknown_name_is_refused_with_every_drafter_named_as_a_whole():
    """The README's drafter table is the list users read: each drafter of its own there (a name with no ensemble
    members) is in ``WHOLE_NAMES``, which the refusals of an unknown name list, and nothing else is."""
    section = README.split("## Drafters", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `") and "--drafter" not in line]
    named = [name for row in rows for name in re.findall(r"`([\w:]+)`", row)]
    own = [name for name in named if not parse_drafter(name).members]
    assert own == list(WHOLE_NAMES)
    with pytest.raises(InputError) as info:
        parse_drafter("mz")
    assert str(info.value).endswith(f"name a drafter of its own: {', '.join(WHOLE_NAMES)}")


def test_caption_drafting_without_a_captioner_is_refused(tiny_models):
    with pytest.raises(InputError, match="no captioner"):
        build_drafter("mtc", tiny_models["target"], tiny_models["perturbed"])


def test_tabed_uses_the_profile_members_and_policy():
    plan = parse_drafter("tabed", ("m", "t", "p"))
    assert plan.members == ("m", "t", "p") and plan.adaptive
    assert parse_drafter("tabed:ct").members == ("c", "t")
    assert not parse_drafter("mtcp").adaptive


def test_a_name_says_whether_a_network_drafts():
    """What Eq. (1)'s c and the cost schedule price: a draft model, the target's first layers or a head; not ``ar``,
    a replay or a lookup. The registry says it, so bench and profile-latency list no drafter by name."""
    names = ("ar", "m", "t", "mt", "tabed", "ssd", "ssd:plain", "eagle", "eagle3", "oracle", "pld", "hf-assisted")
    assert [name for name in names if model_drafts(name)] == ["m", "t", "mt", "tabed", "ssd", "ssd:plain", "eagle",
                                                               "eagle3", "hf-assisted"]
