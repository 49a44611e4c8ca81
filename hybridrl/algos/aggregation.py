"""Turning a per-token loss matrix [B, T] into one scalar: the loss-aggregation modes.

Gradient accumulation: a mini-batch split into micro-batches gives exactly the mini-batch loss when
each micro-batch is normalised by the GLOBAL counts of the mini-batch (`num_tokens`, `num_seqs`)
and the micro-batch losses are summed. Without them each micro-batch uses its own counts.
"""

from __future__ import annotations

from typing import Protocol

import torch

from hybridrl.algos.masking import check_same_shape, masked_count, masked_sum
from hybridrl.algos.registry import Registry


class AggregationFn(Protocol):
    def __call__(
        self,
        loss_mat: torch.Tensor,
        mask: torch.Tensor,
        num_tokens: float | None,
        num_seqs: float | None,
        max_response_length: int | None,
    ) -> torch.Tensor: ...


LOSS_AGGREGATIONS: Registry[AggregationFn] = Registry("loss aggregation mode")


def _num_seqs(mask: torch.Tensor, num_seqs: float | None) -> torch.Tensor | float:
    # Sequences with at least one valid token; all-padding rows (batch padding) do not count.
    return num_seqs if num_seqs is not None else (mask.bool().any(-1)).sum().clamp(min=1)


@LOSS_AGGREGATIONS.register("token-mean")
def _token_mean(loss_mat, mask, num_tokens, num_seqs, max_response_length):
    # Every valid token of the batch weighs the same (DAPO, Yu et al. 2025, Eq. 8).
    denominator = num_tokens if num_tokens is not None else masked_count(mask).clamp(min=1)
    return masked_sum(loss_mat, mask) / denominator


@LOSS_AGGREGATIONS.register("seq-mean-token-mean")
def _seq_mean_token_mean(loss_mat, mask, num_tokens, num_seqs, max_response_length):
    # Original GRPO (Shao et al. 2024, Eq. 3): mean over each sequence, then over sequences.
    seq_losses = masked_sum(loss_mat, mask, dim=-1) / masked_count(mask, dim=-1).clamp(min=1)
    return seq_losses.sum() / _num_seqs(mask, num_seqs)


@LOSS_AGGREGATIONS.register("seq-mean-token-sum")
def _seq_mean_token_sum(loss_mat, mask, num_tokens, num_seqs, max_response_length):
    seq_losses = masked_sum(loss_mat, mask, dim=-1)
    return seq_losses.sum() / _num_seqs(mask, num_seqs)


@LOSS_AGGREGATIONS.register("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(loss_mat, mask, num_tokens, num_seqs, max_response_length):
    # Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", Eq. 3): a constant
    # normaliser, so long responses are not down-weighted per token.
    length = max_response_length if max_response_length is not None else loss_mat.shape[-1]
    return masked_sum(loss_mat, mask) / (_num_seqs(mask, num_seqs) * length)


def aggregate_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    max_response_length: int | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss `loss_mat` [B, T] over valid tokens `mask` [B, T] to a scalar.

    mode: one of LOSS_AGGREGATIONS.names():
      "token-mean"               sum over all valid tokens / num_tokens
      "seq-mean-token-mean"      per-sequence token mean, summed / num_seqs
      "seq-mean-token-sum"       per-sequence token sum, summed / num_seqs
      "seq-mean-token-sum-norm"  sum over all valid tokens / (num_seqs * max_response_length)
    num_tokens / num_seqs: global counts of the whole mini-batch, for gradient accumulation
      (default: this batch's valid tokens / sequences with at least one valid token).
    max_response_length: the Dr. GRPO constant (default T; pass the configured response length
      when micro-batches are padded to different T).
    """
    check_same_shape(loss_mat=loss_mat, mask=mask)
    if loss_mat.dim() != 2:
        raise ValueError(f"loss_mat must be [B, T], got shape {list(loss_mat.shape)}")
    for name, value in (("num_tokens", num_tokens), ("num_seqs", num_seqs),
                        ("max_response_length", max_response_length)):
        if value is not None and value <= 0:
            raise ValueError(f"{name} must be positive when given, got {value}")
    aggregate = LOSS_AGGREGATIONS.get(mode)
    return aggregate(loss_mat, mask, num_tokens, num_seqs, max_response_length)
