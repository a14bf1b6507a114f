"""Pure logic of ``mmspec compare``: where greedy outputs first differ, and weight sparklines.

Nothing here imports torch or touches a model, so it is cheap to import and to test.

- :func:`first_divergence` finds the first (turn, token index) at which the token ids of
  several drafters' outputs differ. Under greedy decoding speculative decoding is lossless,
  so every drafter must give the target's own tokens: any divergence is a bug.
- :func:`weight_share` turns each block's ensemble weights into one number per block, e.g.
  ``w_m / (w_m + w_t)`` for TABED (TABED Fig. 3); :func:`sparkline` draws such a series.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

SPARK_CHARS = "▁▂▃▄▅▆▇█"
GAP = " "  # a block without weights (it drafted nothing)


@dataclass(frozen=True)
class Divergence:
    """The first place where the outputs differ.

    ``turn`` and ``index`` are 0-based: the token is ``turns[turn].token_ids[index]``. Every
    output has the same ids before it (``prefix``, the ids of that turn before ``index``; all
    earlier turns are identical). ``tokens`` maps every drafter to its id there, or ``None``
    where its output of that turn had already ended. ``differing`` are the drafters whose id
    differs from the ``reference`` drafter's, in input order.
    """

    turn: int
    index: int
    reference: str
    differing: tuple[str, ...]
    tokens: dict[str, int | None]
    prefix: list[int]

    def groups(self) -> list[tuple[tuple[str, ...], int | None]]:
        """Drafters grouped by the id they have at the divergence; the reference's group first."""
        order: dict[int | None, list[str]] = {self.tokens[self.reference]: []}
        for name, token in self.tokens.items():
            order.setdefault(token, []).append(name)
        return [(tuple(names), token) for token, names in order.items()]


def first_divergence(outputs: Mapping[str, Sequence[Sequence[int]]], reference: str | None = None) -> Divergence | None:
    """The first (turn, index) where the outputs' token ids differ, or None if all are identical.

    ``outputs`` maps each drafter to its token ids per turn. Outputs of different lengths
    diverge at the shorter length (the shorter output's token is ``None`` there); a missing
    turn counts as an empty one. ``reference`` (default: the first drafter) is the output the
    others are compared with in :attr:`Divergence.differing`.
    """
    if not outputs:
        return None
    names = list(outputs)
    reference = names[0] if reference is None else reference
    if reference not in outputs:
        raise ValueError(f"reference {reference!r} is not one of the outputs: {', '.join(names)}")
    n_turns = max(len(turns) for turns in outputs.values())
    for turn in range(n_turns):
        seqs = {name: list(outputs[name][turn]) if turn < len(outputs[name]) else [] for name in names}
        for index in range(max(len(s) for s in seqs.values())):
            tokens = {name: (s[index] if index < len(s) else None) for name, s in seqs.items()}
            if len(set(tokens.values())) > 1:
                differing = tuple(n for n in names if tokens[n] != tokens[reference])
                return Divergence(turn=turn, index=index, reference=reference, differing=differing,
                                  tokens=tokens, prefix=seqs[reference][:index])
    return None


def sparkline(values: Sequence[float | None], lo: float | None = None, hi: float | None = None) -> str:
    """One bar per value, ``▁`` at ``lo`` to ``█`` at ``hi``; ``None`` is a gap (a space).

    ``lo``/``hi`` default to the smallest/largest value; values outside are clamped. When the
    range is empty (constant input, ``lo == hi``) every bar is the middle one, ``▅``.
    """
    present = [v for v in values if v is not None]
    if not present:
        return GAP * len(values)
    lo = min(present) if lo is None else lo
    hi = max(present) if hi is None else hi
    top = len(SPARK_CHARS) - 1
    out = []
    for v in values:
        if v is None:
            out.append(GAP)
            continue
        fraction = 0.5 if hi <= lo else min(max((v - lo) / (hi - lo), 0.0), 1.0)
        out.append(SPARK_CHARS[round(fraction * top)])
    return "".join(out)


def weight_share(weights: Sequence[Sequence[float] | None], members: Sequence[str], member: str = "m",
                 other: str | None = "t") -> list[float | None]:
    """Per block, ``w_member / (w_member + w_other)``; with ``other=None``, ``w_member / sum(w)``.

    ``weights`` holds each block's weights in the order of ``members``. A block without
    weights (it drafted nothing), or whose denominator is 0, gives ``None``.
    """
    members = list(members)
    for name in (member, other):
        if name is not None and name not in members:
            raise ValueError(f"member {name!r} is not one of {members}")
    i = members.index(member)
    j = None if other is None else members.index(other)
    shares: list[float | None] = []
    for w in weights:
        if w is None:
            shares.append(None)
            continue
        total = sum(w) if j is None else w[i] + w[j]
        shares.append(w[i] / total if total > 0 else None)
    return shares


@dataclass(frozen=True)
class ShareSpec:
    """Which weight share to draw for an ensemble: ``member`` over ``other`` (or over all members)."""

    member: str
    other: str | None

    @property
    def label(self) -> str:
        if self.other is None:
            return f"w_{self.member}/Σw"
        return f"w_{self.member}/(w_{self.member}+w_{self.other})"


def share_spec(members: Sequence[str]) -> ShareSpec | None:
    """TABED's ``w_m / (w_m + w_t)`` when both m and t are members, else the first member's share of all."""
    if not members:
        return None
    if "m" in members and "t" in members:
        return ShareSpec("m", "t")
    return ShareSpec(members[0], None)


def endpoints(values: Sequence[float | None]) -> tuple[float, float] | None:
    """The first and last value that are not None, or None if there are none."""
    present = [v for v in values if v is not None]
    return (present[0], present[-1]) if present else None
