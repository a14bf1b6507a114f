"""``mmspec profile-latency``: how long target verification and draft steps take on this machine.

Measures T_p(1, S, γ) and T_q(B, S, 1) (TABED App. G), T_h(S) of each draft head and T_s(S) of
``ssd`` when the profile sets ``ssd.layer``, checks Remarks 1-3, prints each drafter's latency
ratio c and the expected speedup of Eq. (1) for γ = 1..7, and caches the result for ``bench``.
With ``--compile`` each step is timed as the compiled decoding loop runs it, and cached apart.
Each drafter's Eq. (1) uses its own draft step: a head's T_h, ssd's T_s (``ssd`` never runs the
draft model), the draft model's T_q for the others.
"""

from __future__ import annotations

import json
import math
import sys
import statistics
from pathlib import Path
from typing import Annotated

import typer

from mmspec_cli.cli.errors import shorten
from mmspec_cli.cli.options import ProfileName, Threads, check_threads, check_writable, flag_type
from mmspec_cli.choices import MAX_GAMMA, SSD_PLAIN
from mmspec_cli.errors import InputError
from mmspec_cli.models.profiles import apply_overrides, load_profile

GAMMAS_FOR_EQ1 = range(1, 8)
NO_DRAFT = "none"  # the draft name of a profile that has only draft heads (cache key and display)
DEFAULT_GAMMAS = "1,3,5,7"
SsdLayer = flag_type("ssd_layer", "ssd: time the step of the target's first N decoder layers (default: the "
                                  "profile's ssd.layer).")
Compile = flag_type("compile", "Time each step as --compile runs it (compiled over a static KV state; default: the "
                               "profile's decoding.compile), cached apart for bench's records made with --compile.")


