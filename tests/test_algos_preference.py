"""DPO (sigmoid / IPO / robust), KTO, Bradley-Terry and SFT losses against hand-worked values."""

import math

import pytest
import torch

from hybridrl.algos import DPO_LOSSES, bradley_terry_loss, dpo_loss, kto_loss, sft_loss

D = torch.float64


def vec(*values):
    return torch.tensor(values, dtype=D)


# beta 0.5. chosen log-ratios [0.5, -0.5], rejected log-ratios [-1, 0.5]
# -> logits (difference) [1.5, -1.0], beta * logits x = [0.75, -0.5]
# softplus(-0.75) = 0.386871, softplus(0.75) = 1.136871
# softplus(0.5) = 0.974077,  softplus(-0.5) = 0.474077
PAIRS = dict(policy_chosen_logps=vec(-1.0, -2.0), policy_rejected_logps=vec(-3.0, -1.5),
             ref_chosen_logps=vec(-1.5, -1.5), ref_rejected_logps=vec(-2.0, -2.0))


@pytest.mark.parametrize(
    "loss_type, label_smoothing, expected",
    [
        # mean of -logsigmoid(x) = (0.386871 + 0.974077) / 2
        ("sigmoid", 0.0, 0.6804740),
        # 0.9 * softplus(-x) + 0.1 * softplus(x), averaged: (0.461983 + 0.923077) / 2
        ("sigmoid", 0.1, 0.6929740),
        # (logits - 1 / (2 * beta))^2 = (1.5 - 1)^2, (-1 - 1)^2 -> (0.25 + 4) / 2
        ("ipo", 0.0, 2.125),
        # (0.9 * softplus(-x) - 0.1 * softplus(x)) / 0.8, averaged
        ("robust", 0.1, 0.6648490),
    ],
)
def test_dpo_hand_values(loss_type, label_smoothing, expected):
    loss, metrics = dpo_loss(**PAIRS, beta=0.5, loss_type=loss_type,
                             label_smoothing=label_smoothing)
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    # rewards = beta * log-ratio: chosen [0.25, -0.25], rejected [-0.5, 0.25]
    assert metrics["rewards/chosen"].item() == pytest.approx(0.0)
    assert metrics["rewards/rejected"].item() == pytest.approx(-0.125)
    assert metrics["reward_accuracy"].item() == pytest.approx(0.5)
    assert metrics["margin"].item() == pytest.approx(0.125)  # mean of [0.75, -0.5]


@pytest.mark.parametrize("loss_type", ["sigmoid", "robust"])
def test_dpo_policy_equal_to_reference_gives_log_2(loss_type):
    logps = vec(-3.0, -7.0, -1.0)
    loss, metrics = dpo_loss(logps, logps - 1, logps, logps - 1, beta=0.1, loss_type=loss_type,
                             label_smoothing=0.1 if loss_type == "robust" else 0.0)
    assert loss.item() == pytest.approx(math.log(2))
    assert metrics["margin"].item() == 0.0


def test_dpo_swapping_chosen_and_rejected_flips_the_margin():
    _, metrics = dpo_loss(**PAIRS, beta=0.5)
    _, swapped = dpo_loss(PAIRS["policy_rejected_logps"], PAIRS["policy_chosen_logps"],
                          PAIRS["ref_rejected_logps"], PAIRS["ref_chosen_logps"], beta=0.5)
    assert swapped["margin"].item() == pytest.approx(-metrics["margin"].item())
    assert swapped["rewards/chosen"].item() == pytest.approx(metrics["rewards/rejected"].item())


def test_dpo_gradient_raises_chosen_and_lowers_rejected():
    chosen = vec(-2.0, -4.0).requires_grad_(True)
    rejected = vec(-3.0, -1.0).requires_grad_(True)
    loss, _ = dpo_loss(chosen, rejected, vec(-2.5, -3.0), vec(-2.0, -2.0), beta=0.1)
    loss.backward()
    assert (chosen.grad < 0).all() and (rejected.grad > 0).all()
    torch.testing.assert_close(chosen.grad, -rejected.grad)


def test_dpo_errors_name_the_fix():
    with pytest.raises(ValueError, match="valid names: ipo, robust, sigmoid"):
        dpo_loss(**PAIRS, loss_type="hinge_loss")
    with pytest.raises(ValueError, match="beta must be > 0"):
        dpo_loss(**PAIRS, beta=0.0)
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 0.5\)"):
        dpo_loss(**PAIRS, label_smoothing=0.5)
    assert DPO_LOSSES.names() == ["ipo", "robust", "sigmoid"]


