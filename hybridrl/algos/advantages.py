"""Advantage estimators, chosen by name: gae, grpo, rloo, reinforce_pp, reinforce_pp_baseline.

All share one signature:

    fn(token_rewards [B, T], response_mask [B, T], *, group_ids [B] | None, values [B, T] | None,
       config: AdvantageConfig) -> (advantages [B, T], returns [B, T])

`token_rewards` holds each sequence's score at its last response token plus any per-token terms
(e.g. -beta * KL when the KL penalty is in the reward). Outcome estimators (grpo, rloo) use the
per-sequence score `masked_sum(token_rewards, response_mask, -1)`. `group_ids` marks the n samples
of one prompt with the same id. Results are 0 at padding positions and carry no gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from hybridrl.algos.masking import check_same_shape, last_valid_index, masked_sum, masked_whiten
from hybridrl.algos.registry import Registry


@dataclass(frozen=True)
class AdvantageConfig:
    """Knobs shared by the advantage estimators (each uses the ones it needs)."""

    gamma: float = 1.0  # discount per token (gae, reinforce_pp, reinforce_pp_baseline)
    lam: float = 1.0  # GAE lambda: bias/variance trade-off (gae)
    norm_by_std: bool = True  # grpo: divide by the group std; False gives Dr. GRPO
    eps: float = 1e-6  # grpo: added to the group std before dividing
    whiten: bool = True  # gae, reinforce_pp*: whiten advantages over the batch's valid tokens

    def __post_init__(self) -> None:
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"AdvantageConfig.gamma must be in [0, 1], got {self.gamma}")
        if not 0.0 <= self.lam <= 1.0:
            raise ValueError(f"AdvantageConfig.lam must be in [0, 1], got {self.lam}")
        if self.eps <= 0.0:
            raise ValueError(f"AdvantageConfig.eps must be > 0, got {self.eps}")


class AdvantageEstimator(Protocol):
    def __call__(
        self,
        token_rewards: torch.Tensor,
        response_mask: torch.Tensor,
        *,
        group_ids: torch.Tensor | None = None,
        values: torch.Tensor | None = None,
        config: AdvantageConfig = ...,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")


def register_advantage_estimator(name: str):
    """Decorator adding an estimator (with the shared signature above) under `name`."""
    return ADVANTAGE_ESTIMATORS.register(name)


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered as `name`; ValueError listing the valid names otherwise."""
    return ADVANTAGE_ESTIMATORS.get(name)


# ---------------------------------------------------------------------------------------------
# Building blocks (raw, unwhitened), public so they can be tested and reused on their own.


@torch.no_grad()
def compute_gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2016, Eq. 16), raw (not whitened).

    delta_t = r_t + gamma * V_{t+1} - V_t;  A_t = delta_t + gamma * lam * A_{t+1}.
    Runs over valid tokens only: masked positions inside a response (e.g. tool output) are
    skipped, and the value after the last valid token is 0. Returns (advantages, returns =
    advantages + values), both 0 at padding.
    """
    check_same_shape(token_rewards=token_rewards, values=values, response_mask=response_mask)
    valid = response_mask.bool()
    batch_size, num_positions = token_rewards.shape
    next_value = token_rewards.new_zeros(batch_size)
    next_advantage = token_rewards.new_zeros(batch_size)
    advantages = torch.zeros_like(token_rewards)
    for t in reversed(range(num_positions)):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        advantages[:, t] = torch.where(valid[:, t], advantage, 0.0)
        next_advantage = torch.where(valid[:, t], advantage, next_advantage)
        next_value = torch.where(valid[:, t], values[:, t], next_value)
    returns = torch.where(valid, advantages + values, 0.0)
    return advantages, returns


@torch.no_grad()
def discounted_returns(
    token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0
) -> torch.Tensor:
    """Return-to-go G_t = r_t + gamma * G_{t+1} over valid tokens (0 at padding)."""
    check_same_shape(token_rewards=token_rewards, response_mask=response_mask)
    valid = response_mask.bool()
    running = token_rewards.new_zeros(token_rewards.shape[0])
    returns = torch.zeros_like(token_rewards)
    for t in reversed(range(token_rewards.shape[1])):
        step_return = token_rewards[:, t] + gamma * running
        returns[:, t] = torch.where(valid[:, t], step_return, 0.0)
        running = torch.where(valid[:, t], step_return, running)
    return returns


@torch.no_grad()
def group_stats(
    scores: torch.Tensor, group_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample (group mean, group std (unbiased), group size) of `scores` [B] over its group.

    The std of a group of size 1 is reported as 0.
    """
    _, group_index = torch.unique(group_ids, return_inverse=True)  # [B] in 0 .. G-1
    num_groups = int(group_index.max()) + 1
    sizes = scores.new_zeros(num_groups).index_add_(0, group_index, torch.ones_like(scores))
    means = scores.new_zeros(num_groups).index_add_(0, group_index, scores) / sizes
    deviations = (scores - means[group_index]) ** 2
    sum_sq = scores.new_zeros(num_groups).index_add_(0, group_index, deviations)
    stds = (sum_sq / (sizes - 1).clamp(min=1)).sqrt()
    return means[group_index], stds[group_index], sizes[group_index]


