"""PPO-style passes over one rollout batch: epochs of shuffled mini-batches, one optimizer step each.

Shared by the actor and the critic; each supplies only its loss.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from hybridrl.config import TrainConfig
from hybridrl.train.batch import SequenceBatch
from hybridrl.train.optim import step_schedule
from hybridrl.train.packing import Work, micro_batch_work, micro_batches
from hybridrl.train.update import StepResult, mean_metrics, optimizer_step

# loss_fn(micro, num_tokens=, num_seqs=, max_len=) -> (loss normalised by the whole mini-batch, metrics)
MiniBatchLoss = Callable[..., tuple[torch.Tensor, dict[str, Any]]]


def update_epochs(
    model: torch.nn.Module, optimizer, scheduler, batch: SequenceBatch, train: TrainConfig, loss_fn: MiniBatchLoss,
    *, shuffle_seed: int, prefix: str,
) -> tuple[dict[str, float], int, Work]:
    """Runs `train.ppo_epochs` epochs; returns (metrics, skipped non-finite updates, work done).

    Mini-batch order is drawn from a generator seeded with `shuffle_seed`, so resume is exact.
    """
    mini = train.mini_batch_size or batch.size
    gen = torch.Generator().manual_seed(shuffle_seed)
    results: list[StepResult] = []
    work = Work()
    model.train()
    for _ in range(train.ppo_epochs):
        order = torch.randperm(batch.size, generator=gen).tolist() if mini < batch.size else list(range(batch.size))
        for start in range(0, batch.size, mini):
            mini_batch = batch.select(order[start : start + mini])
            norm = dict(num_tokens=float(mini_batch.host_view()[2].sum()), num_seqs=float(mini_batch.size),
                        max_len=batch.response_mask.shape[1])  # fmt: skip
            micros = [m for _, m in micro_batches(mini_batch, micro_batch_size=train.micro_batch_size,
                                                  max_tokens=train.max_tokens_per_micro_batch)]  # fmt: skip
            for micro in micros:
                work += micro_batch_work(micro)
            results.append(optimizer_step(model, optimizer, micros, lambda m: loss_fn(m, **norm), grad_clip=train.grad_clip))
    model.eval()
    metrics = mean_metrics([r.metrics for r in results])
    applied = [r.grad_norm for r in results if not r.skipped]
    metrics[f"{prefix}/grad_norm"] = sum(applied) / len(applied) if applied else float("nan")
    metrics[f"{prefix}/lr"] = optimizer.param_groups[0]["lr"]
    # Part of the `timing/train` phase, on the host's clock (StepResult.issue_s). Close to that phase's
    # time on a GPU it does not by itself say the host limits it: a full launch queue holds the host back too.
    metrics[f"timing/train/{prefix}_host_issue"] = sum(r.issue_s for r in results)
    step_schedule(scheduler)
    return metrics, sum(r.skipped for r in results), work
