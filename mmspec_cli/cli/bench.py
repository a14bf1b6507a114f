"""``mmspec bench``: run drafters over a manifest, suite or dataset; record every turn; summarise.

Everything that can be refused (flags, drafter names, the profile, the source and the image files
it names, --prompt-style paper for a Qwen-VL target, the --out file, another run writing it) is
refused with one line and exit 2 before any model loads (the paper style's check waits for the
target to load where its config.json is not on disk yet). --summarize refuses records that can't be
summarised together (bench/records.py ``check_one_kind``).
Exit 1 when a sample failed or a drafter's greedy output differed from ``ar``'s; 0 otherwise;
130 after a Ctrl-C, which says how many records are saved and the command that continues them.
The line on failed samples (how many, and the first one's error) goes to stderr in every format.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Annotated

import typer

from mmspec_cli.cli.options import ProfileName, Threads, check_threads, command_line, decoding_flags, step_costs
from mmspec_cli.choices import SSD_PLAIN
from mmspec_cli.errors import InputError
from mmspec_cli.models.profiles import DEFAULT_PROFILE, Profile, apply_overrides, load_profile

PROMPT_STYLES = ("default", "paper")
EXIT_FAILED = 1


@decoding_flags()
def bench(
    ctx: typer.Context,
    source: Annotated[str | None, typer.Argument(metavar="SOURCE", show_default=False, help=(
        "A JSONL manifest, a folder in MMSpec's layout (mmspec.jsonl beside images/), a built-in suite name, or a "
        "Hugging Face dataset id (owner/name[:subset]).")) ] = None,
    drafters: Annotated[str, typer.Option(metavar="LIST", help=(
        "Comma list of drafters, e.g. ar,m,t,tabed,pld; hf-assisted runs Hugging Face assisted generation; "
        "oracle (a benchmark tool, after ar) replays ar's output to measure the engine's own overhead."))] = "ar,m,t,tabed",
    profile: ProfileName = None,
    limit: Annotated[int | None, typer.Option(metavar="N", help="Use the first N samples (before sharding); demo-all: N of each suite.")] = None,
    turns: Annotated[int | None, typer.Option(metavar="N", help="Run at most N turns of each sample.")] = None,
    out: Annotated[str | None, typer.Option(metavar="FILE", help=(
        "Append one JSON line per (sample, turn, drafter) here; {rank} becomes the shard index. With --format mmspec, "
        "a folder: MMSpec's results files, and the records in its bench.jsonl."))] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue --out, skipping the turns it already holds.")] = False,
    fmt: Annotated[str, typer.Option("--format", metavar="table|json|csv|mmspec", help=(
        "How to print the summary; mmspec also writes <drafter>-temperature-<t>.jsonl per drafter into --out DIR, "
        "in MMSpec's results layout (ar is its baseline)."))] = "table",
    protocol: Annotated[str | None, typer.Option(metavar="mmspec", help=(
        "mmspec: MMSpec's protocol: temperature 0, 1024 new tokens, images in the first turn only, a Qwen-VL "
        "model's images bounded to 256*28*28..1280*28*28 pixels (decoding flags given still win)."))] = None,
    shard: Annotated[str | None, typer.Option(metavar="i/n|auto", help=(
        "Run every n-th sample from i; auto reads RANK/WORLD_SIZE (torchrun, accelerate launch)."))] = None,
    prompt_style: Annotated[str, typer.Option(metavar="default|paper", help=(
        "paper: TABED App. I.1's prompt per dataset, where the paper gives one."))] = "default",
    summarize: Annotated[list[str] | None, typer.Option(metavar="FILE", help=(
        "Only summarise results files (repeatable); no SOURCE, no models."))] = None,
    warmup: Annotated[bool, typer.Option("--warmup/--no-warmup", help=(
        "Run one short untimed turn per drafter before timing."))] = True,
    threads: Threads = None,
    *,
    overrides: dict,
) -> None:
    """Benchmark drafters on many samples: block efficiency, acceptance, speed, per category.

    Each finished turn is appended to --out at once: a killed run loses nothing finished, and --resume continues it.
    A run that fails before its first record removes the --out file it created (a file that was there is kept).

    At temperature 0 every drafter's token ids are checked against ar's. Exit 1 if a sample failed or a check did.
    """
    from mmspec_cli.bench import mmspec_results
    from mmspec_cli.bench.report import FORMATS

    if fmt not in (*FORMATS, mmspec_results.FORMAT):
        raise InputError(f"--format: expected one of {', '.join((*FORMATS, mmspec_results.FORMAT))}, got '{fmt}'")
    mmspec_results.check_protocol(protocol)
    if summarize and fmt == mmspec_results.FORMAT:
        raise InputError("--format mmspec writes a run's results into --out DIR, and --summarize runs nothing; "
                         "pass SOURCE to run, or another --format")
    if summarize:
        if source is not None:
            raise InputError("pass either SOURCE (to run) or --summarize FILE (to summarise results), not both")
        raise typer.Exit(_summarize_files(summarize, load_profile(profile), profile or DEFAULT_PROFILE, fmt))
    if source is None:
        raise InputError("no SOURCE given; pass a JSONL manifest, a suite name or a dataset id, "
                         "or --summarize FILE to summarise results")
    names = parse_drafters(drafters)
    if prompt_style not in PROMPT_STYLES:
        raise InputError(f"--prompt-style: expected one of {', '.join(PROMPT_STYLES)}, got '{prompt_style}'")
    if resume and out is None:
        raise InputError("--resume continues an --out file; pass --out FILE")
    if fmt == mmspec_results.FORMAT and out is None:
        raise InputError("--format mmspec writes MMSpec's results files into a folder; pass --out DIR")
    if protocol and prompt_style == "paper":
        raise InputError("--protocol mmspec prompts through the chat template, as MMSpec does, and --prompt-style "
                         "paper through TABED's prompts; drop one of them")
    for flag, value in (("--limit", limit), ("--turns", turns)):
        if value is not None and value < 1:
            raise InputError(f"{flag}: expected an integer >= 1, got {value}")
    from mmspec_cli.inputs.samples import parse_shard

    shard_ = parse_shard(shard)
    loaded = load_profile(profile)
    chosen = apply_overrides(mmspec_results.apply_protocol(loaded) if protocol else loaded, **overrides)
    check_profile_fits(names, chosen)
    if prompt_style == "paper":
        from mmspec_cli.inputs.prompts import check_paper_target
        from mmspec_cli.models.loading import model_type_on_disk

        check_paper_target(model_type_on_disk(chosen.target), chosen.target.model)
    threads = check_threads(threads)
    if shard == "auto":
        chosen = pin_local_device(chosen, os.environ)
    if shard_ and shard_[1] > 1 and out and "{rank}" not in out:
        raise InputError(f"--out {out}: shards run as separate processes must not share a file; put {{rank}} in "
                         f"the name, e.g. --out results.{{rank}}.jsonl, and merge them with --summarize")
    out_path = out.replace("{rank}", str(shard_[0] if shard_ else 0)) if out else None
    raise typer.Exit(_start(source, names, chosen, limit, turns, out_path, resume, fmt, shard_, prompt_style, warmup,
                          profile or DEFAULT_PROFILE, command_line(ctx), threads, protocol))


# --------------------------------------------------------------------------- checks before loading


def parse_drafters(text: str) -> list[str]:
    """The comma list of --drafters, each name validated (``hf-assisted`` included); no repeats."""
    from mmspec_cli.drafters.registry import parse_drafter_list

    from mmspec_cli.bench.peers import PEERS

    return parse_drafter_list(text, extra=tuple(PEERS))


def check_profile_fits(names: list[str], profile: Profile) -> None:
    """Refuse drafters the profile can't run, before any model loads: the engine's drafters as ``ModelSet.load``
    refuses them (``api.check_profile_runs``, with ``ar`` before ``oracle``), and the bench peer rows, which run the
    profile's draft model."""
    from mmspec_cli.api import check_profile_runs
    from mmspec_cli.bench.peers import PEERS
    from mmspec_cli.drafters.registry import missing_draft

    check_profile_runs(profile, [name for name in names if name not in PEERS], needs_ar_first=True, flag="--drafters")
    for name in names:
        if name in PEERS:
            PEERS[name].check_profile(profile)
            if profile.draft is None:  # every peer is an assisted generation with the profile's draft
                raise missing_draft(name, "--drafters")


