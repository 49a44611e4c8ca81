"""RMSNorm with HF's rounding, shared by the native rollout engine and the trainer's fp32 residual
stream, so both round at the same points."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: normalise in fp32, cast back, then scale (Zhang & Sennrich 2019). An fp32
    residual stream (`rollout.fp32_residual`, `train.fp32_residual`) is normalised into the weight's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype if x.dtype != torch.float32 else weight.dtype)
