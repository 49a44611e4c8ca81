"""Scoring responses as they finish, so that reward computation hides behind generation."""

from __future__ import annotations

import time

from hybridrl.reward.slot import Slot, assemble_result, collect
from hybridrl.reward.types import RESERVED_NAMES, Batch, RewardError, RewardResult


class StreamingScorer:
    """Takes finished responses one at a time (`submit`) and scores them on worker threads.

    The rollout engine calls `submit` from its `on_finished` callback; `finish(total)` waits for
    the rest and returns the result ordered by index. Components are called per sample (a list of
    one), with their own timeout if they have one; a component with `per_sample = False` (a reward
    model) is called once, on the whole batch, inside `finish()`.

    Metrics added to the result:
      * `timing/reward`: summed busy time of all scoring calls (seconds; can exceed wall time);
      * `timing/reward_exposed`: wall time spent inside `finish()`, i.e. scoring not hidden
        behind generation;
      * `reward/overlap_ratio = clamp(1 - exposed / scoring_wall, 0, 1)`, where `scoring_wall` is
        the wall time during which at least one scoring call was running (the union of their
        intervals). 1.0: all scoring was done by the time `finish()` was called; 0.0: all of it
        happened inside `finish()`. It is 1.0 when nothing was scored.
    """

    def __init__(self, slots: list[Slot], columns: dict[str, list] | None, num_workers: int | None):
        self._slots = slots
        self._columns = dict(columns or {})
        for key in self._columns:
            if key in RESERVED_NAMES:
                raise RewardError(f"column {key!r} clashes with an argument the reward engine passes itself "
                                  f"({', '.join(RESERVED_NAMES)}); rename the column")
        self._runners = [slot.runner(num_workers) if slot.per_sample else None for slot in slots]
        self._samples: dict[int, tuple[str, str, list[int] | None]] = {}
        self._finished = False

    def submit(self, index: int, prompt: str, response: str, response_ids: list[int] | None = None) -> None:
        """Queues sample `index` for scoring and returns at once."""
        if self._finished:
            raise RewardError("submit() after finish(): start a new scorer with RewardEngine.stream()")
        if index in self._samples:
            raise RewardError(f"sample {index} was submitted twice; each index must be submitted once")
        for key, values in self._columns.items():
            if not 0 <= index < len(values):
                raise RewardError(f"sample index {index} is out of range for column {key!r} ({len(values)} values)")
        self._samples[index] = (prompt, response, response_ids)
        sample = Batch(
            prompts=[prompt],
            responses=[response],
            columns={key: [values[index]] for key, values in self._columns.items()},
            response_ids=None if response_ids is None else [response_ids],
        )
        for runner in self._runners:
            if runner is not None:
                runner.submit(index, sample)

    def finish(self, total: int) -> RewardResult:
        """Waits for samples 0..total-1 and returns their result, ordered by index."""
        enter = time.perf_counter()
        self._finished = True
        missing = [i for i in range(total) if i not in self._samples]
        extra = sorted(i for i in self._samples if not 0 <= i < total)
        if missing or extra:
            raise RewardError(f"finish(total={total}): never submitted {missing[:20]}, out of range {extra[:20]}; "
                              "submit every index in 0..total-1 exactly once")
        indices = list(range(total))
        has_ids = any(self._samples[i][2] is not None for i in indices)
        batch = Batch.make(
            prompts=[self._samples[i][0] for i in indices],
            responses=[self._samples[i][1] for i in indices],
            columns={key: values[:total] for key, values in self._columns.items()},
            response_ids=[self._samples[i][2] or [] for i in indices] if has_ids else None,
        )
        per_slot, intervals = [], []
        for slot, runner in zip(self._slots, self._runners):
            if runner is None:  # a whole-batch component, e.g. a reward model: it starts now
                start = time.perf_counter()
                scores = slot.score(batch)
                intervals.append((start, time.perf_counter()))
                scores.busy_s = intervals[-1][1] - start
            else:
                outcomes = runner.wait(indices)
                scores = collect(slot, batch, outcomes)
                intervals.extend((o.end - o.busy_s, o.end) for o in outcomes.values())
            per_slot.append(scores)
        exposed = time.perf_counter() - enter
        result = assemble_result(self._slots, per_slot, total)
        scoring_wall = _union_length(intervals)
        result.metrics["timing/reward"] = sum(scores.busy_s for scores in per_slot)
        result.metrics["timing/reward_exposed"] = exposed
        result.metrics["reward/overlap_ratio"] = (
            min(1.0, max(0.0, 1.0 - exposed / scoring_wall)) if scoring_wall > 0 else 1.0
        )
        return result


def _union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by the (start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total
