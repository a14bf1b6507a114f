"""Training FastVLM's imitation network (``mmspec train-head imitation``), on the machinery the heads use.

The draft is the target's first n layers, the IN, the final norm and the LM head; the target is
frozen and the IN alone (with a projection used only by the loss) is trained. One frozen forward
of the target over each answered turn gives, per position, the hidden state after layer n (the
IN's input), the outputs of the last four layers (concatenated: the paper's best fusion, Table 5)
and the target's logits. The loss (FastVLM §5, Table 1's "Ours+CS+KD") is, at every position that
predicts an answer token,

    L = CE(draft logits, the target's own token) + (1 − cos(P·IN(x_n), x_fused)) + KL(p_target ‖ p_draft),

where the target's answer IS the ground truth of a lossless drafter and P: H → 4H is a learnt
projection (the fused states are four times as wide as the IN's output).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from mmspec_cli.models.imitation import ImitationNetwork
from mmspec_cli.models.loading import LoadedModel
from mmspec_cli.models.parts import text_decoder
from mmspec_cli.training.losses import imitation_loss, top1_agreement, uniform_noise
from mmspec_cli.training.sequences import Turn, run_turn

FUSED_LAYERS = 4  # the last four layers' outputs (FastVLM: x_L, x_{L-1}, x_{L-2}, x_{L-3})


def fused_layers(target: LoadedModel) -> int:
    """How many last layers are fused: four, or all of them in a shallower target."""
    text = target.model.config.get_text_config()
    return min(FUSED_LAYERS, text.num_hidden_layers)


@dataclass(frozen=True)
class LayerSequence:
    """``ids`` = prompt + answer; per position: ``exit`` (N, H) after layer n, ``fused`` (N, 4H), ``final`` (N, H)."""

    ids: list[int]
    prompt_len: int
    exit: torch.Tensor
    fused: torch.Tensor
    final: torch.Tensor

    @property
    def nbytes(self) -> int:
        return (self.exit.numel() + self.fused.numel() + self.final.numel()) * 4


def layer_reader(layer: int):
    """A reader of :class:`LayerSequence` for exit layer ``layer`` (for :class:`~.sequences.SequenceStore`)."""

    def read(target: LoadedModel, turn: Turn) -> LayerSequence:
        parts: list[tuple[torch.Tensor, ...]] = []  # per forward: (L + 1) x (N_i, H), [l] after layer l, [L] normed
        prompt = run_turn(target, turn, lambda out, positions: parts.append(tuple(s[0] for s in out.hidden_states)),
                          output_hidden_states=True)
        states = [torch.cat(layer) for layer in zip(*parts)]  # (L + 1) x (N, H)
        fused = torch.cat([states[-k] for k in range(fused_layers(target), 0, -1)], dim=-1)
        return LayerSequence(prompt.ids + list(turn.answer.answer_ids), len(prompt.ids), states[layer].float().clone(),
                             fused.float().clone(), states[-1].float().clone())

    return read


class ImitationObjective(nn.Module):
    """The loss of ``network`` (after layer n) on a batch; ``projection`` maps its output to the fused width."""

    def __init__(self, network: ImitationNetwork, target: LoadedModel, noise: float):
        super().__init__()
        hidden = network.fc1.in_features
        self.network = network
        self.projection = nn.Linear(hidden, fused_layers(target) * hidden, bias=False)
        object.__setattr__(self, "norm", text_decoder(target.model).norm)  # the target's: frozen, not trained
        object.__setattr__(self, "lm_head", target.model.get_output_embeddings())
        self.noise = noise

    def forward(self, batch: Sequence[LayerSequence], generator: torch.Generator | None = None):
        device = self.network.fc1.weight.device
        rows, fused, final, tokens = [], [], [], []
        for seq in batch:
            scored = slice(max(0, seq.prompt_len - 1), len(seq.ids) - 1)  # positions predicting answer tokens
            x = seq.exit[scored].to(device)
            rows.append(x + uniform_noise(x, self.noise, generator))
            fused.append(seq.fused[scored].to(device))
            final.append(seq.final[scored].to(device))
            tokens.append(torch.tensor(seq.ids[scored.start + 1:scored.stop + 1], device=device))
        out = self.network(torch.cat(rows))
        draft_logits = self.lm_head(self.norm(out.to(self.norm.weight.dtype)))
        with torch.no_grad():
            target_logits = self.lm_head(torch.cat(final).to(self.lm_head.weight.dtype))
        loss = imitation_loss(draft_logits, torch.cat(tokens), target_logits, self.projection(out), torch.cat(fused))
        return loss, [{"loss": float(loss.detach()), "top1": float(top1_agreement(draft_logits.detach(), target_logits)),
                       "positions": int(target_logits.shape[0])}]
