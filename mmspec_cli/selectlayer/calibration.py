"""Running the target over a calibration set for ``mmspec select-layer`` (FastVLM App. A.4).

:func:`layer_confidences` decodes every sample with the target alone (``ar``, the profile's
decoding settings), then runs one forward per turn over prompt + answer with the hidden
states of every layer, and sums the confidence max softmax(LM head(final norm(h_l))) over
the positions that predict the generated tokens (the maths is in :mod:`.reward`); with FastVLM's
imitation network, C_n also through it (IN + final norm + LM head) at the layer n it was trained for.
:func:`measure_layers` runs ``ssd`` at given layers over the same samples and measures what
the reward only stands in for: block efficiency τ, the latency ratio c and the speedup.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mmspec_cli.api import ModelSet
from mmspec_cli.choices import SSD_PLAIN
from mmspec_cli.inputs.samples import Sample, load_sample_images, load_turn_images
from mmspec_cli.decoding.conversation import images_per_user_turn, images_shown
from mmspec_cli.models.families import family_of
from mmspec_cli.models.parts import text_decoder
from mmspec_cli.decoding.events import BlockVerified, Generation
from mmspec_cli.selectlayer.reward import max_confidence_sums
from mmspec_cli.decoding.metrics import RunStats, expected_speedup
from mmspec_cli.models.prompts import process, render_prompt
from mmspec_cli.decoding.kv import to_model

WARMUP_TOKENS = 4


@dataclass(frozen=True)
class Calibration:
    """Mean confidence C_l per layer over ``positions`` generated positions, and the ``ar`` baseline's timing."""

    confidences: dict[int, float]
    positions: int
    samples: int
    ar: RunStats
    imitation: dict[int, float] | None = None  # C_n with the imitation network in place, at its layer n


@dataclass(frozen=True)
class LayerMeasurement:
    """``ssd`` at ``layer`` on the calibration set: τ, c = T_q / T_p, Eq. (1), and the walltime speedup over ar."""

    layer: int
    block_efficiency: float
    latency_ratio: float
    expected_speedup: float
    speedup: float
    imitation: bool = False  # drafted through the imitation network


def _decode(models: ModelSet, drafter: str, samples: Sequence[Sample], ssd_layer: int | None = None,
            imitation: Any = None) -> list[tuple[Sample, tuple[list, dict[int, list]], Generation]]:
    """Decode every sample with ``drafter`` after one short untimed warm-up turn; with each, its images (the
    opening ones, and {question index: the images it brings})."""
    decoder = models.decoder(drafter, ssd_layer=ssd_layer, imitation=imitation)
    loaded = [(sample, load_sample_images(sample), load_turn_images(sample, len(sample.turns))) for sample in samples]
    if loaded:
        sample, images, brought = loaded[0]
        decoder.generate(images, list(sample.turns[:1]), history=sample.history,
                         max_new_tokens=min(WARMUP_TOKENS, decoder.max_new_tokens),
                         turn_images={0: brought[0]} if 0 in brought else None)  # the warm-up asks one question
    return [(sample, (images, brought), decoder.generate(images, list(sample.turns), history=sample.history,
                                                         turn_images=brought))
            for sample, images, brought in loaded]


