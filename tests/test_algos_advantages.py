"""Advantage estimators (hybridrl.algos.advantages) against hand-worked values and invariants."""

import math

import pytest
import torch

from hybridrl.algos import (
    ADVANTAGE_ESTIMATORS,
    AdvantageConfig,
    compute_gae,
    discounted_returns,
    get_advantage_estimator,
    masked_mean,
    masked_var,
    register_advantage_estimator,
)

D = torch.float64
NO_WHITEN = AdvantageConfig(whiten=False)


def rows(*values):
    return torch.tensor(values, dtype=D)


# --- A batch of three prompt groups, shared by the outcome-estimator tests ----------------------
# group 7: scores 1, 2, 3 (mean 2, unbiased std 1); group 3: scores 0, 4 (mean 2, std sqrt(8));
# group 9: one sample with score 5. Rows are interleaved and have different lengths.
GROUP_IDS = torch.tensor([7, 3, 7, 9, 3, 7])
LENGTHS = torch.tensor([4, 2, 3, 1, 4, 2])
MASK = torch.arange(4)[None, :] < LENGTHS[:, None]  # [6, 4]
TOKEN_REWARDS = rows(
    [0.0, 0.0, 0.0, 1.0],
    [0.0, 0.0, 100.0, 100.0],  # padding garbage must be ignored; score 0
    [0.5, 0.0, 1.5, 0.0],  # score 2 split over two tokens (e.g. a per-token term)
    [5.0, 0.0, 0.0, 0.0],
    [0.0, 0.0, 0.0, 4.0],
    [0.0, 3.0, 0.0, 0.0],
)


def per_sequence(advantages):
    """The value broadcast over each row's valid tokens (asserting it is constant there)."""
    first = advantages[:, 0]
    torch.testing.assert_close(advantages, torch.where(MASK, first[:, None], 0.0))
    return first


def test_grpo_hand_values_with_std():
    advantages, returns = get_advantage_estimator("grpo")(
        TOKEN_REWARDS, MASK, group_ids=GROUP_IDS, config=AdvantageConfig(eps=1e-6))
    # (score - group mean) / (group std + eps); the singleton group gets 0
    expected = rows(-1 / (1 + 1e-6), -2 / (math.sqrt(8) + 1e-6), 0.0, 0.0,
                    2 / (math.sqrt(8) + 1e-6), 1 / (1 + 1e-6))
    torch.testing.assert_close(per_sequence(advantages), expected)
    torch.testing.assert_close(returns, advantages)


def test_grpo_hand_values_without_std_is_dr_grpo():
    advantages, _ = get_advantage_estimator("grpo")(
        TOKEN_REWARDS, MASK, group_ids=GROUP_IDS, config=AdvantageConfig(norm_by_std=False))
    torch.testing.assert_close(per_sequence(advantages), rows(-1.0, -2.0, 0.0, 0.0, 2.0, 1.0))


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_advantages_of_a_group_sum_to_zero(norm_by_std):
    generator = torch.manual_seed(1)
    scores = torch.randn(12, dtype=D, generator=generator)
    group_ids = torch.arange(3).repeat_interleave(4)
    mask = torch.ones(12, 5, dtype=torch.bool)
    token_rewards = torch.zeros(12, 5, dtype=D)
    token_rewards[:, -1] = scores
    advantages, _ = get_advantage_estimator("grpo")(
        token_rewards, mask, group_ids=group_ids, config=AdvantageConfig(norm_by_std=norm_by_std))
    group_sums = advantages[:, 0].view(3, 4).sum(-1)
    torch.testing.assert_close(group_sums, torch.zeros(3, dtype=D))
    assert advantages.abs().max() > 0.1  # not trivially zero


def test_grpo_with_std_has_unit_group_std():
    scores = rows(3.0, -1.0, 0.5, 7.0)
    token_rewards = scores[:, None].clone()
    advantages, _ = get_advantage_estimator("grpo")(
        token_rewards, torch.ones(4, 1, dtype=torch.bool), group_ids=torch.zeros(4).long(),
        config=AdvantageConfig(eps=1e-12))
    assert advantages[:, 0].std().item() == pytest.approx(1.0)


def test_rloo_hand_values():
    advantages, returns = get_advantage_estimator("rloo")(
        TOKEN_REWARDS, MASK, group_ids=GROUP_IDS)
    # score_i - mean of the others: group 7: 1 - 2.5, 2 - 2, 3 - 1.5; group 3: 0 - 4, 4 - 0
    torch.testing.assert_close(per_sequence(advantages), rows(-1.5, -4.0, 0.0, 0.0, 4.0, 1.5))
    torch.testing.assert_close(returns, advantages)


