"""Per-sample workers: timeouts (threads and processes), and streaming overlap with generation."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from hybridrl.reward import RewardEngine, RewardError


def sleepy(prompts, responses, **columns):
    if responses[0] == "slow":
        time.sleep(5)
    return [1.0]


@pytest.mark.parametrize("num_workers", [1, 3])
def test_timeout_abandons_the_stuck_sample(num_workers):
    engine = RewardEngine.from_fn(sleepy, timeout_s=0.2, num_workers=num_workers)
    start = time.perf_counter()
    res = engine.score(["p"] * 4, ["slow", "a", "b", "c"])  # the stuck one first: its slot must be refilled
    assert time.perf_counter() - start < 1.5
    assert res.timed_out == [0]
    assert res.scores == [0.0, 1.0, 1.0, 1.0]
    assert res.metrics["reward/timeouts"] == 1 and res.metrics["reward/sleepy/timeouts"] == 1
    assert res.metrics["reward/sleepy/mean"] == 1.0  # over the samples that finished


def test_timeout_score_is_configurable():
    engine = RewardEngine.from_fn(sleepy, timeout_s=0.1, timeout_score=-1.0)
    assert engine.score(["p", "p"], ["a", "slow"]).scores == [1.0, -1.0]


def test_stuck_thread_does_not_block_interpreter_exit():
    script = textwrap.dedent(
        """
        import time
        from hybridrl.reward import RewardEngine
        def stuck(prompts, responses):
            time.sleep(60)
        res = RewardEngine.from_fn(stuck, timeout_s=0.1).score(["p"], ["r"])
        print(res.timed_out)
        """
    )
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[0]"
    assert time.perf_counter() - start < 10  # not the 60 s the stuck call would take


def test_error_in_worker_names_the_sample():
    def picky(prompts, responses):
        if responses[0] == "bad":
            raise KeyError("no such key")
        return [1.0]

    with pytest.raises(RewardError) as info:
        RewardEngine.from_fn(picky, timeout_s=1.0, num_workers=2).score(["p0", "p1", "p2"], ["a", "b", "bad"])
    msg = str(info.value)
    assert "picky" in msg and "KeyError" in msg and "sample 2" in msg and "'bad'" in msg


PROCESS_MODULE = textwrap.dedent(
    """
    import time

    def slow(prompts, responses, **columns):
        if responses[0] == "slow":
            time.sleep(5)
        return [float(len(responses[0]))]

    def crash(prompts, responses, **columns):
        raise ValueError("bad sample " + responses[0])
    """
)


def test_process_workers_timeout_and_errors(tmp_path, monkeypatch):
    (tmp_path / "proc_rewards_mod.py").write_text(PROCESS_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import proc_rewards_mod

    engine = RewardEngine.from_fn(proc_rewards_mod.slow, timeout_s=0.5, num_workers=2, use_processes=True)
    try:
        start = time.perf_counter()
        res = engine.score(["p"] * 3, ["ab", "slow", "abcd"])
        assert time.perf_counter() - start < 8  # two process start-ups, a kill, one restart
        assert res.timed_out == [1] and res.scores == [2.0, 0.0, 4.0]
        assert engine.score(["p"], ["abc"]).scores == [3.0]  # idle processes are reused
    finally:
        engine.close()

    crashing = RewardEngine.from_fn(proc_rewards_mod.crash, use_processes=True, num_workers=1)
    try:
        expected = r"ValueError: bad sample x on sample 0 .*raised at .*proc_rewards_mod.py:10 in crash"
        with pytest.raises(RewardError, match=expected):
            crashing.score(["p"], ["x"])
    finally:
        crashing.close()


def test_process_workers_need_a_module_level_function():
    with pytest.raises(RewardError, match="needs a reward function defined at module level"):
        RewardEngine.from_fn(lambda p, r: [0.0], use_processes=True, num_workers=1).score(["p"], ["r"])


# ---- streaming ---------------------------------------------------------------------------------


def exact_slow(prompts, responses, ground_truth, **columns):
    time.sleep(0.02)  # 20 ms per sample
    return [float(r == str(g)) for r, g in zip(responses, ground_truth)]


NUM = 10
ORDER = [3, 0, 7, 1, 9, 2, 8, 4, 6, 5]  # sequences finish out of order
RESPONSES = {i: str(i) if i % 2 == 0 else "wrong" for i in range(NUM)}
EXPECTED = [1.0 if i % 2 == 0 else 0.0 for i in range(NUM)]


def test_streaming_overlaps_generation():
    scorer = RewardEngine.from_fn(exact_slow).stream(columns={"ground_truth": list(range(NUM))}, num_workers=2)
    for i in ORDER:
        time.sleep(0.03)  # the generator producing the next sequence
        scorer.submit(i, f"p{i}", RESPONSES[i])
    res = scorer.finish(NUM)
    assert res.scores == EXPECTED
    assert res.metrics["reward/overlap_ratio"] > 0.7
    assert res.metrics["timing/reward"] == pytest.approx(NUM * 0.02, rel=0.5)
    assert res.metrics["timing/reward_exposed"] < 0.1


def test_submit_returns_at_once():
    scorer = RewardEngine.from_fn(sleepy, timeout_s=0.3).stream(num_workers=1)
    start = time.perf_counter()
    scorer.submit(0, "p", "slow")
    scorer.submit(1, "p", "a")
    assert time.perf_counter() - start < 0.15  # not the 0.3 s deadline, nor the 5 s call
    assert scorer.finish(2).scores == [0.0, 1.0]


def test_streaming_without_generation_has_low_overlap():
    scorer = RewardEngine.from_fn(exact_slow).stream(columns={"ground_truth": list(range(NUM))}, num_workers=1)
    for i in ORDER:
        scorer.submit(i, f"p{i}", RESPONSES[i])
    res = scorer.finish(NUM)
    assert res.scores == EXPECTED
    assert res.metrics["reward/overlap_ratio"] < 0.3
    assert res.metrics["timing/reward_exposed"] > 0.15


def test_streaming_mix_timeouts_and_ids():
    engine = RewardEngine.mix([
        (RewardEngine.from_fn(sleepy, timeout_s=0.2), 1.0),
        (RewardEngine.from_builtin("overlong", max_length=4, buffer_length=2), 1.0),
    ])
    scorer = engine.stream(num_workers=2)
    scorer.submit(1, "p", "slow", response_ids=[0, 0, 0])
    scorer.submit(0, "p", "fast", response_ids=[0])
    start = time.perf_counter()
    res = scorer.finish(2)
    assert time.perf_counter() - start < 1.5
    assert res.components == {"sleepy": [1.0, 0.0], "overlong": [0.0, -0.5]}
    assert res.timed_out == [1] and res.metrics["reward/timeouts"] == 1


def test_streaming_misuse_and_errors():
    engine = RewardEngine.from_fn(exact_slow)
    scorer = engine.stream(columns={"ground_truth": [0, 1]})
    scorer.submit(0, "p", "0")
    with pytest.raises(RewardError, match="sample 0 was submitted twice"):
        scorer.submit(0, "p", "0")
    with pytest.raises(RewardError, match="out of range for column 'ground_truth'"):
        scorer.submit(5, "p", "0")
    with pytest.raises(RewardError, match=r"never submitted \[1\]"):
        scorer.finish(2)
    with pytest.raises(RewardError, match="submit\\(\\) after finish\\(\\)"):
        scorer.submit(1, "p", "1")

    def fails_on_b(prompts, responses):
        if responses[0] == "b":
            raise ValueError("cannot parse")
        return [0.0]

    scorer = RewardEngine.from_fn(fails_on_b).stream()
    for i, response in enumerate(["a", "a", "b"]):
        scorer.submit(i, f"p{i}", response)
    with pytest.raises(RewardError, match=r"fails_on_b .* raised ValueError: cannot parse on sample 2 \(prompt: 'p2'"):
        scorer.finish(3)
