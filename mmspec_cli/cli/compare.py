"""``mmspec compare``: run several drafters on the same input and show them side by side.

The models are loaded once (:class:`~mmspec_cli.api.ModelSet`) and each drafter gets a fresh
decoder over them, so every drafter answers the same prompt with the same target. Under
greedy decoding every output must be the target's own, token for token; the command checks
that and reports the first divergence (exit 1). Exit 2 is bad input, as for every command.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import typer

from mmspec_cli.choices import ORACLE
from mmspec_cli.cli.options import Images, ProfileName, Questions, Threads, check_threads, decoding_flags, step_costs
from mmspec_cli.cli.comparison import (Divergence, ShareSpec, endpoints, first_divergence, share_spec, sparkline,
                                       weight_share)
from mmspec_cli.errors import InputError
from mmspec_cli.models.images import load_images
from mmspec_cli.models.profiles import Profile, apply_overrides, load_profile
from mmspec_cli.models.prompts import check_questions

DEFAULT_DRAFTERS = "m,t,mt,tabed"
EXIT_DIFFERENT = 1  # greedy outputs differ: a lossless violation


@decoding_flags(help={"temperature": "0 for greedy decoding, where all outputs must be identical."})
def compare(
    images: Images = None,
    question: Questions = None,
    drafters: Annotated[str, typer.Option(metavar="A,B,...", help=(
        "Comma-separated drafters to compare, e.g. ar,m,t,c,p,mt,tabed,pld; oracle (a benchmark tool, after ar) replays "
        "ar's output.")) ] = DEFAULT_DRAFTERS,
    profile: ProfileName = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object: outputs, stats, weights, verdict.")] = False,
    threads: Threads = None,
    turn_image: Annotated[list[str] | None, typer.Option("--turn-image", hidden=True)] = None,
    *,
    overrides: dict,
) -> None:
    """Run several drafters on the same images and questions and compare them side by side.

    Shows each drafter's output (accepted draft tokens green, target tokens cyan), block
    efficiency, acceptance rate, speed and, for ensembles, the weight trajectory. Under greedy
    decoding the outputs must be identical; if not, the first divergence is shown and the
    exit code is 1. Every image opens the conversation: compare takes no --turn-image.
    """
    if turn_image:  # generate's flag, given here: say what compare does instead of "no such option"
        raise InputError("compare shows every IMAGE in the first turn and takes no --turn-image; run `mmspec "
                         "generate --turn-image N:IMAGE` per drafter, or `mmspec bench` over a manifest whose later "
                         "turns bring images")
    pictures = load_images(images or [])
    questions = check_questions(question or [], None)
    chosen = apply_overrides(load_profile(profile), **overrides)
    names = drafter_names(drafters, chosen.ensemble.members)
    from mmspec_cli.drafters.registry import check_chain_only

    decoding = chosen.decoding
    check_chain_only(names, decoding.temperature == 0, decoding.tree, decoding.tree_width)
    threads = check_threads(threads)
    from mmspec_cli.cli.display import forget_compiling, is_terminal

    terminal = is_terminal(sys.stdout)
    forget_compiling()
    outcome = _run(chosen, pictures, questions, names, progress=terminal and not as_json, threads=threads)
    if as_json:
        typer.echo(json.dumps(comparison_json(outcome)))
    elif terminal:
        from rich.console import Console

        Console().print(rich_report(outcome))
    else:
        typer.echo(plain_report(outcome), nl=False)
    from mmspec_cli.cli.display import report_compiling

    report_compiling()
    if outcome.identical is False:
        raise typer.Exit(EXIT_DIFFERENT)


def drafter_names(value: str, default_members: tuple[str, ...]) -> list[str]:
    """``"m, t,tabed"`` -> ``["m", "t", "tabed"]``, each name checked; one-line InputError otherwise."""
    from mmspec_cli.drafters.registry import parse_drafter_list  # pulls in torch: import only when needed

    return parse_drafter_list(value, default_members)


# --------------------------------------------------------------------------- running


@dataclass
class Outcome:
    """Everything a report needs: the runs, and the verdict of the identity check."""

    profile: Profile
    questions: list[str]
    generations: dict[str, Any]  # drafter -> engine.Generation, in the order given
    tokenizer: Any
    greedy: bool
    divergence: Divergence | None

    @property
    def identical(self) -> bool | None:
        """None when sampling: outputs then legitimately differ."""
        return self.divergence is None if self.greedy else None


def _run(profile: Profile, pictures: list, questions: list[str], names: list[str], progress: bool,
         threads: int | None = None) -> Outcome:
    """Load the models once and run every drafter on the same input."""
    from rich.console import Console

    from mmspec_cli.api import ModelSet  # the engine pulls in torch and transformers: import only when needed

    from mmspec_cli.models.threads import apply_threads

    models = ModelSet.load(profile, names, threads=None)  # threads: the CLI's choice, made below
    apply_threads(threads, models.target.model)
    models.step_costs = step_costs(profile, names, models.target.model.device, threads)  # after the threads
    status = Console(stderr=True)
    generations = {}
    for i, name in enumerate(names, start=1):
        recorded = [t.token_ids for t in generations["ar"].turns] if name == ORACLE else None  # ar ran before it
        decoder = models.decoder(name, recorded=recorded)
        if progress:
            with status.status(f"running drafter {name} ({i}/{len(names)})"):
                generations[name] = decoder.generate(pictures, questions)
        else:
            generations[name] = decoder.generate(pictures, questions)
    greedy = profile.decoding.temperature == 0
    divergence = None
    if greedy:
        ids = {name: [turn.token_ids for turn in g.turns] for name, g in generations.items()}
        divergence = first_divergence(ids, reference="ar" if "ar" in ids else None)
    return Outcome(profile, questions, generations, models.target.tokenizer, greedy, divergence)


# --------------------------------------------------------------------------- pieces


def token_text(tokenizer: Any, prefix: Sequence[int], token: int | None) -> str | None:
    """How ``token`` reads after ``prefix`` (with its leading space); special tokens are shown."""
    if token is None:
        return None
    before = tokenizer.decode(list(prefix), skip_special_tokens=False)
    after = tokenizer.decode([*prefix, token], skip_special_tokens=False)
    return after[len(before):] if after.startswith(before) else tokenizer.decode([token], skip_special_tokens=False)


def block_weights(generation: Any) -> list[list[float] | None]:
    """Each block's weights over all turns, in order; None for a block that drafted nothing."""
    return [block.weights for turn in generation.turns for block in turn.blocks]


