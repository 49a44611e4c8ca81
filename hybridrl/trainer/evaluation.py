"""Held-out evaluation: generate (greedy by default) and score with the run's reward."""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hybridrl.trainer.engine import TrainerEngine


def evaluate(t: "TrainerEngine", eval_data) -> dict[str, float]:
    """`reward/mean` over the first `trainer.eval_samples` prompts, and `accuracy`: the
    fraction whose score is at least 1 (the correct-answer score of the built-in scorers)."""
    cfg = t.config
    prompts = [eval_data[i] for i in range(min(len(eval_data), cfg.trainer.eval_samples))]
    samples = t.rollout.generate(
        [p.prompt_ids for p in prompts], n=1, max_tokens=cfg.rollout.max_tokens,
        temperature=cfg.rollout.eval_temperature, seed=cfg.train.seed,
    )
    t.rollout.sleep()
    t.rollout.pop_stats()  # evaluation's generation is not the next training step's
    columns = {k: [p.columns.get(k) for p in prompts] for k in sorted({k for p in prompts for k in p.columns})}
    result = t.reward.score([s.prompt for s in samples], [s.response for s in samples], columns,
                            response_ids=[s.response_ids for s in samples])
    scores = result.scores
    return {
        "reward/mean": sum(scores) / len(scores),
        "accuracy": sum(1.0 for s in scores if s >= 1.0) / len(scores),
        "response_length/mean": sum(len(s.response_ids) for s in samples) / len(samples),
    }


@torch.no_grad()
def evaluate_offline(t: "TrainerEngine", examples: list) -> dict[str, float]:
    """The offline algorithm's own metrics (e.g. DPO reward accuracy) over held-out examples,
    without updating anything; keys lose their algorithm prefix ("dpo/reward_accuracy" ->
    "reward_accuracy") and loss shares are summed into the held-out loss."""
    algo = t.offline_algorithm
    examples = examples[: t.config.trainer.eval_samples]
    norm = algo.normaliser(examples)
    sums: dict[str, float] = defaultdict(float)
    weights: dict[str, float] = defaultdict(float)
    for micro in algo.micro_batches(examples, t.config.train.micro_batch_size):
        _, metrics = algo.loss(t.model, t.ref_model, micro, norm, t.device)
        for key, value in metrics.items():
            name = key.split("/", 1)[1]
            if key.endswith("loss"):
                sums[name] += value
                weights[name] = 1.0
            else:
                sums[name] += value * len(micro)
                weights[name] += len(micro)
    return {k: sums[k] / weights[k] for k in sums}