def pin_local_device(profile: Profile, env) -> Profile:
    """Under torchrun/accelerate, put each process's models on its own GPU (``cuda:LOCAL_RANK``)
    instead of every process spreading its target over all GPUs."""
    local = env.get("LOCAL_RANK")
    if local is None or profile.target.device != "auto":
        return profile
    import torch

    if not torch.cuda.is_available():
        return profile
    device = f"cuda:{int(local)}"
    changes = {"target": dataclasses.replace(profile.target, device=device)}
    for role in ("draft", "captioner"):
        spec = getattr(profile, role)
        if spec is not None and spec.device == "auto":
            changes[role] = dataclasses.replace(spec, device=device)
    return dataclasses.replace(profile, **changes)


# --------------------------------------------------------------------------- running


def _start(source: str, names: list[str], profile: Profile, limit: int | None, turns: int | None, out: str | None,
           resume: bool, fmt: str, shard: tuple[int, int] | None, prompt_style: str, warmup: bool, label: str,
           again: str, threads: int | None = None, protocol: str | None = None) -> int:
    """``--format mmspec`` checks and makes its --out folder first; then the run (:func:`_run`)."""
    from mmspec_cli.bench import mmspec_results

    folder = None
    if fmt == mmspec_results.FORMAT:  # --out names a folder: the records go to its bench.jsonl, under the same rules
        folder, made = mmspec_results.prepare_folder(out, names, profile.decoding.temperature, resume)
        out = str(folder / mmspec_results.RECORDS_NAME)
        try:
            return _run(source, names, profile, limit, turns, out, resume, "table", shard, prompt_style, warmup, label,
                        again, threads, protocol, folder)
        finally:
            if made:
                mmspec_results.remove_if_empty(folder)
    return _run(source, names, profile, limit, turns, out, resume, fmt, shard, prompt_style, warmup, label, again,
                threads, protocol)


