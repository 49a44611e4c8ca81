"""Held-out evaluation: generate (greedy by default) and score with the run's reward."""

from __future__ import annotations

from typing import TYPE_CHECKING

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
    columns = {k: [p.columns.get(k) for p in prompts] for k in sorted({k for p in prompts for k in p.columns})}
    result = t.reward.score([s.prompt for s in samples], [s.response for s in samples], columns,
                            response_ids=[s.response_ids for s in samples])
    scores = result.scores
    return {
        "reward/mean": sum(scores) / len(scores),
        "accuracy": sum(1.0 for s in scores if s >= 1.0) / len(scores),
        "response_length/mean": sum(len(s.response_ids) for s in samples) / len(samples),
    }
