"""PPO policy loss, clipped value loss, KL estimators, entropy / log-probs, reward shaping."""

import math

import pytest
import torch

from hybridrl.algos import (
    KL_ESTIMATORS,
    POLICY_LOSSES,
    apply_kl_penalty,
    clipped_value_loss,
    entropy_from_logits,
    get_policy_loss,
    kl_loss,
    kl_penalty,
    logprobs_from_logits,
    ppo_policy_loss,
    scores_to_token_rewards,
)

D = torch.float64


def rows(*values):
    return torch.tensor(values, dtype=D)


def ppo_batch(ratios, advantages):
    """One valid row with the given ratios, plus a padding row full of garbage."""
    old = rows([-1.0] * len(ratios), [-1.0] * len(ratios))
    logprobs = old.clone()
    logprobs[0] += torch.log(rows(*ratios))
    logprobs[1] = 50.0  # garbage on padding: exp(51) would dominate if it leaked
    logprobs.requires_grad_(True)
    mask = torch.tensor([[1] * len(ratios), [0] * len(ratios)])
    return logprobs, old, rows(advantages, [3.0] * len(advantages)), mask


# --- PPO policy loss --------------------------------------------------------------------------


def test_ppo_ratio_one_gives_minus_mean_advantage_and_no_clipping():
    generator = torch.manual_seed(0)
    logprobs = torch.randn(3, 5, dtype=D, generator=generator)
    advantages = torch.randn(3, 5, dtype=D, generator=generator)
    mask = torch.arange(5)[None, :] < torch.tensor([5, 2, 4])[:, None]
    loss, metrics = get_policy_loss("ppo")(logprobs, logprobs.clone(), advantages, mask)
    assert loss.item() == pytest.approx(-advantages[mask].mean().item())
    assert metrics["pg_clipfrac"].item() == 0.0
    assert metrics["pg_clipfrac_lower"].item() == 0.0
    assert metrics["ppo_kl"].item() == 0.0


def test_ppo_hand_values_outside_the_clip_band():
    # clip 0.2: band [0.8, 1.2]
    # token 0: r 1.5, A +1: max(-1.5, -1.2) = -1.2  (clipped)
    # token 1: r 0.5, A +1: max(-0.5, -0.8) = -0.5
    # token 2: r 1.5, A -1: max( 1.5,  1.2) =  1.5
    # token 3: r 0.5, A -1: max( 0.5,  0.8) =  0.8  (clipped)
    # token-mean = 0.6 / 4 = 0.15; clipfrac 2/4; ppo_kl = mean(-log r) = -0.5 * log 0.75
    logprobs, old, advantages, mask = ppo_batch([1.5, 0.5, 1.5, 0.5], [1.0, 1.0, -1.0, -1.0])
    loss, metrics = ppo_policy_loss(logprobs, old, advantages, mask)
    assert loss.item() == pytest.approx(0.15)
    assert metrics["pg_loss"].item() == pytest.approx(0.15)
    assert metrics["pg_clipfrac"].item() == pytest.approx(0.5)
    assert metrics["pg_clipfrac_lower"].item() == 0.0
    assert metrics["ppo_kl"].item() == pytest.approx(-0.5 * math.log(0.75))
    # d loss / d logprob = -A * r / 4 on unclipped tokens, 0 on clipped ones and padding
    loss.backward()
    torch.testing.assert_close(logprobs.grad, rows([0.0, -0.125, 0.375, 0.0], [0.0] * 4))
    assert all(not v.requires_grad for v in metrics.values())


def test_ppo_clip_higher():
    # DAPO: clip_high 0.28 -> token 0 is clipped at 1.28: (-1.28 - 0.5 + 1.5 + 0.8) / 4 = 0.13
    logprobs, old, advantages, mask = ppo_batch([1.5, 0.5, 1.5, 0.5], [1.0, 1.0, -1.0, -1.0])
    loss, _ = ppo_policy_loss(logprobs, old, advantages, mask, clip_low=0.2, clip_high=0.28)
    assert loss.item() == pytest.approx(0.13)