def _run(source: str, names: list[str], profile: Profile, limit: int | None, turns: int | None, out: str | None,
         resume: bool, fmt: str, shard: tuple[int, int] | None, prompt_style: str, warmup: bool, label: str,
         again: str, threads: int | None = None, protocol: str | None = None, folder=None) -> int:
    """A run; ``folder``: where MMSpec's results files go (``--format mmspec``), the records being in ``out``."""
    from mmspec_cli.bench.progress import BenchProgress
    from mmspec_cli.bench.records import ResultsFile
    from mmspec_cli.bench.runner import RunSettings, check_resumed_history, drafting_settings, todo
    from mmspec_cli.inputs.samples import check_image_files, select
    from mmspec_cli.inputs.sources import resolve
    from mmspec_cli.models.loading import int8_threshold

    decoding = profile.decoding
    ensemble = json.dumps(drafting_settings(profile, names), sort_keys=True)
    settings = RunSettings(drafters=tuple(names), max_turns=turns, prompt_style=prompt_style, gamma=decoding.gamma,
                           max_new_tokens=decoding.max_new_tokens, temperature=decoding.temperature,
                           target=profile.target.model, draft=profile.draft.model if profile.draft else None,
                           top_p=decoding.top_p, top_k=decoding.top_k, seed=decoding.seed, ensemble=ensemble,
                           int8_threshold=int8_threshold(profile.target, "target"))
    results = ResultsFile.open(out, resume, settings.record_fields())  # locked until the run ends
    try:
        with results:
            samples = select(resolve(source, limit), shard=shard)
            check_resumed_history(samples, results.records)
            pending = todo(samples, settings, results.done())
            # a missing image: one line before any model loads, not a failed record per drafter (exit 1); only the
            # samples still to run (a finished one's images may be gone by a --resume)
            to_run = [sample for sample in samples if any((sample.id, name) in pending for name in names)]
            check_image_files(to_run, f"SOURCE {source}")
            if protocol:
                from mmspec_cli.bench.mmspec_results import check_samples

                check_samples(to_run)
            if not samples:
                typer.echo(f"no samples in shard {shard[0]}/{shard[1]}" if shard else "no samples", err=True)
            if pending:
                from mmspec_cli.bench.runner import BenchRunner

                from mmspec_cli.models.threads import apply_threads

                models = _load(profile, names)
                if protocol:
                    from mmspec_cli.bench.mmspec_results import bound_pixels

                    bound_pixels(models)
                if prompt_style == "paper":  # a hub target whose config was not on disk before it loaded
                    from mmspec_cli.inputs.prompts import check_paper_target

                    check_paper_target(models.target.model.config.model_type, profile.target.model)
                settings = dataclasses.replace(settings, threads=apply_threads(threads, models.target.model).count)
                models.step_costs = step_costs(profile, names, models.target.model.device, threads)
                total = sum(len(t) for t in pending.values())
                from mmspec_cli.cli.display import forget_compiling, report_compiling

                forget_compiling()
                with BenchProgress(total, names, results.records, enabled=sys.stderr.isatty()) as progress:
                    BenchRunner(models, settings, results, progress).run(samples, warmup=warmup)
                report_compiling()
            records = list(results.records)
            if folder is not None:
                from mmspec_cli.bench.mmspec_results import write_results

                written = write_results(folder, names, decoding.temperature, samples, records,
                                        {s.id: settings.turns(s) for s in samples})
                typer.echo(f"MMSpec results: {', '.join(str(p) for p in written)}", err=True)
    except KeyboardInterrupt:
        typer.echo(interrupted_line(results, again), err=True)
        raise  # cli/errors.py: exit 130
    if out is None:
        typer.echo("note: no --out given; the records were not saved", err=True)
    return _report(records, profile, fmt, label)


