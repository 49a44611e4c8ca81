"""Policy-gradient losses, chosen by name from POLICY_LOSSES.

Each takes (logprobs, old_logprobs, advantages, response_mask), all [B, T], plus keyword options,
and returns (loss, metrics) with metrics as detached 0-dim tensors (no device sync here).
"""

from __future__ import annotations

from typing import Callable

import torch

from hybridrl.algos.aggregation import aggregate_loss
from hybridrl.algos.masking import check_same_shape, masked_mean
from hybridrl.algos.registry import Registry

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]

POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss")

# exp() of a log-ratio beyond this overflows or explodes the gradient; verl clamps the same way.
_MAX_LOG_RATIO = 20.0


def get_policy_loss(name: str) -> PolicyLossFn:
    """The policy loss registered as `name`; ValueError listing the valid names otherwise."""
    return POLICY_LOSSES.get(name)


@POLICY_LOSSES.register("ppo")
def ppo_policy_loss(
    logprobs: torch.Tensor,  # [B, T] under the current policy (carries the gradient)
    old_logprobs: torch.Tensor,  # [B, T] under the policy that sampled the batch
    advantages: torch.Tensor,  # [B, T]
    response_mask: torch.Tensor,  # [B, T]
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    loss_agg: str = "token-mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    max_response_length: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017, Eq. 7), per token:

        loss = max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high)),  r = exp(logp - old_logp)

    Separate low/high bounds are DAPO's clip-higher (Yu et al. 2025, Eq. 10). With dual_clip = c
    (> 1), the loss of a negative-advantage token is capped at -c * A (Ye et al. 2020, Eq. 5).

    Metrics: pg_loss; pg_clipfrac (valid tokens where the clipped branch is active);
    pg_clipfrac_lower (valid tokens where the dual-clip cap is active); ppo_kl (masked mean of
    old_logprobs - logprobs).
    """
    check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages,
                     response_mask=response_mask)
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low must be in [0, 1) so the ratio floor stays positive, "
                         f"got {clip_low}")
    if clip_high < 0.0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (typically 3), or None to disable; "
                         f"got {dual_clip}")

    token_losses, log_ratio, clip_active, dual_active = _ppo_token_losses(
        logprobs, old_logprobs, advantages, clip_low, clip_high, dual_clip
    )
    loss = aggregate_loss(token_losses, response_mask, loss_agg, num_tokens=num_tokens,
                          num_seqs=num_seqs, max_response_length=max_response_length)
    metrics = {
        "pg_loss": loss.detach(),
        "pg_clipfrac": masked_mean(clip_active.to(logprobs.dtype), response_mask).detach(),
        "pg_clipfrac_lower": masked_mean(dual_active.to(logprobs.dtype), response_mask).detach(),
        "ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
    }
    return loss, metrics


def _ppo_branches(logprobs, old_logprobs, advantages, clip_low, clip_high):
    """The two branches of the PPO-clip loss per token, shared by the loss and its derivative:
    (raw log-ratio, clamped log-ratio, ratio, unclipped loss, clipped loss)."""
    raw = logprobs - old_logprobs
    log_ratio = raw.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    return raw, log_ratio, ratio, -advantages * ratio, -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)


def _ppo_token_losses(logprobs, old_logprobs, advantages, clip_low, clip_high, dual_clip):
    """ppo_policy_loss per token: (token losses, log-ratio, clip active, dual clip active)."""
    _, log_ratio, _, unclipped, clipped = _ppo_branches(logprobs, old_logprobs, advantages, clip_low, clip_high)
    token_losses = torch.maximum(unclipped, clipped)
    clip_active = clipped > unclipped
    dual_active = torch.zeros_like(clip_active)
    if dual_clip is not None:
        dual_active, cap = _dual_clipped(token_losses, advantages, dual_clip)
        token_losses = torch.where(dual_active, cap, token_losses)
    return token_losses, log_ratio, clip_active, dual_active


def _dual_clipped(token_losses, advantages, dual_clip):
    """Dual clip, shared by the loss and its derivative: (where it caps a token's PPO-clip loss, the
    cap -advantage * dual_clip); it caps tokens with a negative advantage only."""
    cap = -advantages * dual_clip
    return (advantages < 0) & (token_losses > cap), cap


def ppo_token_loss_grad(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> torch.Tensor:
    """The derivative of ppo_policy_loss's per-token loss (before aggregation) with respect to each
    token's log-prob, in closed form: what autograd gives through it, ties and bounds included
    (torch.maximum splits the gradient of equal branches evenly; clamp passes it at its bounds).
    For the policy update's lm_head, which makes its gradient in its forward pass."""
    raw, _, ratio, unclipped, clipped = _ppo_branches(logprobs, old_logprobs, advantages, clip_low, clip_high)
    in_range = (ratio >= 1.0 - clip_low) & (ratio <= 1.0 + clip_high)
    share = torch.where(unclipped > clipped, 1.0, torch.where(unclipped == clipped, 0.5, 0.0))  # of the unclipped branch
    d_ratio = -advantages * (share + (1.0 - share) * in_range)
    grad = d_ratio * ratio * ((raw >= -_MAX_LOG_RATIO) & (raw <= _MAX_LOG_RATIO))
    if dual_clip is not None:
        capped, _ = _dual_clipped(torch.maximum(unclipped, clipped), advantages, dual_clip)
        grad = torch.where(capped, 0.0, grad)
    return grad
