"""Running mean and standard deviation of scores, for reward normalisation."""

from __future__ import annotations

import math


class RunningMeanStd:
    """Mean and population std of every value seen so far, merged batch by batch (Chan et al. 1979)."""

    def __init__(self, eps: float = 1e-6):
        self.eps = eps
        self.count = 0
        self.mean = 0.0
        self.m2 = 0.0  # sum of squared deviations from the mean

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.count) if self.count else 1.0

    def update(self, values: list[float]) -> None:
        if not values:
            return
        n = len(values)
        mean = sum(values) / n
        m2 = sum((v - mean) ** 2 for v in values)
        total = self.count + n
        delta = mean - self.mean
        self.m2 += m2 + delta * delta * self.count * n / total
        self.mean += delta * n / total
        self.count = total

    def normalize(self, values: list[float]) -> list[float]:
        scale = max(self.std, self.eps)
        return [(v - self.mean) / scale for v in values]

    def state_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.count, self.mean, self.m2 = int(state["count"]), float(state["mean"]), float(state["m2"])
