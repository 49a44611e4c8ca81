"""Registry, masked reductions and loss aggregation (algos.registry / masking / aggregation)."""

import math

import pytest
import torch

from hybridrl.algos import (
    LOSS_AGGREGATIONS,
    Registry,
    aggregate_loss,
    last_valid_index,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)

D = torch.float64


# --- Registry ---------------------------------------------------------------------------------


def test_registry_registers_and_gets_by_name():
    registry = Registry("widget")

    @registry.register("b")
    def b():
        return 2

    @registry.register("a")
    def a():
        return 1

    assert registry.get("a") is a and registry.get("b")() == 2
    assert registry.names() == ["a", "b"]
    assert "a" in registry and "c" not in registry


def test_registry_unknown_name_lists_valid_names_and_suggests():
    registry = Registry("advantage estimator")
    registry.register("grpo")(lambda: None)
    registry.register("rloo")(lambda: None)
    with pytest.raises(ValueError) as err:
        registry.get("grop")
    message = str(err.value)
    assert "unknown advantage estimator 'grop'" in message
    assert "valid names: grpo, rloo" in message
    assert "Did you mean 'grpo'?" in message


def test_registry_rejects_duplicate_names():
    registry = Registry("widget")
    registry.register("a")(lambda: None)
    with pytest.raises(ValueError, match="already registered"):
        registry.register("a")(lambda: None)


# --- masked reductions ------------------------------------------------------------------------

X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=D)
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)  # valid values: 1, 2, 4


def test_masked_sum_and_mean_hand_values():
    assert masked_sum(X, MASK).item() == 7.0  # 1 + 2 + 4
    assert masked_mean(X, MASK).item() == pytest.approx(7.0 / 3.0)
    torch.testing.assert_close(masked_sum(X, MASK, dim=-1), torch.tensor([3.0, 4.0], dtype=D))
    torch.testing.assert_close(masked_mean(X, MASK, dim=-1), torch.tensor([1.5, 4.0], dtype=D))
    torch.testing.assert_close(masked_mean(X, MASK, dim=0), torch.tensor([2.5, 2.0, 0.0], dtype=D))


def test_masked_reductions_accept_float_masks_and_ignore_nan_padding():
    x = X.clone()
    x[0, 2] = float("nan")
    x[1, 1] = float("-inf")
    assert masked_mean(x, MASK.to(D)).item() == pytest.approx(7.0 / 3.0)
    assert masked_var(x, MASK).item() == pytest.approx(7.0 / 3.0)


def test_masked_mean_of_empty_selection_is_zero():
    assert masked_mean(X, torch.zeros_like(MASK)).item() == 0.0


def test_masked_var_hand_values():
    # values 1, 2, 4: mean 7/3; squared deviations 16/9 + 1/9 + 25/9 = 42/9
    assert masked_var(X, MASK, unbiased=True).item() == pytest.approx(42.0 / 9.0 / 2.0)  # 7/3
    assert masked_var(X, MASK, unbiased=False).item() == pytest.approx(42.0 / 9.0 / 3.0)  # 14/9


def test_masked_var_unbiased_needs_two_entries():
    one = torch.tensor([[True, False, False], [False, False, False]])
    with pytest.raises(ValueError, match="unbiased=False"):
        masked_var(X, one)


def test_masked_whiten_hand_values_and_zero_padding():
    whitened = masked_whiten(X, MASK)
    std = math.sqrt(7.0 / 3.0)
    expected = torch.tensor([[(1 - 7 / 3) / std, (2 - 7 / 3) / std, 0.0],
                             [(4 - 7 / 3) / std, 0.0, 0.0]], dtype=D)
    torch.testing.assert_close(whitened, expected)
    # without shifting, the mean 7/3 is added back to the valid entries
    kept_mean = masked_whiten(X, MASK, shift_mean=False)
    torch.testing.assert_close(kept_mean, torch.where(MASK, expected + 7.0 / 3.0, 0.0))


def test_masked_reductions_reject_mismatched_shapes():
    with pytest.raises(ValueError, match=r"x\[2, 3\], mask\[2, 2\]"):
        masked_mean(X, MASK[:, :2])


