"""Mixing, metrics, component objects, and building engines from specs."""

from __future__ import annotations

import textwrap

import pytest

from hybridrl.reward import RewardEngine, RewardError

PROMPTS = ["1+1=", "2+2=", "3+3=", "4+4="]
RESPONSES = ["2", "5", "6", "<think>x</think><answer>8</answer>"]
TRUTH = {"ground_truth": [2, 4, 6, 8]}


def test_mix_weights_components_and_metrics():
    arith = RewardEngine.from_builtin("arith")
    fmt = RewardEngine.from_builtin("format")
    engine = RewardEngine.mix([(arith, 1.0), (fmt, 0.5)])
    res = engine.score(PROMPTS, RESPONSES, TRUTH)
    assert res.components == {"arith": [1.0, 0.0, 1.0, 0.0], "format": [0.0, 0.0, 0.0, 1.0]}
    assert res.scores == [1.0, 0.0, 1.0, 0.5]
    m = res.metrics
    assert m["reward/arith/mean"] == 0.5 and m["reward/arith/std"] == 0.5
    assert m["reward/format/mean"] == 0.25 and m["reward/format/std"] == pytest.approx(0.4330127)
    assert m["reward/mean"] == 0.625 and m["reward/std"] == pytest.approx(0.4145781)
    assert m["reward/timeouts"] == 0 and m["timing/reward"] >= 0
    assert res.timed_out == []
    assert repr(engine) == "RewardEngine(1*arith + 0.5*format)"


def test_mix_of_mixes_multiplies_weights_and_renames_clashes():
    arith = RewardEngine.from_builtin("arith")
    inner = RewardEngine.mix([(arith, 2.0), (arith, 1.0)])
    assert inner.names == ["arith", "arith_1"]
    outer = RewardEngine.mix([(inner, 0.5), (arith, 1.0)])
    assert outer.names == ["arith", "arith_1", "arith_2"]
    assert [slot.weight for slot in outer.slots] == [1.0, 0.5, 1.0]
    res = outer.score(PROMPTS, RESPONSES, TRUTH)
    assert res.scores == [2.5, 0.0, 2.5, 0.0]
    assert set(res.components) == {"arith", "arith_1", "arith_2"}
    assert inner.names == ["arith", "arith_1"]  # mixing does not rename the parts


def test_mix_rejects_non_engines():
    with pytest.raises(RewardError, match=r"mix\(\) entry 0 must be \(RewardEngine, weight\).*from_fn"):
        RewardEngine.mix([(lambda p, r: [0.0], 1.0)])
    with pytest.raises(RewardError, match="weight must be a number"):
        RewardEngine.mix([(RewardEngine.from_builtin("arith"), "1")])


class LengthModel:
    """A stand-in for a reward model: any object with `name` and `__call__` is a component."""

    name = "length_rm"

    def __call__(self, prompts, responses, **columns):
        return [len(r) / 10 for r in responses]


class BrokenModel(LengthModel):
    name = "broken_rm"

    def __call__(self, prompts, responses, **columns):
        raise RuntimeError("CUDA out of memory")


def test_component_objects_drop_in():
    engine = RewardEngine.mix([(RewardEngine.from_component(LengthModel()), 1.0),
                               (RewardEngine.from_builtin("arith"), 1.0)])
    res = engine.score(PROMPTS[:2], ["2", "55"], {"ground_truth": [2, 4]})
    assert res.scores == pytest.approx([1.1, 0.2])
    assert "reward/length_rm/mean" in res.metrics
    with pytest.raises(RewardError) as info:
        RewardEngine.from_component(BrokenModel()).score(["p"], ["r"])
    assert "BrokenModel" in str(info.value) and "CUDA out of memory" in str(info.value)
    with pytest.raises(RewardError, match="is not a reward component"):
        RewardEngine.from_component(lambda p, r: [0.0])


