"""One weighted reward component and how it runs; turning per-component scores into a result."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from hybridrl.reward.functions import check_scores, function_error, score_in_caller
from hybridrl.reward.types import Batch, RewardComponent, RewardError, RewardResult
from hybridrl.reward.workers import Outcome, ProcessWorkers, SampleRunner


def auto_num_workers(use_processes: bool) -> int:
    """Worker count when the user leaves `num_workers=0`: CPU count for processes, like
    ThreadPoolExecutor's default for threads (reward functions often wait on I/O or sleep)."""
    cpus = os.cpu_count() or 1
    return cpus if use_processes else min(32, cpus + 4)


@dataclass(eq=False)
class Slot:
    """A component in an engine: its unique name, weight, and per-sample worker settings."""

    component: RewardComponent
    name: str  # unique within the engine; the metric prefix `reward/<name>/`
    weight: float = 1.0
    timeout_s: float | None = None  # per-sample deadline; None calls the whole batch at once
    num_workers: int = 0  # 0: auto when workers are used, else call the batch on the caller's thread
    timeout_score: float = 0.0  # the score of a sample that timed out
    use_processes: bool = False  # worker processes (spawned) instead of threads
    _processes: ProcessWorkers | None = field(default=None, repr=False)

    @property
    def per_sample(self) -> bool:
        """False for a component called once per batch (e.g. a reward model): see RewardComponent."""
        return getattr(self.component, "per_sample", True)

    def __post_init__(self) -> None:
        for key in ("weight", "timeout_score"):
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise RewardError(f"reward {self.name!r}: `{key}` must be a finite number, got {value!r}")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise RewardError(f"reward {self.name!r}: `timeout_s` must be > 0 seconds or None, got {self.timeout_s!r}")
        if not isinstance(self.num_workers, int) or self.num_workers < 0:
            raise RewardError(f"reward {self.name!r}: `num_workers` must be an int >= 0, got {self.num_workers!r}")
        if not self.per_sample and self.uses_workers:
            raise RewardError(f"reward {self.name!r} scores whole batches (e.g. a reward model), so it takes no "
                              "timeout_s, num_workers or use_processes; set them on function rewards only")

    @property
    def uses_workers(self) -> bool:
        return self.timeout_s is not None or self.num_workers > 0 or self.use_processes

    def runner(self, num_workers: int | None = None) -> SampleRunner:
        """A per-sample runner; `num_workers` overrides the slot's own setting."""
        if self.use_processes and self._processes is None:
            self._processes = ProcessWorkers(self.component)
        num = num_workers or self.num_workers or auto_num_workers(self.use_processes)
        return SampleRunner(self.component, num, self.timeout_s, self._processes)

    def score(self, batch: Batch) -> ComponentScores:
        if not self.uses_workers:
            return ComponentScores(score_in_caller(self.component, batch))
        runner = self.runner()
        for i in range(len(batch)):
            runner.submit(i, batch.sample(i))
        return collect(self, batch, runner.wait(list(range(len(batch)))))

    def close(self) -> None:
        if self._processes is not None:
            self._processes.close()
            self._processes = None


@dataclass
class ComponentScores:
    """One component's checked scores for a batch (None: not applicable, or timed out)."""

    values: list[float | None]
    timed_out: list[int] = field(default_factory=list)
    busy_s: float = 0.0  # summed run time of its calls


def collect(slot: Slot, batch: Batch, outcomes: dict[int, Outcome]) -> ComponentScores:
    """Checks per-sample outcomes (keyed by index into `batch`); raises on the first failed sample."""
    scores = ComponentScores(values=[])
    for i in range(len(batch)):
        outcome = outcomes[i]
        scores.busy_s += outcome.busy_s
        if outcome.timed_out:
            scores.timed_out.append(i)
            scores.values.append(None)
        elif outcome.error is not None:
            raise function_error(slot.component, batch, i, i, outcome.error, outcome.where) from outcome.error
        else:
            scores.values.extend(check_scores(slot.component, outcome.value, batch.sample(i), indices=[i]))
    return scores


def _mean_std(values: list[float]) -> tuple[float, float]:
    if not values:
        return 0.0, 0.0
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def assemble_result(slots: list[Slot], per_slot: list[ComponentScores], num: int) -> RewardResult:
    """The weighted total and the `reward/...` metrics (see `RewardResult` for the conventions)."""
    scores = [0.0] * num
    components: dict[str, list[float]] = {}
    metrics: dict[str, float] = {}
    timed_out: set[int] = set()
    for slot, comp in zip(slots, per_slot, strict=True):
        late = set(comp.timed_out)
        column = [slot.timeout_score if i in late else (0.0 if v is None else v) for i, v in enumerate(comp.values)]
        applicable = [v for i, v in enumerate(comp.values) if v is not None and i not in late]
        components[slot.name] = column
        scores = [total + slot.weight * value for total, value in zip(scores, column, strict=True)]
        mean, std = _mean_std(applicable)
        metrics[f"reward/{slot.name}/mean"] = mean
        metrics[f"reward/{slot.name}/std"] = std
        metrics[f"reward/{slot.name}/none"] = float(num - len(applicable) - len(late))
        if slot.timeout_s is not None:
            metrics[f"reward/{slot.name}/timeouts"] = float(len(late))
        timed_out |= late
    mean, std = _mean_std(scores)
    metrics["reward/mean"] = mean
    metrics["reward/std"] = std
    metrics["reward/timeouts"] = float(sum(len(comp.timed_out) for comp in per_slot))
    return RewardResult(scores=scores, components=components, metrics=metrics, timed_out=sorted(timed_out))