def test_last_valid_index():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 1]])
    assert last_valid_index(mask).tolist() == [1, -1, 2]


# --- loss aggregation -------------------------------------------------------------------------

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=D)
LOSS_MASK = torch.tensor([[1, 1, 0], [1, 1, 1]])


@pytest.mark.parametrize(
    "mode, kwargs, expected",
    [
        ("token-mean", {}, 18.0 / 5.0),  # (1 + 2 + 4 + 5 + 6) / 5 tokens
        ("token-mean", {"num_tokens": 10}, 1.8),  # 18 / 10 (global count)
        ("seq-mean-token-mean", {}, 3.25),  # (1.5 + 5) / 2
        ("seq-mean-token-mean", {"num_seqs": 4}, 1.625),  # (1.5 + 5) / 4
        ("seq-mean-token-sum", {}, 9.0),  # (3 + 15) / 2
        ("seq-mean-token-sum-norm", {}, 3.0),  # 18 / (2 seqs * T=3)
        ("seq-mean-token-sum-norm", {"max_response_length": 4}, 2.25),  # 18 / (2 * 4)
    ],
)
def test_aggregate_loss_hand_values(mode, kwargs, expected):
    assert aggregate_loss(LOSS, LOSS_MASK, mode, **kwargs).item() == pytest.approx(expected)


def test_aggregate_loss_ignores_all_padding_rows_in_sequence_modes():
    loss = torch.cat([LOSS, torch.full((1, 3), 100.0, dtype=D)])
    mask = torch.cat([LOSS_MASK, torch.zeros(1, 3, dtype=LOSS_MASK.dtype)])
    assert aggregate_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx(3.25)


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS.names())
def test_micro_batch_losses_sum_to_the_mini_batch_loss_with_global_counts(mode):
    generator = torch.manual_seed(0)
    loss_mat = torch.randn(8, 6, dtype=D, generator=generator, requires_grad=True)
    lengths = torch.tensor([6, 1, 3, 5, 2, 6, 4, 3])
    mask = torch.arange(6)[None, :] < lengths[:, None]
    num_tokens, num_seqs = float(mask.sum()), 8.0  # global counts of the mini-batch

    whole = aggregate_loss(loss_mat, mask, mode)
    (whole_grad,) = torch.autograd.grad(whole, loss_mat)

    micro_total = sum(
        aggregate_loss(loss_mat[rows], mask[rows], mode, num_tokens=num_tokens,
                       num_seqs=num_seqs, max_response_length=6)
        for rows in (slice(0, 3), slice(3, 5), slice(5, 8))
    )
    (micro_grad,) = torch.autograd.grad(micro_total, loss_mat)
    torch.testing.assert_close(micro_total, whole)
    torch.testing.assert_close(micro_grad, whole_grad)


def test_micro_batch_token_mean_without_global_count_is_not_exact():
    # The reason num_tokens exists: averaging per-micro-batch means weighs tokens unequally.
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    loss_mat = torch.tensor([[1.0, 1.0, 1.0], [4.0, 0.0, 0.0]], dtype=D)
    whole = aggregate_loss(loss_mat, mask, "token-mean")  # 7 / 4 = 1.75
    local = (aggregate_loss(loss_mat[:1], mask[:1], "token-mean")
             + aggregate_loss(loss_mat[1:], mask[1:], "token-mean")) / 2  # (1 + 4) / 2 = 2.5
    assert whole.item() == pytest.approx(1.75) and local.item() == pytest.approx(2.5)


def test_aggregate_loss_errors_name_the_fix():
    with pytest.raises(ValueError, match="valid names: seq-mean-token-mean, seq-mean-token-sum, "
                                         "seq-mean-token-sum-norm, token-mean"):
        aggregate_loss(LOSS, LOSS_MASK, "token_mean")
    with pytest.raises(ValueError, match="num_tokens must be positive"):
        aggregate_loss(LOSS, LOSS_MASK, "token-mean", num_tokens=0)
