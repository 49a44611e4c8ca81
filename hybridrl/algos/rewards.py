"""Building the per-token reward matrix that the advantage estimators take."""

from __future__ import annotations

import torch

from hybridrl.algos.kl import kl_penalty
from hybridrl.algos.masking import check_same_shape, last_valid_index, masked_mean


def scores_to_token_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence's score [B] at its last valid response token: -> [B, T]."""
    if tuple(scores.shape) != (response_mask.shape[0],):
        raise ValueError(f"scores must have shape [{response_mask.shape[0]}] (one per sequence), "
                         f"got {list(scores.shape)}")
    last = last_valid_index(response_mask)
    if bool((last < 0).any()):
        empty_rows = (last < 0).nonzero().flatten().tolist()
        raise ValueError(f"rows {empty_rows} of response_mask have no valid token, so their score "
                         "has nowhere to go; give every response at least one token (e.g. EOS)")
    token_rewards = torch.zeros(response_mask.shape, dtype=scores.dtype, device=scores.device)
    rows = torch.arange(scores.shape[0], device=scores.device)
    token_rewards[rows, last] = scores
    return token_rewards


def apply_kl_penalty(
    token_rewards: torch.Tensor,  # [B, T]
    logprobs: torch.Tensor,  # [B, T] under the rollout-time policy
    ref_logprobs: torch.Tensor,  # [B, T]
    response_mask: torch.Tensor,  # [B, T]
    *,
    kl_coef: float,
    estimator: str = "k1",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL in the reward (Ziegler et al. 2019, Eq. 2; InstructGPT): r_t - kl_coef * KL_t on valid
    tokens. Returns (token_rewards, {"kl": masked mean KL, "kl_coef": kl_coef})."""
    check_same_shape(token_rewards=token_rewards, logprobs=logprobs, response_mask=response_mask)
    per_token_kl = kl_penalty(logprobs, ref_logprobs, estimator)
    penalised = torch.where(response_mask.bool(), token_rewards - kl_coef * per_token_kl,
                            token_rewards)
    metrics = {
        "kl": masked_mean(per_token_kl, response_mask).detach(),
        "kl_coef": torch.tensor(float(kl_coef)),
    }
    return penalised, metrics
