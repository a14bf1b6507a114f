"""``mmspec select-layer``: choose ``ssd.layer`` by FastVLM's reward (App. A.4), optionally checked by measurement.

The maths is in :mod:`mmspec_cli.selectlayer.reward`, the model runs in :mod:`mmspec_cli.selectlayer.calibration`;
this module reads the flags, checks them before any model loads, and prints.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml

from mmspec_cli.cli.errors import shorten
from mmspec_cli.cli.options import ProfileName, Questions, Threads, check_threads, check_writable, decoding_flags
from mmspec_cli.errors import InputError, MmspecError
from mmspec_cli.models.profiles import Profile, apply_overrides, load_profile, profile_to_dict


@decoding_flags(exclude=("ssd_layer",))  # it chooses the layer
def select_layer(
    sources: Annotated[list[str] | None, typer.Argument(metavar="SOURCE|IMAGE", show_default=False, help=(
        "A JSONL manifest, a built-in suite (demo-single, ...) or a dataset id; or image files with -q."))] = None,
    question: Questions = None,
    profile: ProfileName = None,
    limit: Annotated[int | None, typer.Option(metavar="N", help="Use the first N samples only.")] = None,
    lam: Annotated[float | None, typer.Option("--lambda", metavar="X", help=(
        "Reward cost per layer, r_l = C_l - X*l (default 1/L)."))] = None,
    max_layer: Annotated[int | None, typer.Option(metavar="L", help="Consider layers 1..L (default L/2).")] = None,
    empirical: Annotated[int | None, typer.Option(metavar="K", help=(
        "Also run ssd at the K best layers by reward and choose by measured speedup."))] = None,
    write: Annotated[str | None, typer.Option(metavar="PROFILE", help=(
        "Save a copy of the profile with ssd.layer set to the chosen layer, to a new file (an existing one is "
        "refused); its imitation network is kept if trained for that layer."))] = None,
    imitation: Annotated[bool, typer.Option("--imitation", help=(
        "Also score the profile's imitation network (ssd.imitation) at its layer; with --empirical, run ssd "
        "both with and without it."))] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    threads: Threads = None,
    *,
    overrides: dict,
) -> None:
    """Choose the draft depth of self-speculative drafting (ssd) on a calibration set (FastVLM App. A.4).

    C_l is the target's mean max-softmax confidence, over the generated tokens, when its hidden state after layer l goes through the final norm and LM head. The reward is r_l = C_l - λ·l; the chosen layer maximises it.

    --write never replaces a file that holds something. Its copy keeps the profile's imitation network (ssd.imitation) when the network was trained for the chosen layer (with --imitation: when the choice drafts through it); otherwise the copy drafts without it, and a warning line says so.
    """
    from mmspec_cli.selectlayer.reward import check_lambda

    if lam is not None:
        check_lambda(lam)
    for flag, value in (("--limit", limit), ("--empirical", empirical), ("--max-layer", max_layer)):
        if value is not None and value < 1:
            raise InputError(f"{flag}: expected an integer >= 1, got {value}")
    chosen = apply_overrides(load_profile(profile), **overrides)
    if imitation and chosen.ssd.imitation is None:
        raise InputError("--imitation scores the profile's imitation network, and it names none; add "
                         "ssd: {layer: N, imitation: PATH} (train one with `mmspec train-head imitation`)")
    threads = check_threads(threads)
    out_path = _check_write(write, chosen)
    samples = _samples(sources or [], question or [], limit)
    from mmspec_cli.cli.display import forget_compiling

    forget_compiling()
    result = _run(chosen, samples, lam, max_layer, empirical, threads, imitation)
    failed, warning = None, None
    if out_path is not None:
        kept, warning = written_imitation(chosen.ssd.imitation, _trained_layer(chosen, imitation), result["chosen"],
                                          scored=imitation, chosen_with_it=result.get("chosen_imitation", False))
        try:
            _write_profile(chosen, result["chosen"], kept, out_path, write)
            result["written"], result["written_imitation"] = str(out_path), kept
        except InputError as exc:  # a file made there during the calibration: print the results first
            failed = str(exc)
        except OSError as exc:  # checked above, but the disk can still fill up
            failed = f"--write {shorten(write)} could not be written ({exc.strerror or exc})"
    typer.echo(json.dumps(_finite(result)) if as_json else _report(result), nl=as_json)
    if warning is not None and failed is None:
        typer.echo(f"warning: {warning}", err=True)
    from mmspec_cli.cli.display import report_compiling

    report_compiling()
    if failed is not None:
        raise InputError(f"{failed}; set ssd.layer: {result['chosen']} in a copy of the profile by hand")


def _finite(value: Any) -> Any:
    """NaN (a latency ratio with no timed draft step) becomes null, so the output stays valid JSON."""
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _check_write(write: str | None, profile: Profile) -> Path | None:
    """The ``--write`` path, checked before the calibration so that a bad one can't cost its results."""
    if write is None:
        return None
    path = Path(write).expanduser()
    if path.resolve() == Path(profile.source).resolve():
        raise InputError(f"--write {shorten(write)} is the profile itself; --write saves a copy, so name another file")
    refuse_existing(path, write)
    check_writable(path, "--write")
    return path