def parse_ints(text: str, flag: str, low: int = 1) -> list[int]:
    """``"1,2,4"`` -> [1, 2, 4]; one-line error naming the flag otherwise."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < low for v in values):
        raise InputError(f"{flag}: expected a comma-separated list of integers >= {low}, got {shorten(text)}")
    return sorted(set(values))


def check_tau(tau: float) -> None:
    """Refuse a ``--tau`` that is no block efficiency: NaN, infinite (whose Eq. (1) would print ``nanx``, or
    ``Infinity``, which is not JSON), below 1 or above γ + 1 for the largest γ a profile accepts."""
    if not math.isfinite(tau) or not 1 <= tau <= MAX_GAMMA + 1:
        raise InputError(f"--tau: expected a block efficiency between 1 and {MAX_GAMMA + 1} (at most γ + 1 tokens "
                         f"per target call, γ <= {MAX_GAMMA}), got {tau}")


def tau_from_results(path: Path) -> dict[str, float]:
    """Mean block efficiency per drafter in a ``bench`` JSONL file (failed records and ``ar`` skipped)."""
    if not path.is_file():
        raise InputError(f"--results: '{path}' is not a file; pass a JSONL file written by mmspec bench --out")
    from mmspec_cli.bench.records import FIELDS

    values: dict[str, list[float]] = {}
    for number, line in enumerate(path.read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):  # not JSON, not UTF-8, nested past the decoder's depth
            raise InputError(f"--results: line {number} of '{path}' is not JSON; pass a file written by mmspec bench") from None
        if not isinstance(record, dict):
            raise InputError(f"--results: line {number} of '{path}' is not a bench record (a JSON object); pass a "
                             f"file written by mmspec bench")
        for key in ("drafter", "block_efficiency"):  # what is read here, checked as bench's own records are
            check, expected = FIELDS[key]
            if key in record and (record[key] is None or not check(record[key])):
                raise InputError(f"--results: line {number} of '{path}': {key} must be "
                                 f"{expected.removesuffix(' or null')}, got {json.dumps(record[key])[:40]}; pass a "
                                 f"file written by mmspec bench")
        if "block_efficiency" in record and "drafter" in record and record["drafter"] != "ar":
            values.setdefault(record["drafter"], []).append(float(record["block_efficiency"]))
    if not values:
        raise InputError(f"--results: '{path}' holds no drafter records with block_efficiency")
    return {name: statistics.fmean(v) for name, v in values.items()}


def profile_latency(
    profile: ProfileName = None,
    batch: Annotated[str, typer.Option(metavar="B,...", help="Draft batch rows (ensemble members).")] = "1,2,3,4",
    seq: Annotated[str | None, typer.Option(metavar="S,...", show_default=False, help=(
        "Prefix lengths in tokens (default: those of 512,1024,2048,3072 that fit the models' context with the "
        "largest γ, and the longest prefix that fits when 3072 does not)."))] = None,
    gammas: Annotated[str, typer.Option(metavar="G,...", help="Tokens verified per target call.")] = DEFAULT_GAMMAS,
    gamma: Annotated[str | None, typer.Option(hidden=True, help="Deprecated name of --gammas.")] = None,
    repeat: Annotated[int, typer.Option(metavar="N", help="Timed repeats per point (median).")] = 10,
    tau: Annotated[float | None, typer.Option(metavar="X", help="Block efficiency for Eq. (1).")] = None,
    results: Annotated[Path | None, typer.Option(metavar="FILE", help="bench JSONL: use its block efficiencies.")] = None,
    plot: Annotated[Path | None, typer.Option(metavar="FILE.png", help=(
        "Draw the latency curves, in any format matplotlib writes (needs matplotlib)."))] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")] = False,
    ssd_layer: SsdLayer = None,
    compile: Compile = None,
    threads: Threads = None,
) -> None:
    """Measure T_p and T_q (and T_h per draft head, T_s for ssd), check TABED's Remarks 1-3, and print Eq. (1) speedups; cached for bench.

    Flags, profile and --plot path are checked before any model is loaded.

    Results that can't be cached (MMSPEC_CACHE not writable) are printed, then one error line says why; exit code 2.
    """
    gamma_flag, gamma_values = _gammas(gammas, gamma)
    batches, seqs = parse_ints(batch, "--batch"), None if seq is None else parse_ints(seq, "--seq")
    gamma_list = parse_ints(gamma_values, gamma_flag)
    if repeat < 1:
        raise InputError(f"--repeat: expected an integer >= 1, got {repeat}")
    if tau is not None:
        check_tau(tau)
    taus = tau_from_results(results) if results is not None else ({"--tau": tau} if tau is not None else {})
    chosen = apply_overrides(load_profile(profile), ssd_layer=ssd_layer, compile=compile)
    if chosen.draft is None and not chosen.head and chosen.ssd.layer is None:
        raise InputError("profile-latency times a draft step too; add a `draft:` section, a draft `head:` or "
                         "`ssd: {layer: N}` to the profile")
    if plot is not None:
        _check_plot(plot)
    from mmspec_cli.api import check_compilable_profile

    check_compilable_profile(chosen, needs_draft=True)
    _run(chosen, batches, seqs, gamma_list, repeat, taus, plot, as_json, check_threads(threads))


def _gammas(gammas: str, gamma: str | None) -> tuple[str, str]:
    """The flag the γ list came from and its text. ``--gamma`` is one value in every other command, so here
    the list is ``--gammas``; ``--gamma`` still works, with a note on stderr."""
    if gamma is None:
        return "--gammas", gammas
    if gammas != DEFAULT_GAMMAS:
        raise InputError("pass the γ values once, with --gammas (--gamma is its deprecated name)")
    typer.echo("note: profile-latency --gamma is deprecated (elsewhere --gamma is one value); use --gammas", err=True)
    return "--gamma", gamma


def _check_plot(path: Path) -> None:
    """Refuse a ``--plot`` path that matplotlib could not write, or would silently write elsewhere, before the
    measurement: afterwards the failure would cost it. A folder would become ``<folder>.png``, a name with no
    suffix ``<name>.png``."""
    if path.is_dir():
        raise InputError(f"--plot {shorten(str(path))} is a folder; name a file in it, such as "
                         f"{shorten(str(path / 'latency.png'))}")
    check_writable(path, "--plot")
    _require_matplotlib()
    from matplotlib.backend_bases import FigureCanvasBase

    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    suffix = path.suffix[1:].lower()
    if suffix not in formats:
        what = f"can't write {shorten('.' + suffix, 12)} files" if suffix else "needs a suffix naming the format"
        raise InputError(f"--plot {shorten(str(path))}: matplotlib {what}; end the name with one of "
                         f"{', '.join('.' + f for f in formats)}")


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise InputError("--plot needs matplotlib; install it with `pip install 'mmspec[plot]'`") from None


def compile_notice() -> str:
    """The line ``--compile`` prints before it measures, so that minutes of compiling don't read as a hang."""
    from mmspec_cli.decoding.compiled import inductor_cache_dir

    return (f"note: --compile: each step shape compiles in its warm-up before it is timed; with an empty inductor cache "
            f"in {inductor_cache_dir()} that can take minutes, and a later run reads the cache")