def interrupted_line(results, again: str) -> str:
    """What a Ctrl-C leaves: the records saved in --out, and ``again``, the command that continues them."""
    from mmspec_cli.bench.report import counted

    if results.path is None:
        return "interrupted: no --out was given, so no records were saved; pass --out FILE to keep them"
    if results.removed:  # no turn had finished: the file this run made was removed again (bench/records.py)
        return (f"interrupted: no record was saved, so {results.path}, which this run created, was removed; "
                f"to start again, run: {again}")
    n = results.saved()
    return (f"interrupted: {counted(n, 'record')} {'is' if n == 1 else 'are'} saved in {results.path}; "
            f"to continue, run: {again}")


def _load(profile: Profile, names: list[str]):
    from mmspec_cli.api import ModelSet
    from mmspec_cli.bench.peers import PEERS
    from mmspec_cli.models.loading import load_model, pair_draft

    models = ModelSet.load(profile, [n for n in names if n not in PEERS], threads=None)  # threads: chosen in _run
    if any(n in PEERS for n in names) and models.draft is None:
        models.draft = load_model(profile.draft, "draft")
        pair_draft(models.target, models.draft)
    for name in names:
        if name in PEERS:
            PEERS[name].check_models(models.target, models.draft)
    return models


# --------------------------------------------------------------------------- summary


def _summarize_files(paths: list[str], profile: Profile, label: str, fmt: str) -> int:
    from mmspec_cli.bench.records import read_records

    return _report(read_records(paths), profile, fmt, label)


