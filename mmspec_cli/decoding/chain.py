"""The one chain loop: a drafter kind's draft step turned into a greedy or a sampled chain, eager or compiled.

Every drafter that drafts a chain with a network (a draft model, a batch of member rows, a trained
head, the target's early exit) writes one *draft step*, :class:`DraftStep`: what one forward gives for
one token fed after its state. The first proposal of a block comes from the drafter's catch-up (the
forward that feeds the verified tokens its state lacks), or from what it carries (a head's last output, through
its LM head: :attr:`DraftStep.first_of`). In a block after a turn's first, what a draft model's state lacks is one
verified token (the block before rejected a draft) or two (it accepted every one: the last draft, never fed, and
the target's token): that *lead* is handed to :func:`draft_chain`, which feeds it in the chain's own graph when
compiled, so that the block makes no eager forward for it; then

    token₁ = choose(proposal₀); proposal₁ = step(token₁); token₂ = choose(proposal₁); ...

until γ tokens are chosen. The last token is never fed: no draft step reads it. That loop is
:func:`chain_loop`, and nothing else in mmspec loops over draft steps.

**Eager or compiled** is decided in one place, :func:`draft_chain`: a greedy chain whose step has a
compiled graph (``--compile``) runs :func:`chain_loop` inside ONE graph over the step's traced form (the
graph is built by :func:`~mmspec_cli.decoding.compiled.compiled_chain`, from the same loop); a sampled
chain, or one whose graph can't run now, runs the same loop eagerly, one forward per token.

A *proposal* is what a token is chosen from: logits (a model or a head: the picker applies temperature
and top-p), or a distribution already (an ensemble's mixture), with whatever the drafter keeps per
token (an ensemble's member distributions) riding along.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mmspec_cli.decoding.sampling import TokenPicker, argmax_ids


def chain_loop(first: Any, carry: Any, feed: Callable[[Any, Any, int], tuple[Any, Any]], steps: int,
               choose: Callable[[Any], tuple[Any, Any]]) -> tuple[list[Any], list[Any]]:
    """THE chain loop: ``steps`` tokens, each chosen from the proposal before it, every token but the last fed.

    ``first``: the proposal after the verified tokens; ``feed(token, carry, i)`` feeds the i-th chosen token and
    returns the next proposal and the step's carry (a head's hidden state, the rows' visible slots); ``choose``
    turns a proposal into (token, what to keep of it). Returns the tokens and what was kept of each proposal.
    Eager, tokens are ints; inside a compiled graph, (1,)-tensors.
    """
    tokens, kept = [], []
    proposal = first
    for i in range(steps):
        token, record = choose(proposal)
        tokens.append(token)
        kept.append(record)
        if i + 1 < steps:
            proposal, carry = feed(token, carry, i)
    return tokens, kept


def greedy_choice(proposal: Any) -> tuple[torch.Tensor, Any]:
    """A compiled chain's choice: the argmax of the proposal's first part, as a (1,) tensor; the rest kept."""
    if isinstance(proposal, tuple):
        return proposal[0].reshape(-1).argmax().reshape(1), proposal[1]
    return proposal.reshape(-1).argmax().reshape(1), None


def picker_choice(picker: TokenPicker, from_logits: bool) -> Callable[[Any], tuple[int, Any]]:
    """An eager chain's choice: logits through the picker (greedy argmax, or a draw at its temperature and top-p:
    the draw's distribution kept), or a distribution itself (argmax, or a draw from it: itself kept); a proposal
    that is a (proposal, extra) pair keeps (distribution, extra)."""

    def choose(proposal: Any) -> tuple[int, Any]:
        extra = None
        if isinstance(proposal, tuple):
            proposal, extra = proposal
        if from_logits:
            token, drawn_from = picker.choose(proposal)
        else:
            token = int(argmax_ids(proposal)) if picker.greedy else picker.choose_from(proposal)
            drawn_from = None if picker.greedy else proposal
        return token, drawn_from if extra is None else (drawn_from, extra)

    return choose


@dataclass
class DraftStep:
    """One drafter kind's draft step, as :func:`draft_chain` runs it.

    - ``feed(token, carry, i)``: feed the chain's i-th chosen token eagerly after the owner's state (its
      bookkeeping included); the next proposal and carry;
    - ``from_logits``: whether proposals are logits (else distributions);
    - ``compiled(first, lead, carry, steps)``: the whole greedy chain in one compiled graph (the tokens, and what
      was kept of each proposal: a list, or the graph's own stacked tensor, a row per proposal), the lead fed
      first when there is one, the owner's bookkeeping included; None when it can't run now (not compiled, a
      state not allocated yet, compiling failed): the loop then runs eagerly;
    - ``first_of(carry)``: for a step whose catch-up leaves only its carry (a head: its last output), the first
      proposal from it (the head's LM head). :func:`draft_chain` is then given no ``first``: the eager loop calls
      this, and a compiled chain computes the same inside its graph (``first`` None), so that the block makes no
      eager call for it;
    - ``catch_up(lead, carry)``: for a step that takes a lead, feed it eagerly in one forward (the drafter's
      catch-up); the first proposal and carry.
    """

    feed: Callable[[Any, Any, int], tuple[Any, Any]]
    from_logits: bool = True
    compiled: Callable[[Any, list[int] | None, Any, int], tuple[list[int], Any] | None] | None = None
    first_of: Callable[[Any], Any] | None = None
    catch_up: Callable[[list[int], Any], tuple[Any, Any]] | None = None


def draft_chain(step: DraftStep, first: Any, carry: Any, gamma: int, picker: TokenPicker,
                lead: list[int] | None = None) -> tuple[list[int], list[Any]]:
    """A chain of ``gamma`` tokens from ``step``: in one compiled graph when greedy and the step has one that can run
    now, else :func:`chain_loop` eagerly. ``first`` is the proposal after the held tokens, or None for a step that
    makes it from the carry (:attr:`DraftStep.first_of`) or from ``lead``: the verified tokens the state lacks,
    fed before the chain (:attr:`DraftStep.catch_up` eagerly; a compiled chain feeds them inside its graph).
    Returns the tokens and what was kept of each proposal (the distribution a sampled token was drawn from, an
    ensemble's member distributions)."""
    if picker.greedy and step.compiled is not None and gamma > 1:
        out = step.compiled(first, lead, carry, gamma)
        if out is not None:
            return out
    if lead is not None:
        if step.catch_up is None:
            raise TypeError("draft_chain was given a lead, and its DraftStep has no catch_up to feed it")
        first, carry = step.catch_up(lead, carry)
    elif first is None:
        if step.first_of is None:
            raise TypeError("draft_chain was given no first proposal, and its DraftStep has no first_of to make one")
        first = step.first_of(carry)
    return chain_loop(first, carry, step.feed, gamma, picker_choice(picker, step.from_logits))
