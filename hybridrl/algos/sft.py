"""Supervised fine-tuning loss."""

from __future__ import annotations

import torch

from hybridrl.algos.aggregation import aggregate_loss


def sft_loss(
    logprobs: torch.Tensor,  # [B, T] log-probs of the target tokens
    loss_mask: torch.Tensor,  # [B, T] tokens that are trained on (usually the response)
    loss_agg: str = "token-mean",
    num_tokens: float | None = None,
    *,
    num_seqs: float | None = None,
    max_response_length: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Negative log-likelihood of the target tokens, aggregated by `loss_agg`. Metric: loss."""
    loss = aggregate_loss(-logprobs, loss_mask, loss_agg, num_tokens=num_tokens,
                          num_seqs=num_seqs, max_response_length=max_response_length)
    return loss, {"loss": loss.detach()}