def test_slot_settings_are_checked():
    with pytest.raises(RewardError, match="`timeout_s` must be > 0"):
        RewardEngine.from_builtin("arith", timeout_s=0)
    with pytest.raises(RewardError, match="`num_workers` must be an int >= 0"):
        RewardEngine.from_builtin("arith", num_workers=-1)


# ---- specs and loading -------------------------------------------------------------------------

MODULE_SOURCE = textwrap.dedent(
    """
    def score(prompts, completions, ground_truth, **kwargs):
        return [float(str(c).strip() == str(g)) for c, g in zip(completions, ground_truth)]

    def scaled(prompts, responses, *, scale=1.0, **columns):
        return [scale] * len(responses)

    def broken_import_helper():
        pass
    """
)


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_mod.py").write_text(MODULE_SOURCE)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "file_rewards.py").write_text(MODULE_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_from_spec_builtin_module_and_file(reward_module, monkeypatch):
    monkeypatch.chdir(reward_module)
    spec = [
        {"name": "arith", "weight": 1.0},
        {"function": "my_rewards_mod:score", "weight": 0.5},
        {"function": "sub/file_rewards.py:scaled", "name": "bonus", "weight": 2.0, "kwargs": {"scale": 0.25}},
        {"name": "gsm8k", "weight": 0.0, "kwargs": {"format_score": 0.1}},
    ]
    engine = RewardEngine.from_spec(spec)
    assert engine.names == ["arith", "score", "bonus", "gsm8k"]
    res = engine.score(PROMPTS, RESPONSES, TRUTH)
    assert res.components["score"] == [1.0, 0.0, 1.0, 0.0]
    assert res.components["bonus"] == [0.25] * 4
    assert res.scores == [2.0, 0.5, 2.0, 0.5]
    # relative file paths resolve against base_dir (e.g. the YAML file's folder)
    monkeypatch.chdir("/")
    engine = RewardEngine.from_spec([{"function": "sub/file_rewards.py:scaled"}], base_dir=reward_module)
    assert engine.score(["p"], ["r"]).scores == [1.0]


@pytest.mark.parametrize(
    "entry, expected",
    [
        ({"name": "arith", "wieght": 1.0}, "unknown key 'wieght' (did you mean 'weight'?)"),
        ({"weight": 1.0}, "needs 'name' (a built-in scorer: arith, gsm8k"),
        ("arith", "must be a dict such as"),
        ({"name": "arith", "weight": "x"}, "'weight' must be a finite number"),
        ({"name": "arith", "kwargs": [1]}, "'kwargs' must be a dict"),
        ({"function": "no_such_module_xyz:score"}, "cannot import module 'no_such_module_xyz'"),
        ({"function": "my_rewards_mod:scor"}, "no attribute 'scor' (from 'my_rewards_mod:scor') (did you mean 'score'?)"),
        ({"function": "my_rewards_mod"}, "must look like 'package.module:function'"),
        ({"function": "missing/file.py:score"}, "reward function file 'missing/file.py'"),
        ({"function": "sub/file_rewards.py:nope"}, "its public callables: broken_import_helper, scaled, score"),
        ({"name": "overlong"}, "needs kwargs ['max_length', 'buffer_length']"),
    ],
)
def test_from_spec_errors(reward_module, monkeypatch, entry, expected):
    monkeypatch.chdir(reward_module)
    with pytest.raises(RewardError) as info:
        RewardEngine.from_spec([{"name": "arith"}, entry])
    assert expected in str(info.value) and "reward spec entry 1" in str(info.value)


def test_from_spec_module_that_fails_to_import(tmp_path, monkeypatch):
    (tmp_path / "exploding_rewards.py").write_text("import os\nraise RuntimeError('bad config')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardError, match=r"raised RuntimeError: bad config \[at .*exploding_rewards.py:2"):
        RewardEngine.from_spec([{"function": "exploding_rewards:score"}])
    with pytest.raises(RewardError, match="a reward spec must be a non-empty list"):
        RewardEngine.from_spec({"name": "arith"})
