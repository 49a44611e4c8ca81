"""Per-token KL estimators between the policy and the reference model, chosen by name.

Schulman, "Approximating KL Divergence" (2020, http://joschu.net/blog/kl-approx.html): with
log_ratio = logprobs - ref_logprobs for tokens sampled from the policy,
  k1 = log_ratio                       unbiased, high variance, can be negative
  k2 = 0.5 * log_ratio^2               biased, low variance
  k3 = exp(-log_ratio) + log_ratio - 1 unbiased, low variance, always >= 0 ("low_var_kl")
"""

from __future__ import annotations

from typing import Callable

import torch

from hybridrl.algos.aggregation import aggregate_loss
from hybridrl.algos.masking import check_same_shape
from hybridrl.algos.registry import Registry

KLEstimator = Callable[[torch.Tensor], torch.Tensor]  # log_ratio [B, T] -> kl [B, T]

KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator")


@KL_ESTIMATORS.register("k1")
def _k1(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio


@KL_ESTIMATORS.register("abs")
def _abs(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio.abs()


@KL_ESTIMATORS.register("k2")
def _k2(log_ratio: torch.Tensor) -> torch.Tensor:
    return 0.5 * log_ratio.square()


_K3_EXPONENT_BOUND, _K3_BOUND = 20.0, 10.0  # _k3's clamps, which its derivative (_k3_grad) honours too


@KL_ESTIMATORS.register("k3")
@KL_ESTIMATORS.register("low_var_kl")
def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    # The exponent is clamped first and the result after, as verl does: one token whose
    # reference log-prob is far off must not blow up the step.
    ref_minus_logp = (-log_ratio).clamp(-_K3_EXPONENT_BOUND, _K3_EXPONENT_BOUND)
    return (torch.exp(ref_minus_logp) - ref_minus_logp - 1.0).clamp(-_K3_BOUND, _K3_BOUND)


def _k3_grad(log_ratio: torch.Tensor) -> torch.Tensor:
    ref_minus_logp = -log_ratio
    r = ref_minus_logp.clamp(-_K3_EXPONENT_BOUND, _K3_EXPONENT_BOUND)
    raw = torch.exp(r) - r - 1.0
    in_exponent_bounds = (ref_minus_logp >= -_K3_EXPONENT_BOUND) & (ref_minus_logp <= _K3_EXPONENT_BOUND)
    return -(torch.exp(r) - 1.0) * in_exponent_bounds * ((raw >= -_K3_BOUND) & (raw <= _K3_BOUND))


# d estimator / d log_ratio in closed form (what autograd gives, clamp bounds included), for the
# policy update's lm_head, which makes its gradient in its forward pass. An estimator missing here
# makes the update take the two-pass lm_head.
KL_ESTIMATOR_GRADS: dict[str, KLEstimator] = {
    "k1": torch.ones_like,
    "abs": torch.sgn,
    "k2": lambda log_ratio: log_ratio,
    "k3": _k3_grad,
    "low_var_kl": _k3_grad,
}


def kl_penalty_grad(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """d kl_penalty / d logprobs per token, in closed form (KeyError for an estimator without one)."""
    return KL_ESTIMATOR_GRADS[estimator](logprobs - ref_logprobs)


def kl_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str
) -> torch.Tensor:
    """Per-token KL(policy || reference) estimate [B, T]; estimator in KL_ESTIMATORS.names()."""
    check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs)
    return KL_ESTIMATORS.get(estimator)(logprobs - ref_logprobs)


def kl_loss(
    logprobs: torch.Tensor,  # [B, T]
    ref_logprobs: torch.Tensor,  # [B, T]
    response_mask: torch.Tensor,  # [B, T]
    *,
    estimator: str = "low_var_kl",
    loss_agg: str = "token-mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    max_response_length: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL to the reference as a loss term (GRPO, Shao et al. 2024, Eq. 3-4). Metric: kl_loss."""
    per_token = kl_penalty(logprobs, ref_logprobs, estimator)
    loss = aggregate_loss(per_token, response_mask, loss_agg, num_tokens=num_tokens,
                          num_seqs=num_seqs, max_response_length=max_response_length)
    return loss, {"kl_loss": loss.detach()}