def test_ppo_dual_clip_hand_values():
    # token 0: r 5,   A -1: max(5, 1.2) = 5, capped at -3 * A = 3      (dual clip active)
    # token 1: r 2,   A -1: max(2, 1.2) = 2 < 3                          (not capped)
    # token 2: r 5,   A +1: max(-5, -1.2) = -1.2  (positive A: no cap;   clipped)
    # token 3: r 0.5, A -2: max(1.0, 1.6) = 1.6 < 6                      (clipped)
    logprobs, old, advantages, mask = ppo_batch([5.0, 2.0, 5.0, 0.5], [-1.0, -1.0, 1.0, -2.0])
    loss, metrics = ppo_policy_loss(logprobs, old, advantages, mask, dual_clip=3.0)
    assert loss.item() == pytest.approx((3.0 + 2.0 - 1.2 + 1.6) / 4)  # 1.35
    assert metrics["pg_clipfrac"].item() == pytest.approx(0.5)
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(0.25)
    loss.backward()
    assert logprobs.grad[0, 0].item() == 0.0  # the capped token has no gradient
    plain, _ = ppo_policy_loss(logprobs.detach(), old, advantages, mask)
    assert plain.item() == pytest.approx((5.0 + 2.0 - 1.2 + 1.6) / 4)  # 1.85


def test_ppo_micro_batches_sum_to_the_mini_batch_loss():
    generator = torch.manual_seed(1)
    logprobs = torch.randn(6, 4, dtype=D, generator=generator)
    old = logprobs + 0.3 * torch.randn(6, 4, dtype=D, generator=generator)
    advantages = torch.randn(6, 4, dtype=D, generator=generator)
    mask = torch.arange(4)[None, :] < torch.tensor([4, 1, 3, 2, 4, 2])[:, None]
    whole, _ = ppo_policy_loss(logprobs, old, advantages, mask)
    num_tokens = float(mask.sum())
    halves = sum(ppo_policy_loss(logprobs[s], old[s], advantages[s], mask[s],
                                 num_tokens=num_tokens)[0] for s in (slice(0, 2), slice(2, 6)))
    torch.testing.assert_close(halves, whole)


def test_ppo_errors_name_the_fix():
    logprobs, old, advantages, mask = ppo_batch([1.0], [1.0])
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        ppo_policy_loss(logprobs, old, advantages, mask, dual_clip=1.0)
    with pytest.raises(ValueError, match="clip_low must be in"):
        ppo_policy_loss(logprobs, old, advantages, mask, clip_low=1.0)
    with pytest.raises(ValueError, match="advantages"):
        ppo_policy_loss(logprobs, old, advantages[:, :0], mask)
    with pytest.raises(ValueError, match="valid names: ppo"):
        get_policy_loss("ppo2")
    assert POLICY_LOSSES.get("ppo") is ppo_policy_loss


# --- value loss -------------------------------------------------------------------------------


def test_clipped_value_loss_hand_values():
    # clip 0.2, per token 0.5 * max((v - R)^2, (old + clip(v - old) - R)^2):
    # t0: v 1.0, old 0.5, R 1.2: max(0.04, (0.7 - 1.2)^2 = 0.25) -> 0.125  (clipped)
    # t1: v 0.6, old 0.5, R 0.0: max(0.36, 0.36)                 -> 0.18
    # t2: v 0.0, old 0.5, R 1.0: max(1.0, (0.3 - 1)^2 = 0.49)    -> 0.5
    # t3: v 2.0, old 1.0, R 0.0: max(4.0, 1.2^2 = 1.44)          -> 2.0
    # token-mean = 2.805 / 4 = 0.70125; clipfrac 1/4
    values = rows([1.0, 0.6, 0.0, 2.0, 99.0]).requires_grad_(True)
    old_values = rows([0.5, 0.5, 0.5, 1.0, 0.0])
    returns = rows([1.2, 0.0, 1.0, 0.0, 0.0])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    loss, metrics = clipped_value_loss(values, old_values, returns, mask, clip=0.2)
    assert loss.item() == pytest.approx(0.70125)
    assert metrics["vf_loss"].item() == pytest.approx(0.70125)
    assert metrics["vf_clipfrac"].item() == pytest.approx(0.25)
    # gradient (v - R) / 4 on the unclipped branch; t0's clipped value is constant in v
    loss.backward()
    torch.testing.assert_close(values.grad, rows([0.0, 0.15, -0.25, 0.5, 0.0]))

    unclipped, metrics = clipped_value_loss(values, old_values, returns, mask, clip=None)
    assert unclipped.item() == pytest.approx(0.5 * (0.04 + 0.36 + 1.0 + 4.0) / 4)  # 0.675
    assert metrics["vf_clipfrac"].item() == 0.0
    with pytest.raises(ValueError, match="value clip must be > 0"):
        clipped_value_loss(values, old_values, returns, mask, clip=0.0)