def has_weights(generation: Any) -> bool:
    return bool(generation.members) and any(w is not None for w in block_weights(generation))


@dataclass(frozen=True)
class Trajectory:
    """One turn's weight share per block, for the sparkline."""

    spec: ShareSpec
    turn: int
    shares: list[float | None]

    @property
    def line(self) -> str:
        return sparkline(self.shares, lo=0.0, hi=1.0)

    @property
    def ends(self) -> str:
        found = endpoints(self.shares)
        return "-" if found is None else f"{found[0]:.2f} → {found[1]:.2f}"


def trajectories(generation: Any) -> list[Trajectory]:
    """Per turn, the share TABED Fig. 3 plots (``w_m/(w_m+w_t)``), or the first member's share of all."""
    spec = share_spec(generation.members)
    if spec is None or len(generation.members) < 2 or not has_weights(generation):
        return []  # a lone member (e.g. p, run as a one-row ensemble) always has weight 1
    return [Trajectory(spec, turn, weight_share([b.weights for b in result.blocks], generation.members,
                                                spec.member, spec.other))
            for turn, result in enumerate(generation.turns)]


def divergence_json(outcome: Outcome) -> dict | None:
    d = outcome.divergence
    if d is None:
        return None
    tok = outcome.tokenizer
    return {"turn": d.turn, "index": d.index, "reference": d.reference, "differing": list(d.differing),
            "tokens": d.tokens, "token_texts": {name: token_text(tok, d.prefix, t) for name, t in d.tokens.items()},
            "prefix_ids": d.prefix, "prefix_text": tok.decode(d.prefix, skip_special_tokens=True).strip()}