def latency_ratios(profile: Profile, records: list[dict], label: str) -> tuple[dict[str, float], dict[str, str], str | None]:
    """c per drafter from the latency cache of this device and the profile's model pair, which step each c is
    (drafter -> a few words), and why Eq. (1) is missing where it is (one line, or None).

    A drafter gets c only when every one of its records was made with the profile's target and draft (records
    name them): another pair's ratio would make Eq. (1) wrong, and without ``--profile`` the profile is the
    default one, which need not be the pair the records were made with. Each drafter's c is its own draft step
    over one verification: a head's T_h, ssd's T_s (``ssd`` and ``ssd:plain`` never run the draft model; their
    step must have been timed at the records' ``ssd.layer``, and for ``ssd`` with their imitation network), the
    draft model's T_q at the records' batch rows (their ensemble members) for the others; each at the records'
    γ and mean prompt length. The cache is looked up under the CPU thread count the records were made with
    (records carry it), not this process's."""
    # ar drafts nothing; oracle's and pld's drafts cost no model step (c = 0, so Eq. (1) would be τ): oracle's bound
    # is (γ + 1)·T_p(1)/T_p(γ + 1), benchmarks/bench_oracle.py
    from mmspec_cli.drafters.registry import model_drafts

    def drafts(name: str) -> bool:
        try:
            return model_drafts(name)
        except InputError:  # a name this version does not take (an older release's record): priced as a drafter
            return True

    turns = [r for r in records if "error" not in r and drafts(r["drafter"])]
    if not turns:
        return {}, {}, None  # nothing Eq. (1) applies to
    pair = (profile.target.model, profile.draft.model if profile.draft else None)
    by_drafter: dict[str, list[dict]] = {}
    for record in turns:
        by_drafter.setdefault(record["drafter"], []).append(record)
    ours = {name: rs for name, rs in by_drafter.items() if all((r.get("target"), r.get("draft")) == pair for r in rs)}
    if not ours:
        other = next(r for r in turns if (r.get("target"), r.get("draft")) != pair)
        return {}, {}, (f"Eq. (1) not shown: the records were made with target {_short(other.get('target'))} and "
                        f"draft {_short(other.get('draft'))}, not profile {label}'s models; pass --profile with theirs")
    if profile.draft is None and not profile.head and profile.ssd.layer is None:
        return {}, {}, f"Eq. (1) not shown: profile {label} has no draft step to measure a latency ratio with"
    from mmspec_cli.bench import latency
    from mmspec_cli.bench.records import made_compiled

    # the latencies profile-latency --compile timed; records of both kinds are refused before (records.check_one_kind)
    compiled = any(made_compiled(r) for rs in ours.values() for r in rs)
    from mmspec_cli.bench.summary import mean_prompt_tokens
    from mmspec_cli.cli.profile_latency import NO_DRAFT
    from mmspec_cli.models.loading import resolve_device

    device = resolve_device(profile.target.device)
    cached: dict[int | None, latency.LatencyResult | None] = {}
    damaged: list[str] = []  # a cache file there that can't be read: said, and read as none

    def measured_with(threads: int | None) -> "latency.LatencyResult | None":
        if threads not in cached:
            try:
                cached[threads] = latency.load(latency.device_name(device, threads), profile.target.model,
                                               profile.draft.model if profile.draft else NO_DRAFT,
                                               profile.target.revision,
                                               profile.draft.revision if profile.draft else None, compiled)
            except latency.DamagedCache as exc:
                cached[threads] = None
                damaged.append(str(exc))
        return cached[threads]

    counts = {name: sorted({r.get("threads") for r in rs}, key=str) for name, rs in ours.items()}
    mixed = [name for name, found in counts.items() if len(found) > 1]
    found = {name: measured_with(counts[name][0]) for name in ours if name not in mixed}
    every = {count for found_counts in counts.values() for count in found_counts}
    threads = next(iter(every)) if len(every) == 1 else None  # for the command a note gives
    command = (f"mmspec profile-latency --profile {label}{f' --threads {threads}' if threads else ''}"
               f"{' --compile' if compiled else ''}")
    if damaged:
        return {}, {}, f"Eq. (1) not shown: {damaged[0]}; run `{command}` to measure it again"
    if found and not any(found.values()):
        return {}, {}, (f"Eq. (1) not shown: no latency ratio is cached for this device "
                        f"({latency.device_name(device, threads)}) and profile {label}'s models; run `{command}`")
    ratios, steps, untimed, layers = {}, {}, [], set()
    for name, measured in found.items():
        rs = ours[name]
        step = _own_step(name, rs, measured, profile) if measured is not None else None
        if step is None:
            untimed.append(_untimed_name(name, rs, profile))
            if name in ("ssd", SSD_PLAIN):
                layers.add(_ssd_setting(rs, profile)[0])
            continue
        kwargs, steps[name] = step
        ratios[name] = measured.ratio(seq=mean_prompt_tokens(rs), gamma=rs[0].get("gamma") or profile.decoding.gamma,
                                      **kwargs)
    others = [name for name in by_drafter if name not in ours]
    notes = ([f"Eq. (1) not shown for {', '.join(others)}: some of their records were made with other models than "
              f"profile {label}'s; summarise those with their own --profile"] if others else []) + \
            ([f"Eq. (1) not shown for {', '.join(mixed)}: their records were made with different CPU thread counts, "
              f"each with its own latencies; summarise the files of one count at a time"] if mixed else []) + \
            ([f"Eq. (1) not shown for {', '.join(untimed)}: the cached latencies have no draft step of theirs; run "
              f"`{command}{_layer_flag(layers, profile)}`"] if untimed else [])
    note = "; ".join(notes) or None
    return ratios, steps, note


