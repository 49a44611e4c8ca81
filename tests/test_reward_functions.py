"""Calling conventions (native and TRL) and the errors for bad reward functions."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hybridrl.reward import RewardEngine, RewardError

FIX = "must return one finite float per response"
PROMPTS = ["p0", "p1", "p2"]
RESPONSES = ["a", "bb", "ccc"]


def score(fn, columns=None, response_ids=None, **kw):
    return RewardEngine.from_fn(fn, **kw).score(PROMPTS, RESPONSES, columns, response_ids)


# ---- calling conventions -----------------------------------------------------------------------


def test_trl_completions_kwargs_gets_everything():
    seen = {}

    def reward_len(completions, **kwargs):
        seen.update(kwargs, completions=completions)
        return [float(len(c)) for c in completions]

    res = score(reward_len, {"ground_truth": ["x", "y", "z"]}, response_ids=[[1], [2, 2], [3, 3, 3]])
    assert res.scores == [1.0, 2.0, 3.0]
    assert seen["completions"] == RESPONSES and seen["prompts"] == PROMPTS
    assert seen["ground_truth"] == ["x", "y", "z"]
    assert seen["completion_ids"] == [[1], [2, 2], [3, 3, 3]]
    assert "responses" not in seen and "response_ids" not in seen


def test_trl_named_columns():
    def accuracy(prompts, completions, ground_truth, **kwargs):
        assert prompts == PROMPTS and "completion_ids" not in kwargs  # no ids supplied
        return [float(c == g) for c, g in zip(completions, ground_truth)]

    res = score(accuracy, {"ground_truth": ["a", "x", "ccc"], "other": [0, 0, 0]})
    assert res.scores == [1.0, 0.0, 1.0]
    assert res.components == {"accuracy": [1.0, 0.0, 1.0]}


def test_trl_explicit_completion_ids_without_kwargs():
    def by_ids(completions, completion_ids):
        return [float(len(ids)) for ids in completion_ids]

    assert score(by_ids, response_ids=[[1, 2], [3], []]).scores == [2.0, 1.0, 0.0]
    with pytest.raises(RewardError, match="pass response_ids= to score"):
        score(by_ids)


def test_native_positional_and_keyword():
    assert score(lambda p, r: [float(len(x)) for x in r]).scores == [1.0, 2.0, 3.0]

    def native(prompts, responses, ground_truth):  # no **columns: unused columns are not passed
        return [float(r == g) for r, g in zip(responses, ground_truth)]

    res = score(native, {"ground_truth": ["a", "bb", "no"], "unused": [1, 2, 3]})
    assert res.scores == [1.0, 1.0, 0.0]


def test_native_response_ids_and_columns_through_kwargs():
    def native(prompts, responses, **columns):
        assert set(columns) == {"ground_truth", "response_ids"}
        return [float(len(ids)) for ids in columns["response_ids"]]

    assert score(native, {"ground_truth": [1, 2, 3]}, response_ids=[[1], [1], [1, 1]]).scores == [1.0, 1.0, 2.0]


def test_async_trl_function():
    async def judge(completions, **kwargs):
        return [0.5 for _ in completions]

    assert score(judge).scores == [0.5, 0.5, 0.5]


def test_none_is_zero_and_counted_numpy_accepted():
    res = score(lambda p, r: np.array([1.0, 0.5, 0.0]))
    assert res.scores == [1.0, 0.5, 0.0]
    res = score(lambda p, r: [1.0, None, 0.5], name="partial")
    assert res.scores == [1.0, 0.0, 0.5]
    assert res.metrics["reward/partial/none"] == 1
    assert res.metrics["reward/partial/mean"] == pytest.approx(0.75)  # over applicable samples only


# ---- errors ------------------------------------------------------------------------------------


def failing_on_ccc(prompts, responses, **kw):
    return [1.0 / (3 - len(r)) for r in responses]


def test_exception_names_function_location_sample_and_fix():
    with pytest.raises(RewardError) as info:
        score(failing_on_ccc)
    msg = str(info.value)
    assert "test_reward_functions.failing_on_ccc" in msg
    assert "test_reward_functions.py:" in msg  # file:line of the definition
    assert "ZeroDivisionError" in msg and "sample 2" in msg
    assert "'p2'" in msg and "'ccc'" in msg
    assert FIX in msg
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_exception_that_only_happens_on_batches():
    def batch_only(prompts, responses):
        if len(responses) > 1:
            raise RuntimeError("batch too big")
        return [1.0]

    with pytest.raises(RewardError, match="no response fails when scored alone") as info:
        score(batch_only)
    assert "batch_only" in str(info.value) and "batch too big" in str(info.value)


def test_long_text_is_clipped():
    with pytest.raises(RewardError) as info:
        RewardEngine.from_fn(failing_on_ccc).score(["q" * 5000], ["ccc" + "x" * 0])
    assert "q" * 200 + "..." in str(info.value) and "q" * 201 not in str(info.value)


@pytest.mark.parametrize(
    "returned, expected",
    [
        (0.5, "returned float"),
        ([1.0, 2.0], "returned 2 scores for 3 responses (expected 3, got 2)"),
        ([1.0, "0.5", 1.0], "returned str '0.5' for sample 1"),
    ],
)
def test_wrong_return_shape_or_type(returned, expected):
    def shaped(prompts, responses):
        return returned

    with pytest.raises(RewardError) as info:
        score(shaped)
    assert expected in str(info.value) and "shaped" in str(info.value) and FIX in str(info.value)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_names_sample_and_value(bad):
    def non_finite(prompts, responses):
        return [0.0, bad, 1.0]

    with pytest.raises(RewardError) as info:
        score(non_finite)
    msg = str(info.value)
    assert "non_finite" in msg and "sample 1" in msg and "'p1'" in msg and "'bb'" in msg
    assert f"returned {bad}" in msg and FIX in msg


def test_missing_column_says_which_and_how():
    def needs_truth(prompts, completions, ground_truth, **kwargs):
        return [0.0] * len(completions)

    with pytest.raises(RewardError) as info:
        score(needs_truth, {"answer": [1, 2, 3]})
    msg = str(info.value)
    assert "needs_truth" in msg and "['ground_truth']" in msg and "'answer'" in msg and "add the column" in msg


def test_bad_columns_and_prompts():
    with pytest.raises(RewardError, match="column 'ground_truth' has 2 values for 3 responses"):
        score(lambda p, r: [0.0] * 3, {"ground_truth": [1, 2]})
    with pytest.raises(RewardError, match="column 'completions' clashes"):
        score(lambda p, r: [0.0] * 3, {"completions": [1, 2, 3]})
    with pytest.raises(RewardError, match="got 2 prompts for 3 responses"):
        RewardEngine.from_fn(lambda p, r: [0.0] * 3).score(["a", "b"], RESPONSES)


def test_signature_that_cannot_take_responses():
    def one_arg(x):
        return [0.0]

    expected = r"one_arg .* cannot receive the responses; write it as fn\(prompts, responses"
    with pytest.raises(RewardError, match=expected):
        RewardEngine.from_fn(one_arg)


def test_unknown_fixed_kwarg_suggests():
    def scaled(prompts, responses, *, scale=1.0):
        return [scale] * len(responses)

    assert RewardEngine.from_fn(scaled, kwargs={"scale": 2.0}).score(["p"], ["r"]).scores == [2.0]
    with pytest.raises(RewardError, match="got kwarg 'scael' it does not accept \\(did you mean 'scale'\\?\\)"):
        RewardEngine.from_fn(scaled, kwargs={"scael": 2.0})