def comparison_json(outcome: Outcome) -> dict:
    """The ``--json`` object."""
    drafters = []
    for name, generation in outcome.generations.items():
        entry: dict[str, Any] = {"drafter": name}
        if generation.members:
            entry["members"] = list(generation.members)
        entry["turns"] = [{"text": t.text, "token_ids": t.token_ids, "stats": t.stats.as_dict()}
                          for t in generation.turns]
        entry["stats"] = generation.stats.as_dict()
        if has_weights(generation):
            entry["weights"] = block_weights(generation)  # every block of every turn, in order
        drafters.append(entry)
    return {"profile": outcome.profile.name, "identical": outcome.identical,
            "divergence": divergence_json(outcome), "drafters": drafters}


def verdict_lines(outcome: Outcome) -> tuple[str, list[str]]:
    """The verdict's headline and its detail lines (plain text)."""
    n = len(outcome.generations)
    if not outcome.greedy:
        t = outcome.profile.decoding.temperature
        return (f"sampling (temperature {t:g}): outputs legitimately differ; the identity check applies only to "
                f"greedy decoding (temperature 0)", [])
    d = outcome.divergence
    if d is None:
        if n == 1:
            return "one drafter only: nothing to compare", []
        return f"identical: all {n} outputs have the same token ids (greedy decoding is lossless)", []
    data = divergence_json(outcome)
    turn_count = len(outcome.questions)
    details = [f"first divergence: turn {d.turn + 1} of {turn_count} ({outcome.questions[d.turn]!r}), "
               f"token index {d.index} (turns[{d.turn}].token_ids[{d.index}])"]
    for group, token in d.groups():
        shown = "(output ended)" if token is None else f"{token} {data['token_texts'][group[0]]!r}"
        details.append(f"  {', '.join(group)}: {shown}")
    details.append(f"differ from {d.reference}: {', '.join(d.differing)}")
    details.append(f"common prefix ({len(d.prefix)} tokens): {data['prefix_text']!r}")
    return "NOT IDENTICAL: greedy outputs differ, which breaks losslessness (a bug)", details


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


STAT_COLUMNS = ("tokens", "blocks", "τ", "accept", "tok/s", "wall s")


def stat_cells(stats: Any) -> list[str]:
    return [str(stats.new_tokens), str(stats.blocks), f"{stats.block_efficiency:.2f}", _rate(stats.acceptance_rate),
            f"{stats.tokens_per_s:.1f}", f"{stats.wall_s:.2f}"]


def label(name: str, generation: Any) -> str:
    return f"{name} ({'+'.join(generation.members)})" if len(generation.members) > 1 else name


TIMING_NOTE = ("τ = block efficiency (tokens per target call); drafters ran one after another on the same models, "
               "so the first run also pays one-off warm-up costs")


# --------------------------------------------------------------------------- plain text


