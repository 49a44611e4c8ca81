"""The critic's loss."""

from __future__ import annotations

import torch

from hybridrl.algos.aggregation import aggregate_loss
from hybridrl.algos.masking import check_same_shape, masked_mean


def clipped_value_loss(
    values: torch.Tensor,  # [B, T] current critic predictions (carry the gradient)
    old_values: torch.Tensor,  # [B, T] predictions at rollout time
    returns: torch.Tensor,  # [B, T] targets (e.g. GAE returns)
    response_mask: torch.Tensor,  # [B, T]
    *,
    clip: float | None = 0.2,
    loss_agg: str = "token-mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    max_response_length: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO value loss with value clipping (as in OpenAI baselines ppo2 and verl), per token:

        0.5 * max((v - R)^2, (old_v + clip(v - old_v, -clip, clip) - R)^2)

    clip=None disables clipping: 0.5 * (v - R)^2. Metrics: vf_loss, vf_clipfrac (valid tokens
    where the clipped branch is the larger one).
    """
    check_same_shape(values=values, old_values=old_values, returns=returns,
                     response_mask=response_mask)
    unclipped = (values - returns) ** 2
    if clip is None:
        token_losses = 0.5 * unclipped
        clip_active = torch.zeros_like(unclipped, dtype=torch.bool)
    else:
        if clip <= 0.0:
            raise ValueError(f"value clip must be > 0, or None to disable; got {clip}")
        values_clipped = old_values + (values - old_values).clamp(-clip, clip)
        clipped = (values_clipped - returns) ** 2
        token_losses = 0.5 * torch.maximum(unclipped, clipped)
        clip_active = clipped > unclipped

    loss = aggregate_loss(token_losses, response_mask, loss_agg, num_tokens=num_tokens,
                          num_seqs=num_seqs, max_response_length=max_response_length)
    metrics = {
        "vf_loss": loss.detach(),
        "vf_clipfrac": masked_mean(clip_active.to(values.dtype), response_mask).detach(),
    }
    return loss, metrics