def _run(profile, batches, seqs, gammas, repeat, taus, plot, as_json, threads=None) -> None:
    """Measure, then show the results before anything that can still fail (the cache, the plot) can lose them."""
    from mmspec_cli.bench import latency
    from mmspec_cli.decoding.metrics import expected_speedup
    from mmspec_cli.models.loading import load_model

    from mmspec_cli.models.head_files import load_head

    target = load_model(profile.target, "target", multi_gpu_ok=True)
    draft = load_model(profile.draft, "draft") if profile.draft is not None else None
    loaded = [m for m in (target, draft) if m is not None]
    if seqs is None:
        seqs = latency.default_seqs(_context(loaded), max(gammas))
    _check_lengths(loaded, max(seqs) + max(gammas))
    heads = {}
    for spec in profile.head:
        head = load_head(spec.model, spec.kind, spec.num_q, target, spec.revision)
        heads[head.kind] = head
    ssd = _ssd_timing(profile, target)
    compiled = profile.decoding.compile
    if compiled:
        from mmspec_cli.cli.display import forget_compiling
        from mmspec_cli.decoding.compiled import compile_blocker

        for role, loaded in (("target", target), ("draft", draft)):
            why = None if loaded is None else compile_blocker(loaded.model)
            if why:
                raise InputError(f"--compile: the {role} model can't be compiled here: {why}; run without --compile")
        forget_compiling()
        typer.echo(compile_notice(), err=True)
    from mmspec_cli.models.threads import apply_threads, busy_warning

    choice = apply_threads(threads, target.model)
    warning = busy_warning(choice, target.model.device.type == "cpu")
    if warning:
        typer.echo(warning, err=True)
    timer = latency.Timer(target.model.device, warmup=2, repeat=repeat)  # a compiled step compiles in its warm-up
    try:
        result = latency.measure(target.model, draft and draft.model, profile.target.model,
                                 profile.draft.model if draft else NO_DRAFT, batches, seqs, gammas, timer,
                                 profile.target.revision, profile.draft.revision if draft else None, heads, ssd,
                                 compiled)
    except latency.CompiledFailed as exc:
        raise InputError(f"--compile: {exc}; nothing compiled is left to time, so run without --compile") from None
    try:
        path, unsaved = latency.save(result), None
    except OSError as exc:  # $MMSPEC_CACHE read-only, a file, on a full disk...
        path, unsaved = None, exc
    remarks = latency.check_remarks(result)
    ratios = {g: result.ratio(batch=batches[0], seq=seqs[0], gamma=g) for g in GAMMAS_FOR_EQ1} if draft else {}
    head_ratios = {kind: {g: result.ratio(seq=seqs[0], gamma=g, head=kind) for g in GAMMAS_FOR_EQ1} for kind in heads}
    ssd_ratios = {name: {g: result.ratio(seq=seqs[0], gamma=g, ssd=name) for g in GAMMAS_FOR_EQ1}
                  for name in result.ssd_ms}
    own = {name: own_ratios(name, result, profile, seqs[0], batches[0]) for name in taus}
    speedups = {name: {g: expected_speedup(t, g, own[name][g]) for g in GAMMAS_FOR_EQ1}
                for name, t in taus.items() if own[name]}
    unpriced = [name for name in taus if not own[name]]
    if unpriced:  # said, not dropped: an ensemble's rows not in --batch, a step the profile has no network for
        typer.echo(f"note: no expected speedup for {', '.join(unpriced)}: this run timed no draft step of theirs "
                   f"(an ensemble's rows must be among --batch, a head or ssd must be in the profile)", err=True)
    if as_json:
        typer.echo(json.dumps({"device": result.device, "target": result.target, "draft": result.draft,
                               "compiled": result.compiled,
                               "target_ms": result.target_ms, "draft_ms": result.draft_ms,
                               "head_ms": result.head_ms, "head_latency_ratio": head_ratios,
                               "ssd_ms": result.ssd_ms, "ssd": result.ssd, "ssd_latency_ratio": ssd_ratios,
                               "draft_chain_ms": result.draft_chain_ms, "head_chain_ms": result.head_chain_ms,
                               "remarks": [r.__dict__ for r in remarks], "latency_ratio": ratios,
                               "expected_speedup": speedups, "tau": taus, "cache": path and str(path),
                               "threads": choice.as_dict()}))
    else:
        _print_tables(result, remarks, ratios, head_ratios, ssd_ratios, speedups, taus, batches[0], seqs[0], path)
    if compiled:
        from mmspec_cli.cli.display import report_compiling

        report_compiling()
    if plot is not None:
        _plot(result, plot)
    if unsaved is not None:
        raise InputError(f"the results above could not be cached for bench in {shorten(str(latency.cache_dir()))} "
                         f"({unsaved.strerror or unsaved}); set MMSPEC_CACHE to a writable folder and run again")