@torch.inference_mode()
def layer_confidences(models: ModelSet, samples: Sequence[Sample], layers: Sequence[int],
                      imitation: tuple[int, torch.nn.Module] | None = None) -> Calibration:
    """C_l for each of ``layers``, averaged over the generated positions of every turn of every sample;
    with ``imitation`` = (n, IN), also C_n with the IN between layer n and the final norm."""
    target = models.target
    decoder = text_decoder(target.model)
    head = target.model.get_output_embeddings()
    sums = dict.fromkeys(layers, 0.0)
    imitated = 0.0
    positions = 0
    family = family_of(target.model)
    runs = _decode(models, "ar", samples)
    for sample, (images, brought), generation in runs:
        answers: list[str] = []
        counts = images_per_user_turn(len(images), brought, len(sample.history), len(sample.turns))
        for turn, result in enumerate(generation.turns):
            text = render_prompt(target.processor, sample.turns[: turn + 1], answers, counts, sample.history)
            prompt = process(target.processor, text, images_shown(images, brought, turn))
            ids = torch.tensor([prompt.ids + result.token_ids], device=target.model.device)  # (1, S)
            vision = {k: to_model(v, target.model) for k, v in prompt.vision.items()}
            # explicit positions, as decoding fed them: the prompt's (Qwen-VL: get_rope_index, whose token types
            # cover the prompt alone), then the answer's after the prompt's rope offset
            at, offset = family.prompt_positions(target.model, prompt.ids, vision, ids.device)
            after = family.positions(offset).chain(len(prompt.ids), len(result.token_ids), ids.device)
            out = target.model(input_ids=ids, position_ids=torch.cat([at, after], dim=-1), output_hidden_states=True,
                               logits_to_keep=1, **vision)
            # the positions whose next token was generated: the prompt's last one and all answer tokens but the last
            predicting = torch.arange(len(prompt.ids) - 1, ids.shape[1] - 1, device=ids.device)  # (P,)
            for layer, total in max_confidence_sums(out.hidden_states, predicting, layers, decoder.norm, head).items():
                sums[layer] += total
            if imitation is not None:
                n, network = imitation
                through = torch.nn.Sequential(network, decoder.norm)
                imitated += max_confidence_sums(out.hidden_states, predicting, [n], through, head)[n]
            positions += len(predicting)
            answers.append(result.text)
    ar = RunStats.total(g.stats for _, _, g in runs)
    with_in = None if imitation is None else {imitation[0]: imitated / max(positions, 1)}
    return Calibration({layer: s / max(positions, 1) for layer, s in sums.items()}, positions, len(runs), ar, with_in)


def latency_ratio(blocks: Sequence[BlockVerified]) -> float:
    """c = T_q / T_p: mean time of one draft step over mean time of one verification call.

    The first block of each turn is left out: under ``ssd`` its draft phase holds the target's prefill.
    """
    steps = [b.draft_s / len(b.draft) for b in blocks if b.index > 0 and b.draft]
    verifies = [b.verify_s for b in blocks if b.index > 0 and b.draft]
    if not steps:
        return float("nan")
    return statistics.fmean(steps) / statistics.fmean(verifies)


def measure_layers(models: ModelSet, samples: Sequence[Sample], layers: Sequence[int],
                   ar: RunStats, imitation: torch.nn.Module | None = None) -> list[LayerMeasurement]:
    """Run ``ssd`` at each of ``layers`` on ``samples`` (through ``imitation`` when given, else ``ssd:plain``);
    τ, c, Eq. (1) and the walltime speedup over ``ar``."""
    ar_per_token = ar.wall_s / max(ar.new_tokens, 1)
    out = []
    for layer in layers:
        drafter = "ssd" if imitation is not None else SSD_PLAIN
        runs = _decode(models, drafter, samples, ssd_layer=layer, imitation=imitation)
        stats = RunStats.total(g.stats for _, _, g in runs)
        tau = stats.block_efficiency
        blocks = [b for _, _, g in runs for t in g.turns for b in t.blocks]
        c = latency_ratio(blocks)
        drafted = [len(b.draft) for b in blocks if b.draft]  # the γ actually drafted (schedules change it)
        gamma = statistics.fmean(drafted) if drafted else models.profile.decoding.gamma
        per_token = stats.wall_s / max(stats.new_tokens, 1)
        out.append(LayerMeasurement(layer, tau, c, expected_speedup(tau, gamma, c),
                                    ar_per_token / per_token if per_token > 0 else float("nan"), imitation is not None))
    return out


def best_measured(measurements: Sequence[LayerMeasurement]) -> LayerMeasurement:
    """The run with the highest measured walltime speedup (ties: the shallower, then the one without an IN)."""
    return min(measurements, key=lambda m: (-m.speedup, m.layer, m.imitation))