def _layer_flag(layers: set, profile: Profile) -> str:
    """``--ssd-layer N`` for the profile-latency command a note gives, when the ssd records' layer is not the
    profile's (``bench --ssd-layer``)."""
    layers = {layer for layer in layers if layer is not None}
    if len(layers) == 1 and layers != {profile.ssd.layer}:
        return f" --ssd-layer {layers.pop()}"
    return ""


def _ssd_setting(records: list[dict], profile: Profile) -> tuple[int | None, str | None]:
    """The ``ssd.layer`` and imitation network ``records`` of ssd were made with (their drafting settings carry
    them), else the profile's."""
    try:
        ssd = json.loads(records[0].get("ensemble") or "{}").get("ssd")
    except (json.JSONDecodeError, AttributeError):
        ssd = None
    if not isinstance(ssd, dict):
        return profile.ssd.layer, profile.ssd.imitation
    layer, imitation = ssd.get("layer"), ssd.get("imitation")  # what a record says, of the kinds bench writes
    return (layer if isinstance(layer, int) and not isinstance(layer, bool) else None,
            imitation if isinstance(imitation, str) else None)


def _own_step(name: str, records: list[dict], measured, profile: Profile) -> tuple[dict, str] | None:
    """How to look drafter ``name``'s own draft step up in ``measured`` (keywords of ``LatencyResult.ratio``) and how
    the summary names it (``bench/latency.own_step``, at the records' batch rows and ssd settings); None when it was
    not timed."""
    from mmspec_cli.bench.latency import own_step
    from mmspec_cli.drafters.registry import priced_plan

    try:
        plan = priced_plan(name, profile.ensemble.members)
    except InputError:  # a name this version does not take (an older release's record): not priced
        return None
    layer, imitation = _ssd_setting(records, profile)
    step = own_step(measured, plan, rows=len(records[0].get("members") or ()) or 1, ssd_layer=layer,
                    imitation=imitation)
    return None if step is None else (step.ratio, step.shown)


def _untimed_name(name: str, records: list[dict], profile: Profile) -> str:
    """``name`` as the note on missing latencies lists it: an ssd drafter with the layer its records used."""
    if name not in ("ssd", SSD_PLAIN):
        return name
    layer, imitation = _ssd_setting(records, profile)
    through = f" and imitation network {_short(imitation, 40)}" if name == "ssd" and imitation else ""
    return f"{name} (at ssd.layer {layer}{through})"


def _short(text: object, limit: int = 60) -> str:
    """A model name or path as quoted in a note: long ones cut in the middle, where they differ least."""
    text = str(text)
    return text if len(text) <= limit else text[: limit // 2 - 1] + "..." + text[-(limit // 2 - 2):]


def _report(records: list[dict], profile: Profile, fmt: str, label: str) -> int:
    from rich.console import Console

    from mmspec_cli.bench import report
    from mmspec_cli.bench.summary import summarize

    ratios, steps, eq1_note = latency_ratios(profile, records, label)
    summary = summarize(records, ratios, steps)
    lines = [report.check_line(summary), report.ratio_line(summary), eq1_note]
    if fmt == "json":
        typer.echo(report.as_json(summary))
    elif fmt == "csv":
        typer.echo(report.as_csv(summary.rows), nl=False)
    else:
        console = Console(file=sys.stdout, width=None if sys.stdout.isatty() else 140)
        console.print(report.table(summary))
        for line in lines:
            if line:
                console.print(line, highlight=False, soft_wrap=True)
    if fmt != "table":
        for line in lines:
            if line:
                typer.echo(line, err=True)
    failures = report.failure_line(summary)
    if failures:  # why the exit code is 1: on stderr in every format, where a script or a user looks for errors
        typer.echo(failures, err=True)
    return 0 if summary.ok else EXIT_FAILED