# --- KTO --------------------------------------------------------------------------------------
# beta 0.5; log-ratios r = [0.5, -0.5, -1.0], labels [desirable, undesirable, undesirable]
# mismatched pairs: policy - ref = [0.4, -0.2] -> z0 = max(0, 0.1) = 0.1
#   row 0: 1 - sigmoid(0.5 * (0.5 - 0.1)) = 1 - sigmoid(0.2)  = 0.450166
#   row 1: 1 - sigmoid(0.5 * (0.1 + 0.5)) = 1 - sigmoid(0.3)  = 0.425557
#   row 2: 1 - sigmoid(0.5 * (0.1 + 1.0)) = 1 - sigmoid(0.55) = 0.365864
KTO = dict(policy_logps=vec(-1.0, -2.0, -3.0), ref_logps=vec(-1.5, -1.5, -2.0),
           labels=torch.tensor([True, False, False]),
           kl_policy_logps=vec(-2.0, -3.0), kl_ref_logps=vec(-2.4, -2.8))


def test_kto_hand_values():
    loss, metrics = kto_loss(**KTO, beta=0.5)
    assert loss.item() == pytest.approx(0.4138626, abs=1e-6)  # mean of the three rows
    assert metrics["kl"].item() == pytest.approx(0.1)
    assert metrics["rewards/chosen"].item() == pytest.approx(0.25)  # 0.5 * 0.5
    assert metrics["rewards/rejected"].item() == pytest.approx(-0.375)  # 0.5 * mean(-0.5, -1)
    assert metrics["num_chosen"].item() == 1 and metrics["num_rejected"].item() == 2
    # weights 2 / 0.5: (2 * 0.450166 + 0.5 * 0.425557 + 0.5 * 0.365864) / 3
    weighted, _ = kto_loss(**KTO, beta=0.5, desirable_weight=2.0, undesirable_weight=0.5)
    assert weighted.item() == pytest.approx(0.4320143, abs=1e-6)


def test_kto_reference_point_is_clamped_and_detached():
    kl_policy = vec(-2.0, -3.0).requires_grad_(True)
    inputs = dict(KTO, kl_policy_logps=kl_policy, kl_ref_logps=vec(-1.0, -1.0))  # mean -1.5
    policy = KTO["policy_logps"].clone().requires_grad_(True)
    inputs["policy_logps"] = policy
    loss, metrics = kto_loss(**inputs, beta=0.5)
    assert metrics["kl"].item() == 0.0
    # z0 = 0: row 0: 1 - sigmoid(0.25); rows 1, 2: 1 - sigmoid(0.25), 1 - sigmoid(0.5)
    sigmoid = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    assert loss.item() == pytest.approx((2 * (1 - sigmoid(0.25)) + 1 - sigmoid(0.5)) / 3)
    loss.backward()
    assert kl_policy.grad is None
    assert policy.grad[0].item() < 0 < policy.grad[1].item()  # desirable up, undesirable down


def test_kto_needs_mismatched_pairs():
    with pytest.raises(ValueError, match="mismatched"):
        kto_loss(**dict(KTO, kl_policy_logps=vec(), kl_ref_logps=vec()))


# --- Bradley-Terry ----------------------------------------------------------------------------


def test_bradley_terry_hand_values():
    # differences [1, -0.5]: (softplus(-1) + softplus(0.5)) / 2 = (0.313262 + 0.974077) / 2
    loss, metrics = bradley_terry_loss(vec(2.0, 0.5), vec(1.0, 1.0))
    assert loss.item() == pytest.approx(0.6436693, abs=1e-6)
    assert metrics["loss"].item() == pytest.approx(loss.item())
    assert metrics["accuracy"].item() == pytest.approx(0.5)
    assert metrics["margin"].item() == pytest.approx(0.25)
    # margin [0.5, 0.5] -> differences [0.5, -1]: (softplus(-0.5) + softplus(1)) / 2
    with_margin, _ = bradley_terry_loss(vec(2.0, 0.5), vec(1.0, 1.0), margin=vec(0.5, 0.5))
    assert with_margin.item() == pytest.approx((0.4740770 + 1.3132617) / 2, abs=1e-6)


# --- SFT --------------------------------------------------------------------------------------


def test_sft_loss_hand_values():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -9.0, -9.0]], dtype=D)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    loss, metrics = sft_loss(logprobs, mask)
    assert loss.item() == pytest.approx(6.5 / 4)  # (1 + 2 + 3 + 0.5) / 4 tokens
    assert metrics["loss"].item() == pytest.approx(1.625)
    assert sft_loss(logprobs, mask, "seq-mean-token-mean")[0].item() == pytest.approx(1.25)
    assert sft_loss(logprobs, mask, num_tokens=10)[0].item() == pytest.approx(0.65)