def test_rloo_equals_scaled_dr_grpo():
    # RLOO = n / (n - 1) * (score - group mean) (Ahmadian et al. 2024)
    rloo, _ = get_advantage_estimator("rloo")(TOKEN_REWARDS, MASK, group_ids=GROUP_IDS)
    centred, _ = get_advantage_estimator("grpo")(
        TOKEN_REWARDS, MASK, group_ids=GROUP_IDS, config=AdvantageConfig(norm_by_std=False))
    group_sizes = rows(3, 2, 3, 1, 2, 3)
    scale = torch.where(group_sizes > 1, group_sizes / (group_sizes - 1).clamp(min=1), 0.0)
    torch.testing.assert_close(rloo, centred * scale[:, None])


def test_compute_gae_hand_values():
    # gamma 0.9, lam 0.8 (gamma * lam = 0.72)
    # row 0: r = [0, 0, 1], V = [0.5, 0.6, 0.7]
    #   t2: delta = 1 - 0.7 = 0.3;                 A = 0.3
    #   t1: delta = 0.9 * 0.7 - 0.6 = 0.03;        A = 0.03 + 0.72 * 0.3 = 0.246
    #   t0: delta = 0.9 * 0.6 - 0.5 = 0.04;        A = 0.04 + 0.72 * 0.246 = 0.21712
    # row 1: r = [0, 1, pad], V = [0.2, 0.4, 9 (pad)]: the value after the last token is 0
    #   t1: delta = 1 - 0.4 = 0.6;                 A = 0.6
    #   t0: delta = 0.9 * 0.4 - 0.2 = 0.16;        A = 0.16 + 0.72 * 0.6 = 0.592
    # row 2: r = [0, pad, 1], V = [0.5, 9 (hole), 0.7]: the masked middle token is skipped
    #   t2: A = 0.3;  t0: delta = 0.9 * 0.7 - 0.5 = 0.13;  A = 0.13 + 0.72 * 0.3 = 0.346
    token_rewards = rows([0, 0, 1], [0, 1, 0], [0, 0, 1])
    values = rows([0.5, 0.6, 0.7], [0.2, 0.4, 9.0], [0.5, 9.0, 0.7])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 1]])
    advantages, returns = compute_gae(token_rewards, values, mask, gamma=0.9, lam=0.8)
    torch.testing.assert_close(advantages, rows([0.21712, 0.246, 0.3], [0.592, 0.6, 0.0],
                                                [0.346, 0.0, 0.3]))
    # returns = advantages + values on valid tokens
    torch.testing.assert_close(returns, rows([0.71712, 0.846, 1.0], [0.792, 1.0, 0.0],
                                             [0.846, 0.0, 1.0]))


def test_gae_with_unit_gamma_lam_and_zero_values_is_reward_to_go():
    token_rewards = rows([0.1, -0.2, 0.0, 1.0], [0.5, 1.0, 7.0, 7.0])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    advantages, returns = get_advantage_estimator("gae")(
        token_rewards, mask, values=torch.zeros_like(token_rewards), config=NO_WHITEN)
    reward_to_go = rows([0.9, 0.8, 1.0, 1.0], [1.5, 1.0, 0.0, 0.0])
    torch.testing.assert_close(advantages, reward_to_go)
    torch.testing.assert_close(returns, reward_to_go)
    torch.testing.assert_close(discounted_returns(token_rewards, mask), reward_to_go)


def test_gae_whitens_over_valid_tokens_and_needs_values():
    generator = torch.manual_seed(2)
    token_rewards = torch.randn(4, 6, dtype=D, generator=generator)
    values = torch.randn(4, 6, dtype=D, generator=generator)
    mask = torch.arange(6)[None, :] < torch.tensor([6, 2, 4, 5])[:, None]
    advantages, returns = get_advantage_estimator("gae")(
        token_rewards, mask, values=values, config=AdvantageConfig(gamma=0.99, lam=0.95))
    raw, raw_returns = compute_gae(token_rewards, values, mask, gamma=0.99, lam=0.95)
    assert masked_mean(advantages, mask).item() == pytest.approx(0.0, abs=1e-12)
    assert masked_var(advantages, mask).item() == pytest.approx(1.0, abs=1e-6)
    torch.testing.assert_close(returns, raw_returns)  # returns stay unwhitened
    assert not torch.allclose(advantages, raw)
    with pytest.raises(ValueError, match="needs values"):
        get_advantage_estimator("gae")(token_rewards, mask)


