"""`RewardEngine`: weighted reward components behind one `score` call."""

from __future__ import annotations

import copy
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from hybridrl.reward.functions import FunctionReward
from hybridrl.reward.loading import parse_entry
from hybridrl.reward.scorers import get_builtin
from hybridrl.reward.slot import Slot, assemble_result
from hybridrl.reward.streaming import StreamingScorer
from hybridrl.reward.types import Batch, RewardComponent, RewardError, RewardResult, StatefulComponent


def _unique_names(slots: list[Slot]) -> list[Slot]:
    """Renames clashing components `name`, `name_1`, `name_2`, ... in order."""
    seen: set[str] = set()
    for slot in slots:
        base, k = slot.name, 0
        while slot.name in seen:
            k += 1
            slot.name = f"{base}_{k}"
        seen.add(slot.name)
    return slots


class RewardEngine:
    """A weighted sum of reward components: `scores[i] = sum_c weight_c * component_c[i]`.

    A component is any `RewardComponent` (a `name` and `__call__(prompts, responses, **columns)`):
    plain functions are wrapped by `FunctionReward`, which also accepts TRL-style functions.
    """

    def __init__(self, slots: list[Slot]):
        if not slots:
            raise RewardError("a RewardEngine needs at least one reward component")
        self.slots = _unique_names(slots)

    # ---- constructors ----------------------------------------------------------------------

    @classmethod
    def from_component(
        cls,
        component: RewardComponent,
        timeout_s: float | None = None,
        num_workers: int = 0,
        *,
        timeout_score: float = 0.0,
        use_processes: bool = False,
    ) -> RewardEngine:
        """An engine of one component object (e.g. a reward model), weight 1."""
        if not isinstance(component, RewardComponent):
            raise RewardError(f"{component!r} is not a reward component: it needs a `name` and "
                              "`__call__(prompts, responses, **columns)`; wrap plain functions with from_fn")
        return cls([Slot(component, component.name, 1.0, timeout_s, num_workers, timeout_score, use_processes)])

    @classmethod
    def from_fn(
        cls,
        fn: Callable,
        name: str | None = None,
        timeout_s: float | None = None,
        num_workers: int = 0,
        *,
        timeout_score: float = 0.0,
        use_processes: bool = False,
        kwargs: dict[str, Any] | None = None,
    ) -> RewardEngine:
        """An engine of one function, `fn(prompts, responses, **columns) -> list[float]` or TRL-style.

        With `timeout_s` (or `num_workers > 0`, or `use_processes`) it is called per sample on
        `num_workers` workers (0: auto); a sample over `timeout_s` scores `timeout_score`.
        """
        component = FunctionReward(fn, name=name, kwargs=kwargs)
        return cls.from_component(component, timeout_s, num_workers, timeout_score=timeout_score,
                                  use_processes=use_processes)

    @classmethod
    def from_builtin(
        cls, name: str, timeout_s: float | None = None, num_workers: int = 0, **kwargs: Any
    ) -> RewardEngine:
        """A built-in scorer by name ("arith", "gsm8k", "math", "format", "overlong"); `kwargs` are
        its settings, e.g. `from_builtin("overlong", max_length=1024, buffer_length=256)`."""
        return cls.from_fn(get_builtin(name, kwargs), name=name, timeout_s=timeout_s, num_workers=num_workers,
                           kwargs=kwargs)

    @classmethod
    def from_hf(
        cls,
        path_or_id: str,
        offload: bool = True,
        *,
        name: str = "reward_model",
        device: str = "auto",
        dtype: str = "auto",
        normalize: bool = False,
        clip: float | None = None,
        max_batch_tokens: int = 4096,
        max_wave_tokens: int = 32768,
        max_length: int | None = None,
        trust_remote_code: bool = False,
        chat_template: str | None = None,
    ) -> RewardEngine:
        """A learned reward model (`AutoModelForSequenceClassification`, one output) from a Hub id or
        a local directory, e.g. one trained with `algorithm: rm`. See `hybridrl.reward.model`.

        `offload=True` keeps its weights in CPU memory between calls and streams them to the device
        layer by layer while scoring (prefetching the next layer); `offload=False` keeps them on the
        device. `normalize`: running mean/std normalisation; `clip`: bound on the (normalised)
        score. `max_batch_tokens`: padded tokens per forward; `max_wave_tokens`: with offload, the
        tokens whose hidden states stay on the device while a layer's weights are there.
        """
        from hybridrl.reward.model import RewardModel  # torch and transformers, only when asked for

        component = RewardModel.from_pretrained(
            path_or_id, dtype=dtype, device=device, trust_remote_code=trust_remote_code, chat_template=chat_template,
            name=name, offload=offload, normalize=normalize, clip=clip, max_batch_tokens=max_batch_tokens,
            max_wave_tokens=max_wave_tokens, max_length=max_length,
        )
        return cls.from_component(component)

    @classmethod
    def from_spec(cls, spec: Sequence[dict[str, Any]], base_dir: str | Path | None = None) -> RewardEngine:
        """An engine from a list of entries, e.g. from YAML:

            [{"name": "gsm8k", "weight": 1.0, "kwargs": {"format_score": 0.1}},
             {"function": "my_pkg.rewards:score", "weight": 0.5},
             {"function": "rewards.py:score", "name": "style", "timeout_s": 5}]

        Relative file paths are taken from `base_dir` (e.g. the config file's folder), else the
        working directory. See `loading.SPEC_KEYS` for every key.
        """
        if isinstance(spec, (str, dict)) or not isinstance(spec, Sequence) or not spec:
            raise RewardError("a reward spec must be a non-empty list of entries like {'name': 'gsm8k'}, "
                              f"got {spec!r}")
        slots = []
        for index, raw in enumerate(spec):
            entry = parse_entry(raw, index, base_dir)
            component = FunctionReward(entry.fn, name=entry.name, kwargs=entry.kwargs)
            slots.append(Slot(component, component.name, entry.weight, entry.timeout_s, entry.num_workers,
                              entry.timeout_score, entry.use_processes))
        return cls(slots)

    @classmethod
    def mix(cls, parts: Sequence[tuple[RewardEngine, float]]) -> RewardEngine:
        """The weighted sum of engines: each component's weight is multiplied by its engine's."""
        slots = []
        for index, part in enumerate(parts):
            if not (isinstance(part, tuple) and len(part) == 2 and isinstance(part[0], RewardEngine)):
                raise RewardError(f"mix() entry {index} must be (RewardEngine, weight), got {part!r}; "
                                  "wrap plain functions with RewardEngine.from_fn(fn)")
            engine, weight = part
            if isinstance(weight, bool) or not isinstance(weight, (int, float)):
                raise RewardError(f"mix() entry {index}: the weight must be a number, got {weight!r}")
            for slot in engine.slots:
                slots.append(Slot(slot.component, slot.name, slot.weight * weight, slot.timeout_s, slot.num_workers,
                                  slot.timeout_score, slot.use_processes))
        return cls(slots)

    # ---- scoring ---------------------------------------------------------------------------

    @property
    def names(self) -> list[str]:
        return [slot.name for slot in self.slots]

    def score(
        self,
        prompts: list[str],
        responses: list[str],
        columns: dict[str, list] | None = None,
        response_ids: list[list[int]] | None = None,
    ) -> RewardResult:
        """Scores a batch: one prompt, one response and one value of each column per sample.
        `timing/reward` is the wall time of this call."""
        start = time.perf_counter()
        batch = Batch.make(prompts, responses, columns, response_ids)
        per_slot = [slot.score(batch) for slot in self.slots]
        result = assemble_result(self.slots, per_slot, len(batch))
        result.metrics["timing/reward"] = time.perf_counter() - start
        return result

    def stream(self, columns: dict[str, list] | None = None, num_workers: int | None = None) -> StreamingScorer:
        """A scorer fed one finished response at a time; see `StreamingScorer`. `num_workers`
        (default: each component's own, else auto) threads per component."""
        return StreamingScorer(self.slots, columns, num_workers)

    # ---- state -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The state of every stateful component (e.g. a reward model's running statistics), by name."""
        return {slot.name: slot.component.state_dict() for slot in self.slots
                if isinstance(slot.component, StatefulComponent)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for slot in self.slots:
            if slot.name in state:
                slot.component.load_state_dict(state[slot.name])

    @contextmanager
    def frozen_state(self) -> Iterator[None]:
        """Scores inside leave no trace in component state (for evaluation): it is restored on exit."""
        saved = copy.deepcopy(self.state_dict())
        try:
            yield
        finally:
            self.load_state_dict(saved)

    def close(self) -> None:
        """Stops idle worker processes (those of `use_processes=True` components)."""
        for slot in self.slots:
            slot.close()

    def __repr__(self) -> str:
        return "RewardEngine(" + " + ".join(f"{slot.weight:g}*{slot.name}" for slot in self.slots) + ")"
