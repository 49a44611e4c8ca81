"""Offline preference losses over per-sequence summed log-probs [B]: DPO (+ IPO, robust), KTO,
and the Bradley-Terry reward-model loss."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from hybridrl.algos.masking import check_same_shape
from hybridrl.algos.registry import Registry

# (logits = policy log-ratio difference - reference log-ratio difference [B], beta,
#  label_smoothing) -> per-pair loss [B]
DPOLossFn = Callable[[torch.Tensor, float, float], torch.Tensor]

DPO_LOSSES: Registry[DPOLossFn] = Registry("DPO loss type")


@DPO_LOSSES.register("sigmoid")
def _dpo_sigmoid(logits: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
    # DPO (Rafailov et al. 2023, Eq. 7); label_smoothing is conservative DPO (Mitchell 2023):
    # the preference label is taken as flipped with probability label_smoothing.
    return (-F.logsigmoid(beta * logits) * (1.0 - label_smoothing)
            - F.logsigmoid(-beta * logits) * label_smoothing)


@DPO_LOSSES.register("ipo")
def _dpo_ipo(logits: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
    # IPO (Azar et al. 2023, Eq. 17): regress the log-ratio difference onto 1 / (2 * beta).
    # The paper uses log-probs averaged over tokens; pass those if you follow it exactly.
    return (logits - 1.0 / (2.0 * beta)) ** 2


@DPO_LOSSES.register("robust")
def _dpo_robust(logits: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
    # Robust DPO (Chowdhury et al. 2024, Eq. 8): an unbiased loss under label noise rate
    # label_smoothing (< 0.5).
    return (-F.logsigmoid(beta * logits) * (1.0 - label_smoothing)
            + F.logsigmoid(-beta * logits) * label_smoothing) / (1.0 - 2.0 * label_smoothing)


def dpo_loss(
    policy_chosen_logps: torch.Tensor,  # [B] summed log-probs of the chosen responses
    policy_rejected_logps: torch.Tensor,  # [B]
    ref_chosen_logps: torch.Tensor,  # [B] same under the frozen reference model
    ref_rejected_logps: torch.Tensor,  # [B]
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO-family loss, mean over pairs; loss_type in DPO_LOSSES.names().

    Metrics: loss; rewards/chosen and rewards/rejected (mean beta * log-ratio); reward_accuracy
    (fraction of pairs with chosen reward > rejected); margin (mean chosen - rejected reward).
    """
    check_same_shape(policy_chosen_logps=policy_chosen_logps,
                     policy_rejected_logps=policy_rejected_logps,
                     ref_chosen_logps=ref_chosen_logps, ref_rejected_logps=ref_rejected_logps)
    if beta <= 0.0:
        raise ValueError(f"DPO beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    per_pair = DPO_LOSSES.get(loss_type)

    chosen_logratios = policy_chosen_logps - ref_chosen_logps
    rejected_logratios = policy_rejected_logps - ref_rejected_logps
    logits = chosen_logratios - rejected_logratios
    loss = per_pair(logits, beta, label_smoothing).mean()

    chosen_rewards = (beta * chosen_logratios).detach()
    rejected_rewards = (beta * rejected_logratios).detach()
    metrics = {
        "loss": loss.detach(),
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "reward_accuracy": (chosen_rewards > rejected_rewards).to(chosen_rewards.dtype).mean(),
        "margin": (chosen_rewards - rejected_rewards).mean(),
    }
    return loss, metrics


def kto_loss(
    policy_logps: torch.Tensor,  # [B] summed log-probs of each completion
    ref_logps: torch.Tensor,  # [B]
    labels: torch.Tensor,  # [B] bool, True = desirable completion
    kl_policy_logps: torch.Tensor,  # [B'] log-probs of mismatched (prompt, completion) pairs
    kl_ref_logps: torch.Tensor,  # [B']
    *,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KTO (Ethayarajh et al. 2024, Eq. 8), mean over the batch.

    Reference point z0 = max(0, mean(kl_policy_logps - kl_ref_logps)), estimated from mismatched
    pairs and detached (no gradient flows through it). With r = policy_logps - ref_logps:
      desirable:   desirable_weight   * (1 - sigmoid(beta * (r - z0)))
      undesirable: undesirable_weight * (1 - sigmoid(beta * (z0 - r)))
    Metrics: loss; kl (z0); rewards/chosen, rewards/rejected (mean beta * r over desirable /
    undesirable examples, 0 when there are none); num_chosen, num_rejected.
    """
    check_same_shape(policy_logps=policy_logps, ref_logps=ref_logps, labels=labels)
    check_same_shape(kl_policy_logps=kl_policy_logps, kl_ref_logps=kl_ref_logps)
    if kl_policy_logps.numel() == 0:
        raise ValueError("kto_loss needs at least one mismatched (prompt, completion) pair in "
                         "kl_policy_logps / kl_ref_logps to estimate the reference point")
    if beta <= 0.0:
        raise ValueError(f"KTO beta must be > 0, got {beta}")
    if desirable_weight < 0.0 or undesirable_weight < 0.0:
        raise ValueError(f"KTO weights must be >= 0, got desirable_weight={desirable_weight}, "
                         f"undesirable_weight={undesirable_weight}")

    reference_point = (kl_policy_logps - kl_ref_logps).mean().clamp(min=0).detach()
    logratios = policy_logps - ref_logps
    desirable = labels.bool()
    desirable_losses = 1.0 - torch.sigmoid(beta * (logratios - reference_point))
    undesirable_losses = 1.0 - torch.sigmoid(beta * (reference_point - logratios))
    per_example = torch.where(desirable, desirable_weight * desirable_losses,
                              undesirable_weight * undesirable_losses)
    loss = per_example.mean()

    rewards = (beta * logratios).detach()
    num_chosen = desirable.sum()
    num_rejected = (~desirable).sum()
    metrics = {
        "loss": loss.detach(),
        "kl": reference_point,
        "rewards/chosen": rewards[desirable].sum() / num_chosen.clamp(min=1),
        "rewards/rejected": rewards[~desirable].sum() / num_rejected.clamp(min=1),
        "num_chosen": num_chosen.to(rewards.dtype),
        "num_rejected": num_rejected.to(rewards.dtype),
    }
    return loss, metrics


def bradley_terry_loss(
    chosen_rewards: torch.Tensor,  # [B] reward-model scores of the chosen responses
    rejected_rewards: torch.Tensor,  # [B]
    margin: torch.Tensor | None = None,  # [B] optional required margin (Llama 2, Touvron 2023)
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Reward-model loss -log sigmoid(r_chosen - r_rejected - margin), mean over pairs
    (Bradley & Terry 1952; Ouyang et al. 2022, Eq. 1; margin term from Llama 2, Eq. 2).

    Metrics: loss; accuracy (fraction with r_chosen > r_rejected); margin (mean r_chosen -
    r_rejected).
    """
    check_same_shape(chosen_rewards=chosen_rewards, rejected_rewards=rejected_rewards)
    differences = chosen_rewards - rejected_rewards
    if margin is not None:
        check_same_shape(chosen_rewards=chosen_rewards, margin=margin)
        loss = -F.logsigmoid(differences - margin).mean()
    else:
        loss = -F.logsigmoid(differences).mean()
    differences = differences.detach()
    metrics = {
        "loss": loss.detach(),
        "accuracy": (differences > 0).to(differences.dtype).mean(),
        "margin": differences.mean(),
    }
    return loss, metrics