def plain_report(outcome: Outcome) -> str:
    """Off a terminal: the same report as text without colours or boxes."""
    n = len(outcome.generations)
    lines = [f"profile {outcome.profile.name}, {n} drafter{'' if n == 1 else 's'}"]
    for i, q in enumerate(outcome.questions, start=1):
        lines.append(f"> turn {i}: {q}" if len(outcome.questions) > 1 else f"> {q}")
    for name, generation in outcome.generations.items():
        lines += ["", f"== {label(name, generation)} =="]
        for i, turn in enumerate(generation.turns, start=1):
            lines.append(f"[turn {i}] {turn.text}" if len(generation.turns) > 1 else turn.text)
    lines.append("")
    rows = [["drafter", *STAT_COLUMNS]]
    rows += [[label(name, g), *stat_cells(g.stats)] for name, g in outcome.generations.items()]
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [cell.rjust(w) for cell, w in zip(row[1:], widths[1:])]
        lines.append("  ".join(cells).rstrip())
    lines.append(TIMING_NOTE)
    weighted = [(name, t) for name, g in outcome.generations.items() for t in trajectories(g)]
    if weighted:
        lines += ["", "ensemble weights, one bar per block (scale 0 to 1):"]
        rows = [(name + (f" turn {t.turn + 1}" if len(outcome.questions) > 1 else ""), t) for name, t in weighted]
        width = max(len(head) for head, _ in rows)
        label_width = max(len(t.spec.label) for _, t in rows)
        for head, t in rows:
            lines.append(f"  {head.ljust(width)}  {t.spec.label.ljust(label_width)}  {t.line}  {t.ends}")
    headline, details = verdict_lines(outcome)
    lines += ["", headline, *details]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- rich


def rich_report(outcome: Outcome):
    """On a terminal: the coloured outputs, a statistics table, the weight sparklines, the verdict."""
    from rich import box
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    from mmspec_cli.cli.display import ACCEPTED, EMITTED

    parts: list = [Text(f"profile {outcome.profile.name}", style="dim")]
    for i, q in enumerate(outcome.questions, start=1):
        turn = f"turn {i}: " if len(outcome.questions) > 1 else ""
        parts.append(Text(f"> {turn}{q}", style="dim"))
    parts.append(Text.assemble(("accepted draft tokens", ACCEPTED), " · ", ("tokens the target emitted", EMITTED)))
    outputs = Table(box=box.SIMPLE_HEAD, show_lines=True, expand=True, padding=(0, 1))
    outputs.add_column("drafter", style="bold", no_wrap=True)
    outputs.add_column("output", ratio=1)
    stats = Table(box=box.SIMPLE_HEAD, padding=(0, 1))
    stats.add_column("drafter", style="bold", no_wrap=True)
    for column in STAT_COLUMNS:
        stats.add_column(column, justify="right", no_wrap=True)
    for name, generation in outcome.generations.items():
        outputs.add_row(label(name, generation), _rich_output(outcome, generation))
        stats.add_row(label(name, generation), *stat_cells(generation.stats))
    parts += [outputs, stats, Text(TIMING_NOTE, style="dim")]
    weighted = [(name, t) for name, g in outcome.generations.items() for t in trajectories(g)]
    if weighted:
        weights = Table(box=None, padding=(0, 1), show_header=False)
        for column in ("drafter", "share", "first", "trajectory", "last"):
            weights.add_column(column, style="magenta" if column == "trajectory" else None,
                               overflow="fold", no_wrap=column != "trajectory")
        for name, t in weighted:
            turn = f" turn {t.turn + 1}" if len(outcome.questions) > 1 else ""
            found = endpoints(t.shares)
            first, last = ("-", "-") if found is None else (f"{found[0]:.2f}", f"{found[1]:.2f}")
            weights.add_row(f"{name}{turn}", Text(t.spec.label, style="dim"), first, t.line, last)
        parts += [Text(""), Text("ensemble weights, one bar per block (scale 0 to 1)", style="bold"), weights]
    headline, details = verdict_lines(outcome)
    style = "bold red" if outcome.identical is False else ("bold green" if outcome.identical else "yellow")
    parts += [Text(""), Text(headline, style=style), *(Text(line) for line in details)]
    return Group(*parts)


def _rich_output(outcome: Outcome, generation: Any):
    """A drafter's turns, coloured block by block."""
    from rich.text import Text

    from mmspec_cli.cli.display import IncrementalText, color_block

    out = Text()
    for i, turn in enumerate(generation.turns):
        if len(generation.turns) > 1:
            out.append(("\n" if i else "") + f"[turn {i + 1}] ", style="dim")
        decoded = IncrementalText(outcome.tokenizer)
        for block in turn.blocks:
            kept, _ = color_block(decoded, block)
            out.append_text(kept)
    return out