def own_ratios(name: str, result, profile, seq: int, batch: int) -> dict | None:
    """The latency ratios (γ -> c, at prefix ``seq``) of drafter ``name``'s own draft step as ``bench/latency.own_step``
    prices it (a head's T_h, ssd's T_s, the draft model's T_q at the drafter's rows); ``--tau`` given alone names no
    drafter and is priced as the draft model's step at ``batch`` rows (the first ``--batch``). None when that step was
    not timed (or the name is not a drafter of this version), so no Eq. (1) is shown rather than one with another
    drafter's ratio."""
    from mmspec_cli.bench.latency import own_step
    from mmspec_cli.drafters.registry import priced_plan

    try:
        plan = priced_plan("m" if name == "--tau" else name, profile.ensemble.members)
    except InputError:
        return None
    step = own_step(result, plan, rows=batch if name == "--tau" else None, ssd_layer=profile.ssd.layer,
                    imitation=profile.ssd.imitation)
    if step is None:
        return None
    return {g: result.ratio(seq=seq, gamma=g, **step.ratio) for g in GAMMAS_FOR_EQ1}


def _ssd_timing(profile, target):
    """What to time for ``ssd``: the profile's ``ssd.layer`` (checked against the target) and its imitation network;
    None when the profile sets no layer."""
    if profile.ssd.layer is None:
        return None
    from mmspec_cli.bench.latency import SsdTiming
    from mmspec_cli.drafters.ssd import check_layer, layer_count
    from mmspec_cli.models.imitation import load_imitation

    layer = check_layer(profile.ssd.layer, layer_count(target.model))
    imitation = load_imitation(profile.ssd.imitation, layer, target) if profile.ssd.imitation else None
    return SsdTiming(layer, imitation, profile.ssd.imitation)


