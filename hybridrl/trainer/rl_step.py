"""One RL step, top to bottom: sample -> score -> reference / values -> advantages -> update.

Each phase is a call with a telling name, timed into the step record.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from hybridrl.algos import AdvantageConfig, apply_kl_penalty, get_advantage_estimator, masked_mean, scores_to_token_rewards
from hybridrl.models.loading import to_device
from hybridrl.train.batch import SequenceBatch, build_sequence_batch, pad_per_token
from hybridrl.train.oom import generate_in_parts
from hybridrl.metrics.flops import forward_flops, mfu
from hybridrl.train.packing import Work
from hybridrl.train.policy import batched_logprobs, logprob_diff_metrics
from hybridrl.train.reference import weights_on_device
from hybridrl.train.value import batched_values

if TYPE_CHECKING:
    from hybridrl.data import PromptExample
    from hybridrl.trainer.engine import TrainerEngine

log = logging.getLogger("hybridrl.trainer")
_DETOKENIZER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hybridrl-detokenize")


def rl_step(t: "TrainerEngine", prompts: list["PromptExample"]) -> dict[str, Any]:
    cfg, timer = t.config, t.timer
    with timer.phase("rollout"):  # with reward.num_workers > 0, finished responses are scored meanwhile
        samples, scorer = generate_responses(t, prompts)
    if t.ref_offload is not None:
        t.ref_offload.prefetch()  # the reference's weights travel while the batch is built
    with timer.phase("batch"):  # host-side layout of the responses, and its copy to the device
        batch = make_batch(t, samples).to(t.device)
    # The batch needs token ids only: the texts are decoded in a thread while the reference pass
    # runs on the device, and scored after it (nothing before the advantages needs the scores).
    # Started after the batch is built: run alongside, it took the GIL from the layout (W0.5B on
    # 2 CPU cores: 10-28 ms instead of 5-7 ms).
    texts = _DETOKENIZER.submit(t.rollout.detokenize, samples) if scorer is None else None
    with timer.phase("ref"):
        ref_work = compute_reference_logprobs(t, batch)
    with timer.phase("reward_exposed"):  # scoring not hidden behind generation or the reference pass
        if texts is not None:
            texts.result()
        scores, reward_metrics = score_responses(t, prompts, samples, scorer)
        batch["scores"] = to_device(scores, batch.input_ids.device)
    with timer.phase("old_logprobs"):
        diff_metrics = compute_old_logprobs(t, batch)
    with timer.phase("values"):
        compute_values(t, batch)
    with timer.phase("advantage"):
        adv_metrics = compute_advantages(t, batch)
    with timer.phase("train"):
        train_metrics, skipped = update_models(t, batch)
    # The rollout engine reads the actor's parameters in place: the next generate sees the update.
    with timer.phase("metrics"):
        return {
            **reward_metrics,
            **diff_metrics,
            **adv_metrics,
            **train_metrics,
            **rollout_metrics(batch, samples, scores),
            **rollout_engine_metrics(t.rollout.pop_stats()),
            **mfu_metrics(t, ref_work),
            "train/skipped_updates": skipped,
            "_num_response_tokens": batch.num_response_tokens,
            "_num_tokens": int(batch.host_view()[1].sum()),
        }


def generate_responses(t: "TrainerEngine", prompts: list["PromptExample"]):
    """The responses, and the StreamingScorer already scoring them (None when reward.num_workers is 0)."""
    r = t.config.rollout
    step_seed = t.step_seed()
    stream: dict[str, Any] = {"scorer": None, "offset": 0}

    def generate(part: list["PromptExample"], seed: int):
        on_finished = None
        if t.config.reward.num_workers > 0:
            if seed == step_seed:  # part 0 of an attempt (generate_in_parts): an OOM retry starts over
                stream.update(scorer=t.reward.stream(sample_columns(prompts, r.n), t.config.reward.num_workers), offset=0)
            scorer, offset = stream["scorer"], stream["offset"]
            stream["offset"] += len(part)  # parts are consecutive slices of the prompts

            def on_finished(s):  # scores are kept by sample index, so completion order never matters
                scorer.submit((offset + s.prompt_index) * r.n + s.sample_index, s.prompt, s.response, s.response_ids)

        return t.rollout.generate(
            [p.prompt_ids for p in part], n=r.n, max_tokens=r.max_tokens, temperature=r.temperature,
            top_p=r.top_p, top_k=r.top_k, seed=seed, on_finished=on_finished,
            detokenize=on_finished is not None,  # else rl_step decodes the texts during the reference pass
        )

    # Out of memory, the prompts are generated in twice as many parts; one part is one call.
    samples, t.rollout_parts = generate_in_parts(generate, prompts, step_seed, t.rollout_parts)
    t.rollout.sleep()  # release the KV cache before training needs the memory
    return samples, stream["scorer"]


def sample_columns(prompts: list["PromptExample"], n: int) -> dict[str, list]:
    """Each data column, one value per sample (samples are ordered prompt by prompt, n each)."""
    keys = sorted({k for p in prompts for k in p.columns})
    return {key: [p.columns.get(key) for p in prompts for _ in range(n)] for key in keys}


def score_responses(t: "TrainerEngine", prompts: list["PromptExample"], samples, scorer=None) -> tuple[torch.Tensor, dict[str, float]]:
    if scorer is not None:
        result = scorer.finish(len(samples))
    else:
        result = t.reward.score(
            [s.prompt for s in samples], [s.response for s in samples], sample_columns(prompts, t.config.rollout.n),
            response_ids=[s.response_ids for s in samples],
        )
        result.metrics["reward/overlap_ratio"] = 0.0
    if result.timed_out:
        log.warning("step %d: %d response(s) timed out in the reward (reward.timeout_s) and got the timeout score: "
                    "samples %s", t.step + 1, len(result.timed_out), result.timed_out[:20])
    scores = torch.tensor(result.scores, dtype=torch.float32)
    return scores, dict(result.metrics)


def make_batch(t: "TrainerEngine", samples) -> SequenceBatch:
    """The responses as a `SequenceBatch` (token ids, rollout log-probs, groups); scores come later."""
    # The native engine's samples carry their tokens and log-probs as numpy arrays too: laid out from
    # those, the batch costs ~1 ms of host time instead of ~10 reading 2 x 131k Python numbers (W0.5B).
    arrays = all(s.arrays is not None for s in samples)
    responses = [s.arrays[0] if arrays else s.response_ids for s in samples]
    batch = build_sequence_batch([s.prompt_ids for s in samples], responses, t.tokenizer.pad_token_id)
    T = batch.response_mask.shape[1]
    batch["rollout_logprobs"] = pad_per_token([s.arrays[1] if arrays else s.response_logprobs for s in samples], T)
    batch["group_ids"] = torch.tensor([s.prompt_index for s in samples], dtype=torch.long)
    batch.packed = t.packed  # forward passes lay the responses of a prompt after one copy of it
    return batch


def no_grad_budget(tc) -> int | None:
    """Token budget of a forward pass without gradients (`train.max_tokens_per_forward`)."""
    return tc.max_tokens_per_forward or tc.max_tokens_per_micro_batch


def compute_reference_logprobs(t: "TrainerEngine", batch: SequenceBatch) -> Work:
    if t.ref_model is None:
        return Work()
    tc = t.config.train
    with weights_on_device(t.ref_offload):  # train.offload_reference: on the GPU for this pass only
        batch["ref_logprobs"], work = batched_logprobs(
            t.ref_model, batch, micro_batch_size=tc.micro_batch_size, temperature=t.config.rollout.temperature,
            max_tokens=no_grad_budget(tc),
        )  # fmt: skip
    return work


def compute_old_logprobs(t: "TrainerEngine", batch: SequenceBatch) -> dict[str, float]:
    """Log-probs of the policy that sampled the batch, as the trainer computes them.

    When the update is exactly on-policy (one epoch, one mini-batch) they equal the log-probs of
    the first (only) update pass, so that pass supplies them and this one is skipped.
    """
    if t.on_policy:
        return {}
    tc = t.config.train
    batch["old_logprobs"], _ = batched_logprobs(
        t.model, batch, micro_batch_size=tc.micro_batch_size, temperature=t.config.rollout.temperature,
        max_tokens=no_grad_budget(tc),
    )  # fmt: skip
    return logprob_diff_metrics(batch["old_logprobs"], batch["rollout_logprobs"], batch.response_mask)


def compute_values(t: "TrainerEngine", batch: SequenceBatch) -> None:
    if t.critic is not None:
        tc = t.config.train
        batch["values"] = batched_values(t.critic, batch, micro_batch_size=tc.micro_batch_size, max_tokens=no_grad_budget(tc))


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


def rollout_metrics(batch: SequenceBatch, samples, scores: torch.Tensor) -> dict[str, float]:
    """Rewards and response lengths, read from what the host already holds (the scores on the CPU, the
    batch's host view, the samples' groups): no device sync. (Reading them from the device, one
    reduction and one sync per prompt group, took ~5 ms a step at W0.5B.)"""
    lengths = batch.host_view()[2].sum(1)
    scores = scores.double()
    # Groups where every response got the same reward carry no GRPO/RLOO signal. (Compared as max ==
    # min: the fp32 standard deviation of equal rewards can come out a rounding error above zero, e.g.
    # 6e-08 for three rewards of 0.9.)
    _, group = torch.unique(torch.tensor([s.prompt_index for s in samples]), return_inverse=True)
    num_groups = int(group.max()) + 1 if len(samples) else 0
    hi = scores.new_full((num_groups,), float("-inf")).scatter_reduce(0, group, scores, "amax")
    lo = scores.new_full((num_groups,), float("inf")).scatter_reduce(0, group, scores, "amin")
    return {
        "reward/mean": float(scores.mean()),
        "reward/std": float(scores.std(unbiased=False)),
        "reward/frac_zero_std_groups": float((hi == lo).double().mean()) if num_groups else 0.0,
        "rollout/response_length/mean": float(lengths.float().mean()),
        "rollout/response_length/max": float(lengths.max()),
        "rollout/response_length/min": float(lengths.min()),
        "rollout/clipped_ratio": sum(s.finish_reason == "length" for s in samples) / len(samples),
    }


def rollout_engine_metrics(stats: dict[str, float]) -> dict[str, float]:
    """The rollout engine's split of `timing/rollout`: `timing/rollout/<part>` seconds, and counts
    (`rollout/host_syncs`, `rollout/graphs_reused`)."""
    return {(f"timing/rollout/{k[:-2]}" if k.endswith("_s") else f"rollout/{k}"): v for k, v in stats.items()}


def mfu_metrics(t: "TrainerEngine", ref_work: Work) -> dict[str, float | None]:
    """Model FLOPs utilisation of the update (actor, and critic for PPO) and of the reference pass
    (metrics/flops.py); None on devices without a known peak or for a pass that did not run."""
    times = t.timer.times
    train_flops = 3 * forward_flops(t.model, t.policy_trainer.work)
    if t.critic_trainer is not None:
        train_flops += 3 * forward_flops(t.critic, t.critic_trainer.work)
    ref_flops = forward_flops(t.ref_model, ref_work) if t.ref_model is not None else 0.0
    return {
        "perf/mfu/actor": mfu(train_flops, times.get("timing/train", 0.0), t.device),
        "perf/mfu/ref": mfu(ref_flops, times.get("timing/ref", 0.0), t.device) if ref_flops else None,
        "perf/train_tflops": train_flops / 1e12,
    }
