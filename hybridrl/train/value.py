"""The critic: value passes and the clipped value-function update (PPO)."""

from __future__ import annotations

import torch

from hybridrl.algos import clipped_value_loss, masked_mean
from hybridrl.config import AlgorithmConfig, TrainConfig
from hybridrl.train.batch import SequenceBatch, rows_on
from hybridrl.train.logprobs import response_values
from hybridrl.train.packing import Work, micro_batches
from hybridrl.train.epochs import update_epochs


@torch.no_grad()
def batched_values(critic: torch.nn.Module, batch: SequenceBatch, *, micro_batch_size: int, max_tokens: int | None = None) -> torch.Tensor:
    T = batch.response_mask.shape[1]
    out = torch.zeros(batch.size, T, dtype=torch.float32, device=batch.input_ids.device)
    for idx, micro in micro_batches(batch, micro_batch_size=micro_batch_size, max_tokens=max_tokens):
        v = response_values(critic, micro)
        out[rows_on(idx, out.device), : v.shape[1]] = v
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
        """PPO epochs over mini-batches; returns (metrics, number of skipped non-finite updates)."""
        metrics, skipped, self.work = update_epochs(
            self.model, self.optimizer, self.scheduler, batch, self.train_cfg, self._loss, shuffle_seed=shuffle_seed, prefix="critic"
        )
        return metrics, skipped

    def _loss(self, micro: SequenceBatch, *, num_tokens: float, num_seqs: float, max_len: int):
        values = response_values(self.model, micro)
        loss, m = clipped_value_loss(
            values, micro["values"], micro["returns"], micro.response_mask,
            clip=self.algo.value_clip, loss_agg="token-mean", num_tokens=num_tokens, num_seqs=num_seqs,
        )
        metrics = {
            "critic/vf_loss": loss.detach(),
            "critic/vf_clipfrac": m["vf_clipfrac"],
            "critic/values/mean": masked_mean(values.detach(), micro.response_mask),
        }
        return self.algo.vf_coef * loss, metrics