def refuse_existing(path: Path, write: str) -> None:
    """Refuse a ``--write`` file that already holds something, as ``bench --out`` refuses one: the copy of the
    profile must not replace what a user wrote there (notes, another profile). An empty file holds nothing to lose."""
    if path.is_file() and path.stat().st_size > 0:
        raise InputError(f"--write {shorten(write)} already exists; --write saves to a new file, so choose another "
                         f"name or delete it first")


def written_imitation(name: str | None, trained: int | None, chosen: int, scored: bool,
                      chosen_with_it: bool) -> tuple[str | None, str | None]:
    """The ``ssd.imitation`` of the written profile, and a warning when the profile's is left out.

    With ``--imitation`` (``scored``) the choice itself says whether drafting goes through the imitation network
    (``chosen_with_it``). Without it the profile's network is kept as the user set it, when it follows the chosen
    layer: it was trained after that layer (``trained``; None: its config can't be read). Else it can't be used
    there (ssd refuses a network trained for another layer), so the copy drafts without it and a warning says so."""
    if name is None:
        return None, None
    if scored:
        return (name if chosen_with_it else None), None
    if trained == chosen:
        return name, None
    why = ("can't be read" if trained is None else
           f"was trained after layer {trained}, not the chosen layer {chosen}")
    return None, (f"the profile's imitation network {shorten(name)} {why}, so the written profile drafts without "
                  f"it; pass --imitation to compare drafting through it, or train one for layer {chosen} with "
                  f"`mmspec train-head imitation`")


def _trained_layer(profile: Profile, scored: bool) -> int | None:
    """The layer the profile's imitation network follows, read from its config (None: none, or unreadable); only
    needed when it was not scored (``--imitation`` compares it at its layer instead)."""
    if profile.ssd.imitation is None or scored:
        return None
    from mmspec_cli.models.imitation import trained_layer

    try:
        return trained_layer(profile.ssd.imitation)
    except (MmspecError, OSError):
        return None


def _samples(sources: list[str], questions: list[str], limit: int | None) -> list:
    """A calibration set: images with -q (one sample), or one SOURCE resolved like ``bench``'s."""
    from mmspec_cli.inputs.samples import Sample
    from mmspec_cli.models.images import load_images

    if questions:
        return [Sample(id="input", category="input", turns=tuple(questions), images=tuple(load_images(sources)))]
    refuse_images(sources)
    if len(sources) != 1:
        raise InputError("pass one calibration SOURCE (a manifest, a suite such as demo-single, a dataset id), "
                         "or image files with -q QUESTION")
    from mmspec_cli.inputs.sources import resolve

    samples = resolve(sources[0], limit)
    if not samples:
        raise InputError(f"SOURCE {sources[0]} holds no samples; pass a calibration set with at least one")
    return samples


def refuse_images(sources: list[str]) -> None:
    """Without -q a SOURCE is a calibration set; an image there would be read as a JSONL manifest and fail to
    decode, so it is refused first in its own words."""
    from mmspec_cli.models.images import is_image_file

    for source in sources:
        if is_image_file(Path(os.path.expanduser(source))):
            raise InputError(f"SOURCE {shorten(source)} is an image, and images need a question: pass -q QUESTION "
                             f"(e.g. -q 'What is in the image?'), or a JSONL manifest or a suite such as demo-single")


def _run(profile: Profile, samples: list, lam: float | None, max_layer: int | None,
         empirical: int | None, threads: int | None = None, imitation: bool = False) -> dict[str, Any]:
    from mmspec_cli.selectlayer import calibration, reward as layer_select
    from mmspec_cli.api import ModelSet
    from mmspec_cli.drafters.ssd import check_layer, layer_count
    from mmspec_cli.models.imitation import load_imitation, trained_layer

    unset = dataclasses.replace(profile, ssd=dataclasses.replace(profile.ssd, layer=None, imitation=None))
    # this chooses ssd.layer: the profile's own (maybe stale) is not checked; threads: the CLI's choice, made below
    models = ModelSet.load(unset, ["ar"], threads=None)
    from mmspec_cli.models.threads import apply_threads

    choice = apply_threads(threads, models.target.model)
    total = layer_count(models.target.model)
    layers = layer_select.candidate_layers(total, max_layer)
    lam = layer_select.default_lambda(total) if lam is None else lam
    network = None
    if imitation:  # the IN is scored at the layer it was trained for, where a profile may use it
        n_in = check_layer(trained_layer(profile.ssd.imitation), total)
        network = (n_in, load_imitation(profile.ssd.imitation, n_in, models.target))
    calib = calibration.layer_confidences(models, samples, layers, network)
    reward = layer_select.rewards(calib.confidences, lam)
    by_reward = layer_select.choose_layer(reward)
    with_in: dict[str, Any] | None = None
    if network is not None:
        n_in = network[0]
        in_reward = layer_select.rewards(calib.imitation, lam)[n_in]
        with_in = {"layer": n_in, "confidence": calib.imitation[n_in], "reward": in_reward,
                   "better_than_plain": in_reward > reward[by_reward]}
    result: dict[str, Any] = {
        "target": profile.target.model, "threads": choice.as_dict(), "layers_total": total, "lambda": lam, "samples": calib.samples,
        "positions": calib.positions,
        "layers": [{"layer": layer, "confidence": calib.confidences[layer], "reward": reward[layer]}
                   for layer in layers],
        "chosen_by_reward": by_reward, "chosen": by_reward,
    }
    if with_in is not None:
        result["imitation"] = with_in
        if with_in["better_than_plain"]:
            result["chosen_by_reward"] = result["chosen"] = with_in["layer"]
        result["chosen_imitation"] = with_in["better_than_plain"]
    if empirical:
        ranked = layer_select.ranked_layers(reward, empirical)
        if network is not None and network[0] not in ranked:
            ranked.append(network[0])  # both ways at the IN's layer
        measured = calibration.measure_layers(models, samples, ranked, calib.ar)
        if network is not None:
            measured += calibration.measure_layers(models, samples, [network[0]], calib.ar, imitation=network[1])
        best = calibration.best_measured(measured)
        result["empirical"] = [dataclasses.asdict(m) for m in measured]
        result["gamma"] = profile.decoding.gamma
        result["chosen_by_measurement"] = result["chosen"] = best.layer
        if network is not None:
            result["chosen_imitation"] = best.imitation
    return result