# --- KL ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("estimator", KL_ESTIMATORS.names())
def test_kl_is_zero_when_policy_equals_reference(estimator):
    logprobs = torch.randn(3, 4, dtype=D, generator=torch.manual_seed(0))
    assert kl_penalty(logprobs, logprobs.clone(), estimator).abs().max().item() == 0.0


@pytest.mark.parametrize(
    "estimator, expected",
    [
        ("k1", [0.5, -1.0]),  # logp - ref
        ("abs", [0.5, 1.0]),
        ("k2", [0.125, 0.5]),  # 0.5 * (logp - ref)^2
        ("k3", [0.1065307, 0.7182818]),  # exp(-0.5) + 0.5 - 1, exp(1) - 1 - 1
        ("low_var_kl", [0.1065307, 0.7182818]),
    ],
)
def test_kl_hand_values(estimator, expected):
    logprobs, ref_logprobs = rows(-1.0, -2.0), rows(-1.5, -1.0)  # logp - ref = [0.5, -1]
    torch.testing.assert_close(kl_penalty(logprobs, ref_logprobs, estimator), rows(*expected),
                               atol=1e-7, rtol=0)


def test_k3_is_nonnegative_and_clamped():
    generator = torch.manual_seed(0)
    logprobs = 3 * torch.randn(1000, dtype=D, generator=generator)
    ref_logprobs = 3 * torch.randn(1000, dtype=D, generator=generator)
    assert kl_penalty(logprobs, ref_logprobs, "k3").min().item() >= 0.0
    # ref - logp = -30 -> exp(-20) + 20 - 1 = 19 -> clamped to 10; +30 -> exp(20) -> 10
    extreme = kl_penalty(rows(0.0, -30.0), rows(-30.0, 0.0), "k3")
    torch.testing.assert_close(extreme, rows(10.0, 10.0))
    # exp(100) overflows: without clamping the exponent too, the gradient would be 0 * inf = NaN
    logprobs = torch.tensor([-100.0, -1.0], requires_grad=True)
    kl_penalty(logprobs, torch.tensor([0.0, -1.5]), "k3").sum().backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([0.0, 1 - math.exp(-0.5)]))


def test_k1_and_k3_are_unbiased_estimates_of_the_kl():
    # Samples from the policy p; E_p[k1] = E_p[k3] = KL(p || q).
    p = torch.distributions.Categorical(logits=torch.tensor([1.0, 0.0, -1.0, 0.5], dtype=D))
    q = torch.distributions.Categorical(logits=torch.tensor([0.0, 0.5, 0.0, 0.0], dtype=D))
    true_kl = torch.distributions.kl_divergence(p, q).item()  # about 0.256
    torch.manual_seed(0)
    tokens = p.sample((200_000,))
    logprobs, ref_logprobs = p.log_prob(tokens), q.log_prob(tokens)
    for estimator in ("k1", "k3"):
        estimate = kl_penalty(logprobs, ref_logprobs, estimator).mean().item()
        assert estimate == pytest.approx(true_kl, abs=0.01)


def test_kl_loss_aggregates_over_valid_tokens_and_errors_list_names():
    logprobs = rows([-1.0, -2.0, 0.0])
    ref_logprobs = rows([-1.5, -1.0, -40.0])  # last token is padding
    mask = torch.tensor([[1, 1, 0]])
    loss, metrics = kl_loss(logprobs, ref_logprobs, mask, estimator="k3")
    assert loss.item() == pytest.approx((0.1065307 + 0.7182818) / 2, abs=1e-7)
    assert metrics["kl_loss"].item() == pytest.approx(loss.item())
    with pytest.raises(ValueError, match="valid names: abs, k1, k2, k3, low_var_kl"):
        kl_penalty(logprobs, ref_logprobs, "kl")


# --- reward shaping ---------------------------------------------------------------------------


def test_scores_to_token_rewards_and_kl_in_reward():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    token_rewards = scores_to_token_rewards(rows(1.0, 2.0), mask)
    torch.testing.assert_close(token_rewards, rows([0, 1, 0], [0, 0, 2]))
    # k1 = logp - ref = [[0.5, -1, 9 (pad)], [0, 0, 1]]; kl_coef 0.1
    logprobs = rows([-1.0, -2.0, 0.0], [-1.0, -1.0, -1.0])
    ref_logprobs = rows([-1.5, -1.0, -9.0], [-1.0, -1.0, -2.0])
    penalised, metrics = apply_kl_penalty(token_rewards, logprobs, ref_logprobs, mask,
                                          kl_coef=0.1, estimator="k1")
    torch.testing.assert_close(penalised, rows([-0.05, 1.1, 0.0], [0.0, 0.0, 1.9]))
    assert metrics["kl"].item() == pytest.approx(0.5 / 5)  # (0.5 - 1 + 0 + 0 + 1) / 5
    with pytest.raises(ValueError, match=r"rows \[1\] of response_mask have no valid token"):
        scores_to_token_rewards(rows(1.0, 2.0), torch.tensor([[1, 0], [0, 0]]))


