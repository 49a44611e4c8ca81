"""Log-probabilities and entropy from logits.

Both work in at least float32 (bf16 logsumexp loses the small differences that log-probs live on).
For a large vocabulary the caller passes chunks of rows, so a full [tokens, vocab] fp32 copy never
exists.
"""

from __future__ import annotations

import torch


def _at_least_fp32(logits: torch.Tensor) -> torch.Tensor:
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[labels]: logits [..., V], labels [...] (int) -> [...] (fp32 or wider)."""
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"labels shape {list(labels.shape)} must equal logits shape without "
                         f"the vocab dim, {list(logits.shape[:-1])}")
    logits = _at_least_fp32(logits)
    label_logits = logits.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
    return label_logits - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim: [..., V] -> [...] (fp32 or wider).

    H = logsumexp(z) - sum softmax(z) * z, with z shifted by its max first (H is shift-invariant)
    so the two terms stay small and do not cancel catastrophically. Logits must be finite.
    """
    logits = _at_least_fp32(logits)
    logits = logits - logits.max(dim=-1, keepdim=True).values.detach()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)
