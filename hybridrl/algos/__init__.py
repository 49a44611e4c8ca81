"""hybridrl.algos: the pure tensor math of RL and preference post-training.

Advantage estimators, policy / value / KL / entropy terms, DPO / KTO / Bradley-Terry / SFT losses
and loss aggregation. Tensors and masks in, tensors and a metrics dict out: no models, no I/O, no
distributed code. Variants are picked by name from the registries below.
"""

from hybridrl.algos.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageConfig,
    compute_gae,
    discounted_returns,
    get_advantage_estimator,
    group_stats,
    register_advantage_estimator,
)
from hybridrl.algos.aggregation import LOSS_AGGREGATIONS, aggregate_loss
from hybridrl.algos.entropy import entropy_from_logits, logprobs_from_logits
from hybridrl.algos.kl import KL_ESTIMATORS, kl_loss, kl_penalty
from hybridrl.algos.masking import (
    last_valid_index,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)
from hybridrl.algos.policy_loss import POLICY_LOSSES, get_policy_loss, ppo_policy_loss
from hybridrl.algos.preference import DPO_LOSSES, bradley_terry_loss, dpo_loss, kto_loss
from hybridrl.algos.registry import Registry
from hybridrl.algos.rewards import apply_kl_penalty, scores_to_token_rewards
from hybridrl.algos.sft import sft_loss
from hybridrl.algos.value_loss import clipped_value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdvantageConfig",
    "DPO_LOSSES",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "POLICY_LOSSES",
    "Registry",
    "aggregate_loss",
    "apply_kl_penalty",
    "bradley_terry_loss",
    "clipped_value_loss",
    "compute_gae",
    "discounted_returns",
    "dpo_loss",
    "entropy_from_logits",
    "get_advantage_estimator",
    "get_policy_loss",
    "group_stats",
    "kl_loss",
    "kl_penalty",
    "kto_loss",
    "last_valid_index",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "ppo_policy_loss",
    "register_advantage_estimator",
    "scores_to_token_rewards",
    "sft_loss",
]