def _write_profile(profile: Profile, layer: int, imitation: str | None, path: Path, write: str) -> None:
    """The profile with ``ssd.layer: layer`` and ``ssd.imitation: imitation`` (:func:`written_imitation`), written
    unless a file appeared at ``path`` during the calibration."""
    data = profile_to_dict(dataclasses.replace(profile, ssd=dataclasses.replace(profile.ssd, layer=layer,
                                                                                 imitation=imitation)))
    refuse_existing(path, write)
    with open(path, "w" if path.exists() else "x", encoding="utf-8") as handle:  # "x": a file made since is kept
        handle.write(yaml.safe_dump(data, sort_keys=False))


def _report(result: dict[str, Any]) -> str:
    """The plain-text tables: l, C_l, r_l with the chosen layer marked; then the measurements, if any."""
    lines = [f"target {result['target']}: L = {result['layers_total']} layers, λ = {result['lambda']:.4g}, "
             f"{result['samples']} samples, {result['positions']} generated positions",
             f"{'layer':>5}  {'C_l':>7}  {'r_l':>8}"]
    for row in result["layers"]:
        mark = "  <- chosen by reward" if row["layer"] == result["chosen_by_reward"] else ""
        lines.append(f"{row['layer']:>5}  {row['confidence']:>7.4f}  {row['reward']:>8.4f}{mark}")
    if "imitation" in result:
        im = result["imitation"]
        lines.append(f"{im['layer']:>5}  {im['confidence']:>7.4f}  {im['reward']:>8.4f}  with the imitation network"
                     + ("  <- chosen by reward" if result["chosen_imitation"] and "empirical" not in result else ""))
    lines.append(f"reward (FastVLM App. A.4): n = argmax C_l - λ·l = {result['chosen_by_reward']}"
                 + (" with the imitation network" if result.get("chosen_imitation") and "empirical" not in result
                    else ""))
    if "empirical" in result:
        lines.append(f"ssd measured on the calibration set (γ = {result['gamma']}):")
        lines.append(f"{'layer':>5}  {'τ':>6}  {'c':>7}  {'Eq.(1)':>7}  {'speedup':>8}")
        for m in result["empirical"]:
            best = m["layer"] == result["chosen_by_measurement"] and m["imitation"] == result.get("chosen_imitation", False)
            mark = "  <- best measured" if best else ""
            lines.append(f"{m['layer']:>5}  {m['block_efficiency']:>6.3f}  {m['latency_ratio']:>7.4f}  "
                         f"{m['expected_speedup']:>6.3f}x  {m['speedup']:>7.3f}x"
                         + ("  with the imitation network" if m["imitation"] else "") + mark)
        if result["chosen_by_measurement"] != result["chosen_by_reward"]:
            lines.append(f"the choices differ: the reward picks {result['chosen_by_reward']}, the measured speedup "
                         f"picks {result['chosen_by_measurement']} (the reward is only a proxy); using "
                         f"{result['chosen_by_measurement']}")
        else:
            lines.append(f"the reward's choice {result['chosen_by_reward']} is also the best measured")
    lines.append(f"chosen: ssd.layer = {result['chosen']}" + (
        "" if "chosen_imitation" not in result else
        ", through the imitation network" if result["chosen_imitation"] else ", without the imitation network"))
    if "written" in result:
        imitation = result["written_imitation"]
        lines.append(f"wrote {result['written']} (the profile with ssd.layer: {result['chosen']}"
                     + (f", drafting through its imitation network {imitation})" if imitation else ")"))
    return "\n".join(lines) + "\n"
