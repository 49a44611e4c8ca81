"""One optimizer step over a mini-batch split into micro-batches (gradient accumulation).

Shared by every algorithm: the loss function decides what is computed, this decides how
gradients are accumulated, clipped, checked for NaN/inf and applied.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from hybridrl import failpoints
from hybridrl.train.oom import run_with_split_retry
from hybridrl.train.optim import grad_params

# loss_fn(micro_batch) -> (loss already normalised by the whole mini-batch, metrics)
LossFn = Callable[[Any], tuple[torch.Tensor, dict[str, Any]]]


@dataclass
class StepResult:
    grad_norm: float
    skipped: bool  # True when the gradients held NaN/inf and the update was not applied
    # Keys ending in "loss" are shares of the mini-batch loss and are summed over micro-batches;
    # keys ending in "/max" are maxima; every other metric (fractions, means) is averaged.
    metrics: dict[str, float] = field(default_factory=dict)
    # Host seconds spent issuing the micro-batches' forward and backward passes, before the step's
    # first wait on the device. On a GPU, well below the device's time for the same work
    # (`timing/train`) the host is ahead; near it, the host limits or waits on a full launch queue.
    issue_s: float = 0.0


class NonFiniteLossError(FloatingPointError):
    """Raised after too many consecutive updates had NaN/inf gradients."""


def optimizer_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: Iterable[Any],
    loss_fn: LossFn,
    *,
    grad_clip: float,
) -> StepResult:
    """Accumulates gradients over the micro-batches and applies one update unless they are not finite.

    A micro-batch that runs out of memory restarts the accumulation with every micro-batch split
    in half (see `oom.run_with_split_retry`)."""
    failpoints.reached("update")
    optimizer.zero_grad(set_to_none=True)
    sums, count, issue_s = run_with_split_retry(
        micro_batches, lambda micros: _accumulate(micros, loss_fn), on_retry=lambda: optimizer.zero_grad(set_to_none=True)
    )
    params = grad_params(model, optimizer)  # under mixed precision: the fp32 masters, which hold the gradients
    # One host sync for the NaN/inf check and the norm: a NaN/inf in any gradient makes the total norm
    # non-finite (so does a norm beyond fp32's range, after which no update should be applied either).
    if grad_clip > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    else:  # nothing to clip: the norm alone (clip_grad_norm_ would still scale every gradient by 1)
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    grad_norm = float(norm)
    finite = math.isfinite(grad_norm)
    if finite:
        optimizer.step()
    else:
        grad_norm = float("nan")
    optimizer.zero_grad(set_to_none=True)
    metrics = {k: (v if k.endswith(("loss", "/max")) else v / max(count, 1)) for k, v in sums.items()}
    return StepResult(grad_norm=grad_norm, skipped=not finite, metrics=metrics, issue_s=issue_s)


def _accumulate(micro_batches: list[Any], loss_fn: LossFn) -> tuple[dict[str, float], int, float]:
    """Backward over each micro-batch. Metrics may be floats or 0-dim tensors; tensors are summed on
    their device and read once at the end, so the GPU is not drained after every micro-batch.
    Returns (metric sums, micro-batches, host seconds until that read: StepResult.issue_s)."""
    sums: dict[str, Any] = {}
    start = time.perf_counter()
    for micro in micro_batches:
        loss, metrics = loss_fn(micro)
        loss.backward()
        for k, v in metrics.items():
            v = v.detach().float() if isinstance(v, torch.Tensor) else float(v)
            if k not in sums:
                sums[k] = v
            elif k.endswith("/max"):
                sums[k] = torch.maximum(torch.as_tensor(sums[k]), torch.as_tensor(v))
            else:
                sums[k] = sums[k] + v
    issue_s = time.perf_counter() - start
    keys = [k for k, v in sums.items() if isinstance(v, torch.Tensor)]
    if keys:  # one host sync for all of them
        values = torch.stack([sums[k].reshape(()).to(sums[keys[0]].device) for k in keys]).tolist()
        sums.update(zip(keys, values))
    return sums, len(micro_batches), issue_s


def mean_metrics(records: list[dict[str, float]]) -> dict[str, float]:
    """Mean of each key over the records that have it ("/max" keys: the maximum)."""
    sums: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for r in records:
        for k, v in r.items():
            sums[k] = max(sums.get(k, float("-inf")), v) if k.endswith("/max") else sums[k] + v
            counts[k] += 1
    return {k: (v if k.endswith("/max") else v / counts[k]) for k, v in sums.items()}