def _limit(loaded) -> int | None:
    """How many positions ``loaded``'s language model takes (None: its config doesn't say)."""
    return getattr(loaded.model.config.get_text_config(), "max_position_embeddings", None)


def _context(models) -> int | None:
    """The fewest positions any of ``models`` takes: the longest S + γ the default ``--seq`` may reach."""
    limits = [limit for limit in map(_limit, models) if limit is not None]
    return min(limits, default=None)


def _check_lengths(models, needed: int) -> None:
    for loaded in models:
        limit = _limit(loaded)
        if limit is not None and needed > limit:
            raise InputError(f"--seq: the {loaded.role} model '{loaded.name}' takes at most {limit} positions, "
                             f"but S + γ = {needed}; pass smaller --seq values")


def _print_tables(result, remarks, ratios, head_ratios, ssd_ratios, speedups, taus, batch, seq, path) -> None:
    from rich.console import Console
    from rich.table import Table

    from mmspec_cli.cli.display import is_terminal

    # off a terminal rich would take its width from $COLUMNS (a GPU run's was about 15): tables as bench's
    console = Console(file=sys.stdout, width=None if is_terminal(sys.stdout) else 140)
    console.print(f"device: {result.device}   target: {result.target}   draft: {result.draft}"
                  + ("   steps: compiled (--compile)" if result.compiled else ""))
    console.print(_grid("T_p(1, S, γ) ms: one target verification of γ tokens", result.seqs,
                        {f"γ={g}": (lambda s, g=g: result.t_p(s, g)) for g in result.gammas}))
    if result.draft_ms:
        console.print(_grid("T_q(B, S, 1) ms: one draft step with B rows", result.seqs,
                            {f"B={b}": (lambda s, b=b: result.t_q(b, s)) for b in result.batches}))
    if result.head_ms:
        console.print(_grid("T_h(S) ms: one draft-head step (its decoder layer + the target's LM head)", result.seqs,
                            {kind: (lambda s, k=kind: result.head_ms[k][str(s)]) for kind in result.head_ms}))
    chains = _chain_rows(result)
    if chains:
        table = Table()
        table.add_column("chain")
        for s in result.seqs:
            table.add_column(f"S={s}", justify="right")
        for name, per_seq in chains.items():
            table.add_row(name, *(f"{per_seq[s]:.2f}" for s in result.seqs))
        console.print(_titled("T_chain ms: a greedy chain of γ tokens in ONE compiled graph (--compile's drafting: "
                              "a draft model's feeds its catch-up token first; a head's follows its catch-up step)",
                              table))
    shown_ssd = _distinct_ssd(result)
    if shown_ssd:
        layer = result.ssd["layer"]
        console.print(_grid(f"T_s(S) ms: one ssd step (the target's first {_layers(layer)} + final norm + LM head, "
                            f"over its own cache)", result.seqs,
                            {name: (lambda s, n=name: result.ssd_ms[n][str(s)]) for name in shown_ssd}))
    for r in remarks:
        verdict = "[green]holds[/]" if r.holds else "[red]does not hold[/]"
        console.print(f"Remark {r.remark} ({r.statement}): worst |ΔT/T| = {r.worst:.1%} -> {verdict} here")
    steps = ([f"c: T_q(B={batch}, S={seq}, 1)"] if ratios else []) + \
        ([f"c <kind> head: T_h(S={seq})"] if head_ratios else []) + ([f"c ssd: T_s(S={seq})"] if shown_ssd else [])
    eq1 = Table()
    eq1.add_column("γ", justify="right")
    if ratios:
        eq1.add_column("c", justify="right")
    for kind in head_ratios:
        eq1.add_column(f"c {kind} head", justify="right")
    for name in shown_ssd:
        eq1.add_column(f"c {name}", justify="right")
    for name in speedups:
        eq1.add_column(f"speedup {name} (τ={taus[name]:.2f})", justify="right")
    for g in GAMMAS_FOR_EQ1:
        cells = ([f"{ratios[g]:.3f}"] if ratios else []) + [f"{head_ratios[k][g]:.3f}" for k in head_ratios] + \
            [f"{ssd_ratios[n][g]:.3f}" for n in shown_ssd]
        eq1.add_row(str(g), *cells, *(f"{speedups[name][g]:.2f}x" for name in speedups))
    console.print(_titled(f"Latency ratio c = one draft step / T_p(1, S={seq}, γ) ({'; '.join(steps)}) and Eq. (1) "
                          f"τ/(γc+1)", eq1))
    if not taus:
        console.print("pass --tau X or --results bench.jsonl to see expected speedups", style="dim")
    if path is not None:
        console.print(f"saved to {path} (bench reads it for Eq. (1))", style="dim")


