"""Built-in scorers on hand-picked positives and negatives."""

from __future__ import annotations

import pytest

from hybridrl.reward import RewardEngine, RewardError
from hybridrl.reward.math_equiv import is_equiv, last_boxed, normalize
from hybridrl.reward.scorers import arith, format_reward, gsm8k, math_reward, overlong, strip_special_tokens


def run(fn, responses, truths, **kw):
    return fn([""] * len(responses), responses, ground_truth=truths, **kw)


def test_strip_special_tokens():
    assert strip_special_tokens("  42 <|im_end|><|endoftext|>\n") == "42"
    assert strip_special_tokens("x</s>") == "x"
    assert strip_special_tokens("<|im_end|> 5") == "<|im_end|> 5"  # only trailing tokens go


def test_arith():
    responses = ["12", " 12\n", "12<|endoftext|>", "-3<|im_end|>", "012", "12.0", "twelve", "1 2", "13", ""]
    truths = [12, "12", 12, "-3", 12, 12, 12, 12, 12, 12]
    assert run(arith, responses, truths) == [1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]


def test_arith_bad_ground_truth_is_a_data_error():
    with pytest.raises(RewardError, match=r"ground_truth 'abc' is not an integer.*sample 0"):
        RewardEngine.from_builtin("arith").score(["1+1="], ["2"], {"ground_truth": ["abc"]})


GSM8K_SOLUTION = "Natalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 72 clips.\n#### 72"


@pytest.mark.parametrize(
    "response, truth, expected",
    [
        ("She sold 72 clips. #### 72", GSM8K_SOLUTION, 1.0),
        ("#### $1,234.", "1234", 1.0),
        ("#### 72.00<|im_end|>", 72, 1.0),
        ("#### 7 #### -5", "-5", 1.0),  # the last ####
        ("#### 0.5", "0.50", 1.0),
        ("#### 71", GSM8K_SOLUTION, 0.0),
        ("the answer is 72", GSM8K_SOLUTION, 0.0),  # no ####
        ("#### seventy-two", "72", 0.0),
    ],
)
def test_gsm8k(response, truth, expected):
    assert run(gsm8k, [response], [truth]) == [expected]


def test_gsm8k_format_score():
    assert run(gsm8k, ["#### 71", "#### 72", "no answer"], [72] * 3, format_score=0.1) == [0.1, 1.0, 0.0]
    engine = RewardEngine.from_builtin("gsm8k", format_score=0.1)
    assert engine.score(["q"], ["#### 5"], {"ground_truth": ["6"]}).scores == [0.1]


def test_last_boxed_and_normalize():
    assert last_boxed("so \\boxed{1} then \\boxed{\\frac{1}{2}} done") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{{a}{b}}") == "{a}{b}"
    assert last_boxed("\\boxed 5$") == "5"
    assert last_boxed("\\boxed{unclosed") is None and last_boxed("no box") is None
    assert normalize("$\\left( 1, 2 \\right)$.") == "(1,2)"
    assert normalize("\\dfrac12") == "\\frac{1}{2}"
    assert normalize("x = \\text{east}") == "east"
    assert normalize("5\\text{ cm}") == "5"
    assert normalize("90^\\circ") == "90"


@pytest.mark.parametrize(
    "answer, reference",
    [
        ("\\frac{1}{2}", "0.5"),
        ("\\dfrac12", "\\frac{1}{2}"),
        ("1/2", "\\frac{1}{2}"),
        (".5", "0.5"),
        ("1,000", "1000"),
        ("x=5", "5"),
        ("\\$10", "10"),
        ("50\\%", "50"),
        ("\\left(3, -\\frac{1}{2}\\right)", "(3,-\\frac{1}{2})"),
        ("2\\sqrt{2}", "\\sqrt{8}"),  # sympy
        ("\\frac{\\pi}{2}", "\\pi/2"),  # sympy
        ("x^2+2x+1", "(x+1)^2"),  # sympy
        ("\\text{(B)}", "(B)"),
    ],
)
def test_math_equivalent(answer, reference):
    assert is_equiv(answer, reference)


@pytest.mark.parametrize(
    "answer, reference",
    [
        ("\\frac{1}{3}", "0.33"),
        ("2", "-2"),
        ("(1,2)", "(2,1)"),
        ("x^2+1", "(x+1)^2"),
        ("\\sqrt{2}", "1.41"),
        ("__import__('os')", "0"),  # never evaluated
        ("10^{10^{10}}", "1"),  # refused, not computed
        (None, "1"),
    ],
)
def test_math_not_equivalent(answer, reference):
    assert not is_equiv(answer, reference)


def test_math_scorer():
    responses = [
        "so the answer is $\\boxed{\\frac{3}{4}}$<|im_end|>",
        "\\boxed{0.75}",
        "\\boxed{3/5}",
        "0.75",  # not boxed
    ]
    assert run(math_reward, responses, ["\\frac34"] * 4) == [1.0, 1.0, 0.0, 0.0]
    solution = "We get $x = 4$, so the answer is $\\boxed{4}$."  # a full MATH solution as ground truth
    assert run(math_reward, ["\\boxed{4}", "\\boxed{5}"], [solution, solution]) == [1.0, 0.0]


def test_format():
    good = "<think>step 1\nstep 2</think>\n<answer>42</answer>"
    responses = [good, good + "<|im_end|>", "<answer>42</answer>", good + " extra", "<think></think><answer></answer>"]
    assert format_reward([""] * 5, responses) == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert format_reward([""] * 2, ["#### 5", "5"], pattern=r"#### \d+") == [1.0, 0.0]


def test_overlong_dapo_shape():
    # max 10, buffer 4: free up to 6, then (6 - L) / 4, -1 beyond 10.
    ids = [[0] * n for n in (3, 6, 7, 8, 10, 11)]
    assert overlong([""] * 6, [""] * 6, max_length=10, buffer_length=4, response_ids=ids) == [
        0.0, 0.0, -0.25, -0.5, -1.0, -1.0,
    ]
    assert overlong([""] * 2, ["x" * 6, "x" * 9], max_length=10, buffer_length=4) == [0.0, -0.75]  # characters


def test_overlong_through_engine_uses_ids_and_checks_kwargs():
    engine = RewardEngine.from_builtin("overlong", max_length=10, buffer_length=4)
    res = engine.score(["p", "p"], ["short", "short"], response_ids=[[0] * 2, [0] * 8])
    assert res.scores == [0.0, -0.5]
    with pytest.raises(RewardError, match=r"needs kwargs \['max_length', 'buffer_length'\]"):
        RewardEngine.from_builtin("overlong")
    with pytest.raises(RewardError, match=r"0 < buffer_length <= max_length"):
        RewardEngine.from_builtin("overlong", max_length=4, buffer_length=8).score(["p"], ["r"])


def test_unknown_builtin_suggests():
    with pytest.raises(RewardError, match=r"unknown built-in scorer 'gsm8' \(did you mean 'gsm8k'\?\)"):
        RewardEngine.from_builtin("gsm8")