def test_reinforce_pp_hand_values():
    # gamma 0.5. row 0: r = [0, 0, 1] -> return-to-go [0.25, 0.5, 1]
    #            row 1: r = [0, 2, pad] -> [1, 2, 0]
    # valid returns 0.25, 0.5, 1, 1, 2: mean 0.95, squared deviations sum 1.8,
    # unbiased var 0.45, std 0.670820
    token_rewards = rows([0, 0, 1], [0, 2, 0])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    estimator = get_advantage_estimator("reinforce_pp")
    advantages, returns = estimator(token_rewards, mask, config=AdvantageConfig(gamma=0.5))
    torch.testing.assert_close(returns, rows([0.25, 0.5, 1.0], [1.0, 2.0, 0.0]))
    expected = rows([-1.0434984, -0.6708204, 0.0745356], [0.0745356, 1.5652476, 0.0])
    torch.testing.assert_close(advantages, expected, atol=1e-6, rtol=0)
    raw, _ = estimator(token_rewards, mask, config=AdvantageConfig(gamma=0.5, whiten=False))
    torch.testing.assert_close(raw, returns)


def test_reinforce_pp_baseline_hand_values():
    # gamma 1; groups [0, 0, 1, 1]; scores [1, 0, 3, 1]; lengths [3, 2, 1, 3]
    # group means 0.5 and 2 -> centred scores 0.5, -0.5, 1, -1, broadcast by return-to-go
    token_rewards = rows([0, 0, 1], [0, 0, 0], [3, 0, 0], [0, 0, 1])
    mask = torch.arange(3)[None, :] < torch.tensor([3, 2, 1, 3])[:, None]
    group_ids = torch.tensor([0, 0, 1, 1])
    estimator = get_advantage_estimator("reinforce_pp_baseline")
    raw, _ = estimator(token_rewards, mask, group_ids=group_ids, config=NO_WHITEN)
    torch.testing.assert_close(raw, rows([0.5, 0.5, 0.5], [-0.5, -0.5, 0], [1, 0, 0],
                                         [-1, -1, -1]))
    # whitened: 9 valid values, mean -1/6, squared deviations sum 5, unbiased var 5/8
    advantages, _ = estimator(token_rewards, mask, group_ids=group_ids)
    a, b, c, d = 0.8432740, -0.4216370, 1.4757296, -1.0540926
    torch.testing.assert_close(advantages, rows([a, a, a], [b, b, 0], [c, 0, 0], [d, d, d]),
                               atol=1e-6, rtol=0)


def test_reinforce_pp_baseline_subtracts_at_the_last_token_only():
    # Per-token terms stay where they are. Scores 0.9 (= -0.1 + 1) and 0.1; group mean 0.5.
    # row 0: [-0.1, 0, 1 - 0.5] -> return-to-go [0.4, 0.5, 0.5]
    # row 1: [0, 0, 0.1 - 0.5] -> [-0.4, -0.4, -0.4]
    token_rewards = rows([-0.1, 0.0, 1.0], [0.0, 0.0, 0.1])
    advantages, _ = get_advantage_estimator("reinforce_pp_baseline")(
        token_rewards, torch.ones(2, 3), group_ids=torch.tensor([4, 4]), config=NO_WHITEN)
    torch.testing.assert_close(advantages, rows([0.4, 0.5, 0.5], [-0.4, -0.4, -0.4]))


@pytest.mark.parametrize("name", ADVANTAGE_ESTIMATORS.names())
def test_every_estimator_is_zero_on_padding(name):
    generator = torch.manual_seed(3)
    token_rewards = torch.randn(6, 4, dtype=D, generator=generator)
    values = torch.randn(6, 4, dtype=D, generator=generator)
    advantages, returns = get_advantage_estimator(name)(
        token_rewards, MASK, group_ids=GROUP_IDS, values=values, config=AdvantageConfig())
    padding = ~MASK
    assert advantages[padding].abs().max().item() == 0.0
    assert returns[padding].abs().max().item() == 0.0
    assert advantages[MASK].abs().max().item() > 0.0
    assert not advantages.requires_grad


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_pp_baseline"])
def test_group_estimators_need_group_ids(name):
    with pytest.raises(ValueError, match="needs group_ids"):
        get_advantage_estimator(name)(TOKEN_REWARDS, MASK)
    with pytest.raises(ValueError, match=r"group_ids must have shape \[6\]"):
        get_advantage_estimator(name)(TOKEN_REWARDS, MASK, group_ids=GROUP_IDS[:3])


def test_registry_and_config_errors():
    assert ADVANTAGE_ESTIMATORS.names() == ["gae", "grpo", "reinforce_pp",
                                            "reinforce_pp_baseline", "rloo"]
    with pytest.raises(ValueError, match="Did you mean 'rloo'"):
        get_advantage_estimator("rlo")
    with pytest.raises(ValueError, match="already registered"):
        register_advantage_estimator("grpo")(lambda *a, **k: None)
    with pytest.raises(ValueError, match="gamma must be in"):
        AdvantageConfig(gamma=1.5)
    with pytest.raises(ValueError, match="lam must be in"):
        AdvantageConfig(lam=-0.1)