def _sequence_scores(token_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    return masked_sum(token_rewards, response_mask, dim=-1)  # [B]


def _broadcast(per_sequence: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    return torch.where(response_mask.bool(), per_sequence[:, None], 0.0)  # [B, T]


def _require_group_ids(name: str, group_ids: torch.Tensor | None, batch_size: int) -> torch.Tensor:
    if group_ids is None:
        raise ValueError(f"advantage estimator {name!r} needs group_ids [B] (one id per prompt)")
    if tuple(group_ids.shape) != (batch_size,):
        raise ValueError(
            f"group_ids must have shape [{batch_size}] (one id per sequence), "
            f"got {list(group_ids.shape)}"
        )
    return group_ids


# ---------------------------------------------------------------------------------------------
# Registered estimators.


@register_advantage_estimator("gae")
@torch.no_grad()
def gae_advantages(
    token_rewards: torch.Tensor,  # [B, T]
    response_mask: torch.Tensor,  # [B, T]
    *,
    group_ids: torch.Tensor | None = None,  # [B]
    values: torch.Tensor | None = None,  # [B, T]
    config: AdvantageConfig = AdvantageConfig(),
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's GAE (Schulman et al. 2016), whitened over the batch when config.whiten."""
    if values is None:
        raise ValueError("advantage estimator 'gae' needs values [B, T] from a critic; "
                         "use 'grpo', 'rloo' or 'reinforce_pp' for critic-free training")
    advantages, returns = compute_gae(token_rewards, values, response_mask, config.gamma,
                                      config.lam)
    if config.whiten:
        advantages = masked_whiten(advantages, response_mask)
    return advantages, returns


@register_advantage_estimator("grpo")
@torch.no_grad()
def grpo_advantages(
    token_rewards: torch.Tensor,  # [B, T]
    response_mask: torch.Tensor,  # [B, T]
    *,
    group_ids: torch.Tensor | None = None,  # [B]
    values: torch.Tensor | None = None,  # [B, T]
    config: AdvantageConfig = AdvantageConfig(),
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage (Shao et al. 2024, Sec. 4.1.2): (score - group mean) / group std.

    With config.norm_by_std False it is Dr. GRPO (Liu et al. 2025): score - group mean.
    Groups of size 1 get advantage 0. returns = advantages.
    """
    group_ids = _require_group_ids("grpo", group_ids, token_rewards.shape[0])
    scores = _sequence_scores(token_rewards, response_mask)
    means, stds, sizes = group_stats(scores, group_ids)
    advantages = scores - means
    if config.norm_by_std:
        advantages = advantages / (stds + config.eps)
    advantages = torch.where(sizes > 1, advantages, 0.0)
    advantages = _broadcast(advantages, response_mask)
    return advantages, advantages.clone()


@register_advantage_estimator("rloo")
@torch.no_grad()
def rloo_advantages(
    token_rewards: torch.Tensor,  # [B, T]
    response_mask: torch.Tensor,  # [B, T]
    *,
    group_ids: torch.Tensor | None = None,  # [B]
    values: torch.Tensor | None = None,  # [B, T]
    config: AdvantageConfig = AdvantageConfig(),
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (Ahmadian et al. 2024, Eq. 6): score_i - mean of the other samples of its group.

    Groups of size 1 get advantage 0. returns = advantages.
    """
    group_ids = _require_group_ids("rloo", group_ids, token_rewards.shape[0])
    scores = _sequence_scores(token_rewards, response_mask)
    means, _, sizes = group_stats(scores, group_ids)
    leave_one_out = (means * sizes - scores) / (sizes - 1).clamp(min=1)
    advantages = torch.where(sizes > 1, scores - leave_one_out, 0.0)
    advantages = _broadcast(advantages, response_mask)
    return advantages, advantages.clone()


@register_advantage_estimator("reinforce_pp")
@torch.no_grad()
def reinforce_pp_advantages(
    token_rewards: torch.Tensor,  # [B, T]
    response_mask: torch.Tensor,  # [B, T]
    *,
    group_ids: torch.Tensor | None = None,  # [B]
    values: torch.Tensor | None = None,  # [B, T]
    config: AdvantageConfig = AdvantageConfig(),
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025, Sec. 3): discounted return-to-go, whitened over the batch.

    returns = the raw return-to-go.
    """
    returns = discounted_returns(token_rewards, response_mask, config.gamma)
    advantages = masked_whiten(returns, response_mask) if config.whiten else returns.clone()
    return advantages, returns


@register_advantage_estimator("reinforce_pp_baseline")
@torch.no_grad()
def reinforce_pp_baseline_advantages(
    token_rewards: torch.Tensor,  # [B, T]
    response_mask: torch.Tensor,  # [B, T]
    *,
    group_ids: torch.Tensor | None = None,  # [B]
    values: torch.Tensor | None = None,  # [B, T]
    config: AdvantageConfig = AdvantageConfig(),
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline (Hu 2025): subtract the group-mean score at each sequence's last
    token, then discounted return-to-go and batch whitening. With gamma = 1 and only an outcome
    score this is whiten(score - group mean) broadcast over the response.
    """
    group_ids = _require_group_ids("reinforce_pp_baseline", group_ids, token_rewards.shape[0])
    scores = _sequence_scores(token_rewards, response_mask)
    means, _, _ = group_stats(scores, group_ids)
    last = last_valid_index(response_mask)
    has_tokens = last >= 0
    rows = torch.arange(token_rewards.shape[0], device=token_rewards.device)[has_tokens]
    centred = token_rewards.clone()
    centred[rows, last[has_tokens]] -= means[has_tokens]
    returns = discounted_returns(centred, response_mask, config.gamma)
    advantages = masked_whiten(returns, response_mask) if config.whiten else returns.clone()
    return advantages, returns
