"""The critic: value passes and the clipped value-function update (PPO)."""

from __future__ import annotations

import torch

from hybridrl.algos import clipped_value_loss, masked_mean
from hybridrl.config import AlgorithmConfig, TrainConfig
from hybridrl.train.batch import SequenceBatch
from hybridrl.train.logprobs import response_values
from hybridrl.train.packing import Work, micro_batch_work, micro_batches
from hybridrl.train.update import StepResult, mean_metrics, optimizer_step


@torch.no_grad()
def batched_values(critic: torch.nn.Module, batch: SequenceBatch, *, micro_batch_size: int, max_tokens: int | None = None) -> torch.Tensor:
    T = batch.response_mask.shape[1]
    out = torch.zeros(batch.size, T, dtype=torch.float32, device=batch.input_ids.device)
    for idx, micro in micro_batches(batch, micro_batch_size=micro_batch_size, max_tokens=max_tokens):
        v = response_values(critic, micro)
        out[idx, : v.shape[1]] = v
    return out


class ValueTrainer:
    """Fits the critic to the returns of the batch with a clipped value loss."""

    def __init__(self, model, optimizer, scheduler, train: TrainConfig, algo: AlgorithmConfig):
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.train_cfg = train
        self.algo = algo
        self.work = Work()  # computed by the last update, for MFU

    def update(self, batch: SequenceBatch, *, shuffle_seed: int) -> tuple[dict[str, float], int]:
        mini = self.train_cfg.mini_batch_size or batch.size
        gen = torch.Generator().manual_seed(shuffle_seed)
        results: list[StepResult] = []
        self.work = Work()
        self.model.train()
        for _ in range(self.train_cfg.ppo_epochs):
            order = torch.randperm(batch.size, generator=gen).tolist() if mini < batch.size else list(range(batch.size))
            for start in range(0, batch.size, mini):
                mini_batch = batch.select(order[start : start + mini])
                num_tokens = float(mini_batch.response_mask.sum())
                micros = [m for _, m in micro_batches(mini_batch, micro_batch_size=self.train_cfg.micro_batch_size,
                                                      max_tokens=self.train_cfg.max_tokens_per_micro_batch)]  # fmt: skip
                for micro in micros:
                    self.work += micro_batch_work(micro)
                results.append(
                    optimizer_step(
                        self.model, self.optimizer, micros,
                        lambda m: self._loss(m, num_tokens=num_tokens, num_seqs=float(mini_batch.size)),
                        grad_clip=self.train_cfg.grad_clip,
                    )
                )
        self.model.eval()
        metrics = mean_metrics([r.metrics for r in results])
        applied = [r.grad_norm for r in results if not r.skipped]
        metrics["critic/grad_norm"] = sum(applied) / len(applied) if applied else float("nan")
        metrics["critic/lr"] = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step()
        return metrics, sum(r.skipped for r in results)

    def _loss(self, micro: SequenceBatch, *, num_tokens: float, num_seqs: float):
        values = response_values(self.model, micro)
        loss, m = clipped_value_loss(
            values, micro["values"], micro["returns"], micro.response_mask,
            clip=self.algo.value_clip, loss_agg="token-mean", num_tokens=num_tokens, num_seqs=num_seqs,
        )
        metrics = {
            "critic/vf_loss": float(loss.detach()),
            "critic/vf_clipfrac": float(m["vf_clipfrac"]),
            "critic/values/mean": float(masked_mean(values.detach(), micro.response_mask)),
        }
        return self.algo.vf_coef * loss, metrics
