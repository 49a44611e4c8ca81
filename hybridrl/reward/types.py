"""Types shared across the reward package: the error, the result, the component protocol, a batch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

# Keyword names the engine itself passes to reward functions; a data column may not use them.
RESERVED_NAMES = ("prompts", "responses", "completions", "completion_ids", "response_ids")


class RewardError(ValueError):
    """A reward function, spec or input is wrong; the message names the culprit and the fix."""


@runtime_checkable
class RewardComponent(Protocol):
    """Anything that scores a batch: a wrapped function, a reward model, a verifier service.

    `__call__` receives the data columns as keyword arguments, plus `response_ids`
    (list[list[int]]) when the caller has token ids. It returns one float per response, or None
    for "not applicable" (scored 0.0 and counted in `reward/<name>/none`).

    Optional: a class attribute `per_sample = False` asks to be called once on the whole batch,
    never per sample (a reward model on a GPU); such a component takes no timeout or workers.
    A component with state that a resume must restore (e.g. running statistics) also has
    `state_dict()` and `load_state_dict(state)` (see `StatefulComponent`).
    """

    name: str

    def __call__(self, prompts: list[str], responses: list[str], **columns: Any) -> list[float | None]:
        ...


@runtime_checkable
class StatefulComponent(Protocol):
    """A component whose state (JSON-serialisable) is saved in checkpoints and restored on resume."""

    def state_dict(self) -> dict[str, Any]:
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ...


@dataclass
class RewardResult:
    """What `RewardEngine.score` and `StreamingScorer.finish` return.

    `scores[i]` is the weighted sum over components of `components[name][i]`. In `components`,
    "not applicable" (None) is stored as 0.0 and a timed-out sample as the component's
    `timeout_score`. Per-component `mean` / `std` (population std) are over the applicable,
    not-timed-out samples only (0.0 if there are none); `reward/mean` / `reward/std` are over
    `scores`.
    """

    scores: list[float]
    components: dict[str, list[float]]
    metrics: dict[str, float]
    timed_out: list[int] = field(default_factory=list)  # sample indices where any component timed out


@dataclass
class Batch:
    """Prompts, responses and their per-sample columns, checked to have one entry per response."""

    prompts: list[str]
    responses: list[str]
    columns: dict[str, list]
    response_ids: list[list[int]] | None = None

    @classmethod
    def make(
        cls,
        prompts: list[str],
        responses: list[str],
        columns: dict[str, list] | None = None,
        response_ids: list[list[int]] | None = None,
    ) -> Batch:
        columns = dict(columns or {})
        num = len(responses)
        if len(prompts) != num:
            raise RewardError(f"got {len(prompts)} prompts for {num} responses; pass one prompt per response "
                              "(repeat each prompt n times for n samples per prompt)")
        for key, values in columns.items():
            if key in RESERVED_NAMES:
                raise RewardError(f"column {key!r} clashes with an argument the reward engine passes itself "
                                  f"({', '.join(RESERVED_NAMES)}); rename the column")
            if len(values) != num:
                raise RewardError(f"column {key!r} has {len(values)} values for {num} responses; "
                                  "every column needs one value per response")
        if response_ids is not None and len(response_ids) != num:
            raise RewardError(f"response_ids has {len(response_ids)} entries for {num} responses")
        return cls(list(prompts), list(responses), columns, response_ids)

    def __len__(self) -> int:
        return len(self.responses)

    def sample(self, index: int) -> Batch:
        """The one-sample batch at `index` (lists of one), for per-sample calls."""
        return Batch(
            prompts=[self.prompts[index]],
            responses=[self.responses[index]],
            columns={key: [values[index]] for key, values in self.columns.items()},
            response_ids=None if self.response_ids is None else [self.response_ids[index]],
        )

    def call_kwargs(self) -> dict[str, Any]:
        """The keyword arguments a component receives besides prompts and responses."""
        kwargs: dict[str, Any] = dict(self.columns)
        if self.response_ids is not None:
            kwargs["response_ids"] = self.response_ids
        return kwargs
