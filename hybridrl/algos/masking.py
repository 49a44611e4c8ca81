"""Reductions over the valid (unmasked) entries of a tensor.

Masks are binary (bool, or float 0/1) and have the same shape as the data. Values at masked-out
positions never leak into a result, even when they are NaN or inf (padding log-probs often are).
"""

from __future__ import annotations

import torch


def check_same_shape(**tensors: torch.Tensor) -> None:
    """ValueError naming the tensors when their shapes differ (e.g. logprobs vs response_mask)."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        listed = ", ".join(f"{name}{list(shape)}" for name, shape in shapes.items())
        raise ValueError(f"shapes must match: {listed}")


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of x over entries where mask is set; over `dim`, or over everything when dim is None."""
    check_same_shape(x=x, mask=mask)
    selected = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return selected.sum() if dim is None else selected.sum(dim)


def masked_count(mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Number of set entries of mask (as a float tensor), over `dim` or over everything."""
    valid = mask.bool().to(torch.get_default_dtype())
    return valid.sum() if dim is None else valid.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of x over entries where mask is set. An empty selection gives 0, not NaN, so an
    all-padding micro-batch contributes nothing instead of poisoning the step."""
    total = masked_sum(x, mask, dim)
    count = masked_count(mask, dim).to(total.dtype)
    return total / count.clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of x over all entries where mask is set (Bessel-corrected when unbiased)."""
    count = masked_count(mask)
    if unbiased and count < 2:
        raise ValueError(
            f"unbiased masked_var needs at least 2 valid entries, got {int(count)}; "
            "pass unbiased=False or a larger batch"
        )
    mean = masked_mean(x, mask)
    sum_sq = masked_sum((x - mean) ** 2, mask)
    return sum_sq / (count - 1 if unbiased else count.clamp(min=1)).to(sum_sq.dtype)


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the valid entries (mean added back if not shift_mean).

    Padding positions of the result are 0.
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=True)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, torch.zeros((), dtype=x.dtype, device=x.device))


def last_valid_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last set entry of each row of a [B, T] mask; -1 for a row with none."""
    num_positions = mask.shape[-1]
    reversed_first = mask.bool().flip(-1).int().argmax(-1)  # first set entry counted from the end
    index = num_positions - 1 - reversed_first
    return torch.where(mask.bool().any(-1), index, torch.full_like(index, -1))