# --- entropy and log-probs --------------------------------------------------------------------


def test_entropy_and_logprobs_match_torch_categorical():
    generator = torch.manual_seed(0)
    logits = 3 * torch.randn(2, 5, 11, dtype=D, generator=generator)
    labels = torch.randint(0, 11, (2, 5), generator=generator)
    reference = torch.distributions.Categorical(logits=logits)
    torch.testing.assert_close(entropy_from_logits(logits), reference.entropy())
    torch.testing.assert_close(logprobs_from_logits(logits, labels), reference.log_prob(labels))


def test_entropy_hand_values_and_stability():
    # uniform over 4 -> log 4; one dominant logit -> ~0; huge logits stay accurate in fp32
    assert entropy_from_logits(torch.zeros(4)).item() == pytest.approx(math.log(4))
    assert entropy_from_logits(torch.tensor([1e4, 0.0, 0.0])).item() == pytest.approx(0.0,
                                                                                      abs=1e-6)
    # logits [1e4, 1e4, -1e4]: two equal winners -> log 2
    assert entropy_from_logits(torch.tensor([1e4, 1e4, -1e4])).item() == pytest.approx(
        math.log(2))


def test_low_precision_logits_are_computed_in_fp32():
    logits = torch.randn(4, 32, generator=torch.manual_seed(0)).to(torch.bfloat16)
    labels = torch.arange(4)
    logprobs = logprobs_from_logits(logits, labels)
    assert logprobs.dtype == torch.float32
    expected = torch.log_softmax(logits.double(), -1)[torch.arange(4), labels].float()
    torch.testing.assert_close(logprobs, expected)
    assert entropy_from_logits(logits).dtype == torch.float32
    with pytest.raises(ValueError, match="labels shape"):
        logprobs_from_logits(logits, labels[:2])


@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_ppo_token_loss_grad_is_autograds(dual_clip):
    """The closed-form derivative of the per-token PPO loss equals autograd's through
    ppo_policy_loss, in every regime: inside and outside the clip range, at its bounds (ties),
    under the dual clip, and past the log-ratio clamp."""
    from hybridrl.algos.policy_loss import ppo_token_loss_grad

    g = torch.Generator().manual_seed(0)
    old = torch.randn(6, 50, dtype=torch.float64, generator=g)
    delta = torch.randn(6, 50, dtype=torch.float64, generator=g) * 0.4
    delta[0, :5] = torch.tensor([math.log(0.8), math.log(1.28), 0.0, 25.0, -25.0], dtype=torch.float64)  # bounds, clamp
    adv = torch.randn(6, 50, dtype=torch.float64, generator=g) * 2
    adv[1, :3] = 0.0
    lp = (old + delta).requires_grad_()
    mask = torch.ones_like(old)
    loss, _ = ppo_policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=dual_clip, loss_agg="token-mean", num_tokens=1)
    (want,) = torch.autograd.grad(loss, lp)
    got = ppo_token_loss_grad(lp.detach(), old, adv, clip_low=0.2, clip_high=0.28, dual_clip=dual_clip)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("estimator", ["k1", "abs", "k2", "k3", "low_var_kl"])
def test_kl_penalty_grad_is_autograds(estimator):
    from hybridrl.algos.kl import kl_penalty_grad

    g = torch.Generator().manual_seed(1)
    ref = torch.randn(4, 40, dtype=torch.float64, generator=g)
    delta = torch.randn(4, 40, dtype=torch.float64, generator=g) * 3
    delta[0, :4] = torch.tensor([0.0, 25.0, -25.0, -3.0], dtype=torch.float64)  # clamps of k3 (exp clamp, result clamp)
    lp = (ref + delta).requires_grad_()
    (want,) = torch.autograd.grad(kl_penalty(lp, ref, estimator).sum(), lp)
    torch.testing.assert_close(kl_penalty_grad(lp.detach(), ref, estimator), want, atol=1e-12, rtol=1e-12)