def _layers(n: int) -> str:
    return f"{n} layer" if n == 1 else f"{n} layers"


def _distinct_ssd(result) -> list[str]:
    """The ssd steps to show: ``ssd`` and, when it drafts through an imitation network, ``ssd:plain`` beside it
    (without one, both are the same step, measured once)."""
    if not result.ssd_ms:
        return []
    return ["ssd", SSD_PLAIN] if (result.ssd or {}).get("imitation") else ["ssd"]


def _chain_rows(result) -> dict[str, dict[int, float]]:
    """The compiled chains timed, by name ("draft B=1 γ=4", "eagle head γ=4") -> S -> ms."""
    rows: dict[str, dict[int, float]] = {}
    for key, ms in sorted(result.draft_chain_ms.items(), key=lambda item: [int(x) for x in item[0].split(",")]):
        b, s, g = (int(x) for x in key.split(","))
        rows.setdefault(f"draft B={b} γ={g}", {})[s] = ms
    for kind, grid in result.head_chain_ms.items():
        for key, ms in sorted(grid.items(), key=lambda item: [int(x) for x in item[0].split(",")]):
            s, g = (int(x) for x in key.split(","))
            rows.setdefault(f"{kind} head γ={g}", {})[s] = ms
    return rows


def _grid(title: str, seqs, columns: dict):
    """A table with a row per prefix length S and a column per ``columns`` entry (name -> S -> ms), under ``title``."""
    from rich.table import Table

    table = Table()
    table.add_column("S")
    for name in columns:
        table.add_column(name, justify="right")
    for s in seqs:
        table.add_row(str(s), *(f"{value(s):.2f}" for value in columns.values()))
    return _titled(title, table)


def _titled(title: str, table):
    """``table`` under ``title`` on a line of its own: rich wraps a table's own title to the table's width, which cut
    the Eq. (1) table's (two columns wide) into a column of single words."""
    from rich.console import Group
    from rich.text import Text

    return Group(Text(title, style="italic"), table)


def _plot(result, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for g in result.gammas:
        left.plot(result.seqs, [result.t_p(s, g) for s in result.seqs], marker="o", label=f"γ={g}")
    for b in result.batches:
        right.plot(result.seqs, [result.t_q(b, s) for s in result.seqs], marker="o", label=f"B={b}")
    for kind, times in result.head_ms.items():
        right.plot(result.seqs, [times[str(s)] for s in result.seqs], marker="s", label=f"{kind} head")
    for name in _distinct_ssd(result):
        right.plot(result.seqs, [result.ssd_ms[name][str(s)] for s in result.seqs], marker="^", label=name)
    left.set(title="target verification T_p(1, S, γ)", xlabel="S (tokens)", ylabel="ms")
    right.set(title="draft step T_q(B, S, 1), head step T_h(S), ssd step T_s(S)", xlabel="S (tokens)", ylabel="ms")
    left.legend()
    right.legend()
    fig.suptitle(result.device)
    fig.tight_layout()
    fig.savefig(path)
