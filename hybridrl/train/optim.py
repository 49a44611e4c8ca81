"""AdamW and learning-rate schedules (linear warmup, then constant or cosine)."""

from __future__ import annotations

import math

import torch


def build_optimizer(model: torch.nn.Module, *, lr: float, weight_decay: float, betas, eps: float) -> torch.optim.AdamW:
    """AdamW with no weight decay on biases and norms; fused on GPU where torch offers it."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.dim() < 2 else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    on_gpu = next(model.parameters()).device.type == "cuda"
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps, fused=on_gpu or None)


def lr_lambda(step: int, *, warmup_steps: int, total_steps: int, schedule: str, min_lr_ratio: float) -> float:
    """Multiplier of the base lr after `step` optimizer steps."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    raise ValueError(f"unknown lr schedule {schedule!r}; use constant or cosine")


def build_scheduler(optimizer, *, warmup_steps: int, total_steps: int, schedule: str, min_lr_ratio: float = 0.0):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_lambda(step, warmup_steps=warmup_steps, total_steps=total_steps, schedule=schedule, min_lr_ratio=min_lr_ratio),
    )


def grads_are_finite(model: torch.nn.Module) -> bool:
    for p in model.parameters():
        if p.grad is not None and not torch.isfinite(p.grad).all():
            return False
    return True
