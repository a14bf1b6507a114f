"""The training losses of a draft head (pure functions of logits) and the learning-rate schedule.

Every loss takes the draft's logits and the target's logits at the same positions, (n, V) each,
and returns the mean over the n positions (a scalar tensor). The target's distribution is
p = softmax(target logits), the draft's q = softmax(draft logits).

Which loss (``--loss``):

- ``vispec`` (the default): ViSpec's stage-2 loss, from its released training code
  (``train/main_mtp.py``, as the project's notes on ViSpec record it), ``10·L1(q, p) + 0.1·ListMLE``
  on the target's top-10 (:func:`vispec_loss`). The L1 term is Σ_v |q_v − p_v| = 2·TV(p, q): one
  minus the total variation is the probability that speculative sampling accepts a drafted token
  (Leviathan et al. 2023), so it measures acceptance directly; ListMLE orders the draft's top tokens as the
  target orders them, which is what greedy and tree drafting need.
- ``ce``: the paper's Eq. (6), L = CrossEntropy(p_i, p̂_i), the soft cross-entropy against the
  target's distribution (:func:`soft_cross_entropy`).

The L1 is summed over the vocabulary (not averaged), so the loss does not shrink with the
vocabulary's size and the weights 10 and 0.1 keep their balance on any target.
"""

from __future__ import annotations

import torch

from mmspec_cli.choices import TRAIN_LOSSES

L1_WEIGHT = 10.0  # ViSpec stage 2
LISTMLE_WEIGHT = 0.1  # ViSpec stage 2
LISTMLE_TOP = 10  # the target's top-10 tokens
LOSSES = TRAIN_LOSSES


def _wide(logits: torch.Tensor) -> torch.Tensor:
    """Half-precision logits in float32 (softmax over a vocabulary needs it); float32 and float64 kept."""
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


def l1_distance(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Mean over positions of Σ_v |softmax(draft)_v − softmax(target)_v| (= 2·TV(p, q), in [0, 2])."""
    q = torch.softmax(_wide(draft_logits), dim=-1)
    p = torch.softmax(_wide(target_logits), dim=-1)
    return (q - p).abs().sum(dim=-1).mean()


def list_mle(draft_logits: torch.Tensor, target_logits: torch.Tensor, top: int = LISTMLE_TOP) -> torch.Tensor:
    """ListMLE (Xia et al. 2008) of the draft's scores on the target's top-``top`` ranking, mean over positions.

    With π the target's top-k tokens in descending order of its logits and s_j = draft logit of π_j::

        ListMLE = −Σ_{j=1..k} log( exp(s_j) / Σ_{l=j..k} exp(s_l) ) = Σ_j ( logsumexp(s_j..s_k) − s_j )

    It is the negative log-likelihood of the target's order under the Plackett-Luce model of the
    draft's scores: zero only when the draft ranks those k tokens in the target's order with
    unbounded margins.
    """
    k = min(top, target_logits.shape[-1])
    order = target_logits.topk(k, dim=-1).indices  # (n, k), descending
    s = _wide(draft_logits).gather(-1, order)  # (n, k)
    # logsumexp of each suffix s_j..s_k: a reversed cumulative logsumexp
    suffix = torch.logcumsumexp(s.flip(-1), dim=-1).flip(-1)
    return (suffix - s).sum(dim=-1).mean()


def vispec_loss(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """ViSpec's stage-2 loss: 10·L1(q, p) + 0.1·ListMLE(top-10), mean over positions."""
    return L1_WEIGHT * l1_distance(draft_logits, target_logits) + LISTMLE_WEIGHT * list_mle(draft_logits, target_logits)


def soft_cross_entropy(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """ViSpec Eq. (6): CrossEntropy(p, q) = −Σ_v p_v log q_v, mean over positions."""
    p = torch.softmax(_wide(target_logits), dim=-1)
    return -(p * torch.log_softmax(_wide(draft_logits), dim=-1)).sum(dim=-1).mean()


def loss_function(name: str):
    """The loss called ``name`` (one of :data:`LOSSES`)."""
    if name == "vispec":
        return vispec_loss
    if name == "ce":
        return soft_cross_entropy
    raise ValueError(f"unknown loss {name!r}; choose from {', '.join(LOSSES)}")


def top1_agreement(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """The share of positions where the draft's argmax is the target's (what greedy drafting needs)."""
    return (draft_logits.argmax(-1) == target_logits.argmax(-1)).float().mean()


def lr_factor(step: int, warmup: int, total: int) -> float:
    """The learning rate's multiplier at optimizer step ``step`` (0-based): linear warm-up over ``warmup``
    steps, (step + 1) / warmup, then linear decay to zero at ``total``: (total − step) / (total − warmup).
    ViSpec warms up for one epoch of twenty and decays linearly."""
    if step < warmup:
        return (step + 1) / warmup
    return max(0.0, (total - step) / max(1, total - warmup))


def uniform_noise(features: torch.Tensor, scale: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Noise for the target's features: (U − 0.5)·scale·rms(features), U ~ Uniform[0, 1) per element.

    EAGLE and ViSpec add (U − 0.5)·0.2·512/L, an absolute amplitude tuned for 7B targets; here the
    amplitude follows the features' own RMS, so a target whose features have another scale (the demo
    target's RMS is about 1.35) gets the same relative noise (``scale`` 0.2: uniform on ±10% of the RMS).
    """
    if scale <= 0:
        return torch.zeros_like(features)
    rms = features.detach().float().pow(2).mean().sqrt()
    u = torch.rand(features.shape, generator=generator, dtype=torch.float32, device="cpu").to(features.device)
    return ((u - 0.5) * scale * rms).to(features.dtype)


def cosine_distance(output: torch.Tensor, fused: torch.Tensor) -> torch.Tensor:
    """FastVLM's similarity loss, 1 − x_I·x_fused / (‖x_I‖ ‖x_fused‖), mean over positions ((n, D) each)."""
    return (1 - torch.nn.functional.cosine_similarity(_wide(output), _wide(fused), dim=-1)).mean()


def distillation(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Knowledge distillation (Hinton et al. 2015, T = 1): KL(p ‖ q) = Σ_v p_v (log p_v − log q_v), mean over positions."""
    log_p = torch.log_softmax(_wide(target_logits), dim=-1)
    log_q = torch.log_softmax(_wide(draft_logits), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(dim=-1).mean()


def imitation_loss(draft_logits: torch.Tensor, tokens: torch.Tensor, target_logits: torch.Tensor,
                   output: torch.Tensor, fused: torch.Tensor) -> torch.Tensor:
    """FastVLM's loss for the imitation network (§5, Table 1 "Ours+CS+KD"): cross-entropy on the target's own
    tokens + cosine distance to the fused deep states + distillation from the target's distribution, equal weights."""
    ce = torch.nn.functional.cross_entropy(_wide(draft_logits), tokens)
    return ce + cosine_distance(output, fused) + distillation(draft_logits, target_logits)
