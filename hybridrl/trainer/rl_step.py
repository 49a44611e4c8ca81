"""One RL step, top to bottom: sample -> score -> reference / values -> advantages -> update.

Each phase is a call with a telling name, timed into the step record.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from hybridrl.algos import AdvantageConfig, apply_kl_penalty, get_advantage_estimator, masked_mean, scores_to_token_rewards
from hybridrl.train.batch import SequenceBatch, build_sequence_batch, pad_per_token
from hybridrl.train.policy import batched_logprobs, logprob_diff_metrics
from hybridrl.train.value import batched_values

if TYPE_CHECKING:
    from hybridrl.data import PromptExample
    from hybridrl.trainer.engine import TrainerEngine


def rl_step(t: "TrainerEngine", prompts: list["PromptExample"]) -> dict[str, Any]:
    cfg, timer = t.config, t.timer
    with timer.phase("rollout"):
        samples = generate_responses(t, prompts)
    with timer.phase("reward"):
        scores, reward_metrics = score_responses(t, prompts, samples)
    batch = make_batch(t, samples, scores).to(t.device)
    with timer.phase("ref"):
        compute_reference_logprobs(t, batch)
    with timer.phase("old_logprobs"):
        diff_metrics = compute_old_logprobs(t, batch)
    with timer.phase("values"):
        compute_values(t, batch)
    with timer.phase("advantage"):
        adv_metrics = compute_advantages(t, batch)
    with timer.phase("train"):
        train_metrics, skipped = update_models(t, batch)
    # The rollout engine reads the actor's parameters in place: the next generate sees the update.
    return {
        **reward_metrics,
        **diff_metrics,
        **adv_metrics,
        **train_metrics,
        **rollout_metrics(batch, samples, cfg.rollout.max_tokens),
        "train/skipped_updates": skipped,
        "_num_response_tokens": batch.num_response_tokens,
        "_num_tokens": int(batch.attention_mask.sum()),
    }


def generate_responses(t: "TrainerEngine", prompts: list["PromptExample"]):
    r = t.config.rollout
    samples = t.rollout.generate(
        [p.prompt_ids for p in prompts], n=r.n, max_tokens=r.max_tokens, temperature=r.temperature,
        top_p=r.top_p, top_k=r.top_k, seed=t.step_seed(),
    )
    t.rollout.sleep()  # release the KV cache before training needs the memory
    return samples


def score_responses(t: "TrainerEngine", prompts: list["PromptExample"], samples) -> tuple[torch.Tensor, dict[str, float]]:
    columns: dict[str, list] = {}
    keys = sorted({k for p in prompts for k in p.columns})
    for key in keys:
        columns[key] = [prompts[s.prompt_index].columns.get(key) for s in samples]
    result = t.reward.score(
        [s.prompt for s in samples], [s.response for s in samples], columns, response_ids=[s.response_ids for s in samples]
    )
    scores = torch.tensor(result.scores, dtype=torch.float32)
    return scores, dict(result.metrics)


def make_batch(t: "TrainerEngine", samples, scores: torch.Tensor) -> SequenceBatch:
    batch = build_sequence_batch([s.prompt_ids for s in samples], [s.response_ids for s in samples], t.tokenizer.pad_token_id)
    T = batch.response_mask.shape[1]
    batch["rollout_logprobs"] = pad_per_token([s.response_logprobs for s in samples], T)
    batch["scores"] = scores
    batch["group_ids"] = torch.tensor([s.prompt_index for s in samples], dtype=torch.long)
    return batch


def compute_reference_logprobs(t: "TrainerEngine", batch: SequenceBatch) -> None:
    if t.ref_model is None:
        return
    batch["ref_logprobs"] = batched_logprobs(
        t.ref_model, batch, micro_batch_size=t.config.train.micro_batch_size, temperature=t.config.rollout.temperature
    )


def compute_old_logprobs(t: "TrainerEngine", batch: SequenceBatch) -> dict[str, float]:
    """Log-probs of the policy that sampled the batch, as the trainer computes them.

    When the update is exactly on-policy (one epoch, one mini-batch) they equal the log-probs of
    the first (only) update pass, so that pass supplies them and this one is skipped.
    """
    if t.on_policy:
        return {}
    batch["old_logprobs"] = batched_logprobs(
        t.model, batch, micro_batch_size=t.config.train.micro_batch_size, temperature=t.config.rollout.temperature
    )
    return logprob_diff_metrics(batch["old_logprobs"], batch["rollout_logprobs"], batch.response_mask)


def compute_values(t: "TrainerEngine", batch: SequenceBatch) -> None:
    if t.critic is not None:
        batch["values"] = batched_values(t.critic, batch, micro_batch_size=t.config.train.micro_batch_size)


def compute_advantages(t: "TrainerEngine", batch: SequenceBatch) -> dict[str, float]:
    algo = t.config.algorithm
    mask = batch.response_mask
    token_rewards = scores_to_token_rewards(batch["scores"].to(mask.device), mask)
    metrics: dict[str, float] = {}
    if "ref_logprobs" in batch and algo.kl_in_reward and algo.kl_coef > 0:
        behaviour = batch["old_logprobs"] if "old_logprobs" in batch else batch["rollout_logprobs"]
        token_rewards, kl_metrics = apply_kl_penalty(
            token_rewards, behaviour, batch["ref_logprobs"], mask, kl_coef=algo.kl_coef, estimator=algo.kl_estimator
        )
        metrics["reward/kl_penalty"] = float(kl_metrics["kl"]) * algo.kl_coef
    estimator = get_advantage_estimator(t.advantage_name)
    advantages, returns = estimator(
        token_rewards, mask, group_ids=batch["group_ids"].to(mask.device), values=batch.tensors.get("values"),
        config=AdvantageConfig(gamma=algo.gamma, lam=algo.lam, norm_by_std=algo.norm_by_std),
    )
    batch["advantages"] = advantages
    batch["returns"] = returns
    metrics["algo/advantages/mean"] = float(masked_mean(advantages, mask))
    metrics["algo/returns/mean"] = float(masked_mean(returns, mask))
    return metrics


def update_models(t: "TrainerEngine", batch: SequenceBatch) -> tuple[dict[str, float], int]:
    shuffle_seed = t.step_seed() + 1
    metrics, skipped = {}, 0
    if t.critic_trainer is not None:
        critic_metrics, critic_skipped = t.critic_trainer.update(batch, shuffle_seed=shuffle_seed)
        metrics.update(critic_metrics)
        skipped += critic_skipped
    actor_metrics, actor_skipped = t.policy_trainer.update(batch, shuffle_seed=shuffle_seed)
    metrics.update(actor_metrics)
    return metrics, skipped + actor_skipped


def rollout_metrics(batch: SequenceBatch, samples, max_tokens: int) -> dict[str, float]:
    lengths = batch.response_mask.sum(1)
    scores = batch["scores"]
    groups = batch["group_ids"]
    # Groups where every response got the same reward carry no GRPO/RLOO signal.
    flat = sum(1 for g in groups.unique() if scores[groups == g].std(unbiased=False) == 0) / max(1, len(groups.unique()))
    return {
        "reward/mean": float(scores.mean()),
        "reward/std": float(scores.std(unbiased=False)),
        "reward/frac_zero_std_groups": flat,
        "rollout/response_length/mean": float(lengths.float().mean()),
        "rollout/response_length/max": float(lengths.max()),
        "rollout/response_length/min": float(lengths.min()),
        "rollout/clipped_ratio": sum(s.finish_reason == "length" for s in samples) / len(samples),
    }
