"""Calling reward functions the way their signatures ask, and checking what they return.

Two conventions are supported without any change to the user's function:

* native: `fn(prompts, responses, **columns)` (by position, or by keyword if it names `responses`);
* TRL: `fn(prompts=..., completions=..., completion_ids=..., **columns)`, as TRL's GRPOTrainer
  calls reward functions, e.g. `def f(completions, **kwargs)` or `def f(prompts, completions,
  ground_truth, **kwargs)`.

The signature is inspected once; each call passes only the keywords the function accepts (all of
them if it has `**kwargs`).
"""

from __future__ import annotations

import asyncio
import difflib
import functools
import inspect
import math
import numbers
import os
import re
import sys
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from hybridrl.reward.types import Batch, RewardComponent, RewardError

FIX = "the reward function must return one finite float per response (or None where it does not apply)"
_CLIP_CHARS = 200


@dataclass(frozen=True)
class _Convention:
    """How to call one function: which style, and which keywords it accepts."""

    style: str  # "trl" (completions=), "native" (responses=) or "positional" (first two by position)
    named: frozenset[str]  # keyword-passable parameter names, minus those filled by position
    required: frozenset[str]  # of `named`, those without a default
    var_kw: bool  # has **kwargs: accepts every column

    def accepts(self, key: str) -> bool:
        return self.var_kw or key in self.named


def _inspect_convention(fn: Callable, who: str) -> _Convention:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins and C callables have no signature
        return _Convention("positional", frozenset(), frozenset(), var_kw=True)
    params = list(sig.parameters.values())
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    by_keyword = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    names = {p.name for p in by_keyword}
    if "completions" in names:
        style, by_position = "trl", set()
    elif "responses" in names:
        style, by_position = "native", set()
    elif var_kw and all(p.default is not p.empty for p in positional):  # e.g. def f(**kwargs)
        style, by_position = "trl", set()
    elif len(positional) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in params):
        style, by_position = "positional", {p.name for p in positional[:2]}
    else:
        raise RewardError(
            f"reward function {who} has signature {sig} and cannot receive the responses; write it as "
            "fn(prompts, responses, **columns) or in TRL form fn(completions, **kwargs)"
        )
    named = frozenset(names - by_position)
    required = frozenset(p.name for p in by_keyword if p.name in named and p.default is p.empty)
    return _Convention(style, named, required, var_kw)


def default_name(fn: Callable) -> str:
    """A metric-friendly name: the function's name (`<lambda>` becomes `lambda`)."""
    target = fn.func if isinstance(fn, functools.partial) else fn
    name = getattr(target, "__name__", None) or type(target).__name__
    return re.sub(r"[^A-Za-z0-9_.-]", "", name) or "reward"


def _location(obj: Any) -> str:
    target = inspect.unwrap(obj.func if isinstance(obj, functools.partial) else obj)
    if not (inspect.isfunction(target) or inspect.ismethod(target) or inspect.isclass(target)):
        target = type(target)
    try:
        path = inspect.getsourcefile(target)
        line = inspect.getsourcelines(target)[1]
    except (TypeError, OSError):  # builtins, or source not on disk: say where the name comes from
        return f"defined in {getattr(target, '__module__', '?')}"
    return f"{_short_path(path)}:{line}"


def _short_path(path: str | None) -> str:
    if path is None:
        return "?"
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def describe(component: RewardComponent) -> str:
    """`module.qualname (file.py:line)` of the user's function, or the component's class."""
    target = component.fn if isinstance(component, FunctionReward) else component
    inner = target.func if isinstance(target, functools.partial) else target
    if not (inspect.isfunction(inner) or inspect.ismethod(inner) or inspect.isbuiltin(inner)):
        inner = type(inner)
    qualname = f"{getattr(inner, '__module__', '?')}.{getattr(inner, '__qualname__', repr(inner))}"
    return f"{qualname} ({_location(target)})"


class FunctionReward:
    """A plain function as a `RewardComponent`, called with the convention its signature asks for.

    `kwargs` are fixed keyword arguments passed on every call (e.g. a scorer's `format_score`).
    """

    def __init__(self, fn: Callable, name: str | None = None, kwargs: dict[str, Any] | None = None):
        if not callable(fn):
            raise RewardError(f"a reward function must be callable, got {type(fn).__name__}: {fn!r}")
        self.fn = fn
        self.name = name or default_name(fn)
        self.kwargs = dict(kwargs or {})
        self._convention = _inspect_convention(fn, describe(self))
        for key in self.kwargs:
            if not self._convention.accepts(key):
                hint = difflib.get_close_matches(key, self._convention.named, n=1)
                raise RewardError(
                    f"reward function {describe(self)} got kwarg {key!r} it does not accept"
                    + (f" (did you mean {hint[0]!r}?)" if hint else "")
                    + f"; it accepts: {', '.join(sorted(self._convention.named)) or 'none'}"
                )

    def __call__(self, prompts: list[str], responses: list[str], **columns: Any) -> Any:
        args, kwargs = self._arguments(prompts, responses, columns)
        out = self.fn(*args, **kwargs)
        if inspect.iscoroutine(out):  # TRL also accepts `async def` reward functions
            out = asyncio.run(out)
        return out

    def _arguments(self, prompts: list[str], responses: list[str], columns: dict[str, Any]):
        conv = self._convention
        response_ids = columns.pop("response_ids", None)
        clash = sorted(set(columns) & set(self.kwargs))
        if clash:
            raise RewardError(f"reward function {describe(self)}: column(s) {clash} clash with its fixed kwargs; "
                              "rename the column or the kwarg")
        kwargs: dict[str, Any] = {}
        args: list[Any] = []
        if conv.style == "positional":
            args = [prompts, responses]
        else:
            if conv.accepts("prompts"):
                kwargs["prompts"] = prompts
            kwargs["completions" if conv.style == "trl" else "responses"] = responses
        if response_ids is not None:  # under each name it declares; through **kwargs under its style's name
            style_key = "completion_ids" if conv.style == "trl" else "response_ids"
            for key in ("completion_ids", "response_ids"):
                if key in conv.named or (conv.var_kw and key == style_key):
                    kwargs[key] = response_ids
        kwargs.update({key: value for key, value in columns.items() if conv.accepts(key)})
        kwargs.update(self.kwargs)
        missing = sorted(conv.required - set(kwargs))
        if {"completion_ids", "response_ids"} & set(missing):
            raise RewardError(f"reward function {describe(self)} needs token ids ({missing}); pass "
                              "response_ids= to score() / submit()")
        if missing:
            raise RewardError(
                f"reward function {describe(self)} needs argument(s) {missing}, which are neither data columns "
                f"(got: {sorted(columns) or 'none'}) nor fixed kwargs; add the column to the dataset, or pass "
                "the value as a kwarg (from_builtin(name, key=value), or 'kwargs' in a spec entry)"
            )
        return args, kwargs

    def __repr__(self) -> str:
        return f"FunctionReward({self.name!r}, {describe(self)})"


def call_component(component: RewardComponent, batch: Batch) -> Any:
    """One raw call: `component(prompts, responses, **columns, [response_ids=...])`."""
    return component(batch.prompts, batch.responses, **batch.call_kwargs())


def _clip(text: Any) -> str:
    text = str(text)
    return repr(text if len(text) <= _CLIP_CHARS else text[:_CLIP_CHARS] + "...")


def _sample(batch: Batch, local: int, index: int) -> str:
    return f"sample {index} (prompt: {_clip(batch.prompts[local])}, response: {_clip(batch.responses[local])})"


def raise_site(exc: BaseException) -> str | None:
    """`file:line in func` of the frame that raised `exc`, if its traceback survived."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return None
    last = frames[-1]
    return f"{_short_path(last.filename)}:{last.lineno} in {last.name}"


def function_error(
    component: RewardComponent, batch: Batch, local: int, index: int, exc: BaseException, where: str | None = None
) -> RewardError:
    """The error for `component` raising `exc` on one sample."""
    if isinstance(exc, RewardError):  # already names the function and the fix (e.g. a missing column)
        return exc
    where = where or raise_site(exc)
    return RewardError(
        f"reward function {describe(component)} raised {type(exc).__name__}: {exc} on {_sample(batch, local, index)}"
        + (f" [raised at {where}]" if where else "")
        + f". Fix the function; {FIX}"
    )


def _locate_failure(component: RewardComponent, batch: Batch, exc: Exception) -> RewardError:
    """Re-runs a failed batch one sample at a time to name the sample that fails."""
    for i in range(len(batch)):
        try:
            call_component(component, batch.sample(i))
        except Exception as sample_exc:
            return function_error(component, batch, i, i, sample_exc)
    where = raise_site(exc)
    return RewardError(
        f"reward function {describe(component)} raised {type(exc).__name__}: {exc} on the batch of "
        f"{len(batch)} responses" + (f" [raised at {where}]" if where else "")
        + ", but no response fails when scored alone: the function depends on the batch (its size or mix)."
        f" Fix the function; {FIX}"
    )


def _as_list(raw: Any) -> list | None:
    if isinstance(raw, (list, tuple)):
        return list(raw)
    if isinstance(raw, np.ndarray) and raw.ndim == 1:
        return raw.tolist()
    torch = sys.modules.get("torch")  # a tensor can only come back if torch is already imported
    if torch is not None and isinstance(raw, torch.Tensor) and raw.dim() == 1:
        return raw.tolist()
    return None


def check_scores(
    component: RewardComponent, raw: Any, batch: Batch, indices: list[int] | None = None
) -> list[float | None]:
    """Checks `raw` is one finite float (or None) per response; `indices` are the global sample ids."""
    indices = list(range(len(batch))) if indices is None else indices
    values = _as_list(raw)
    if values is None:
        raise RewardError(f"reward function {describe(component)} returned {type(raw).__name__} ({_clip(raw)}), "
                          f"expected a list of {len(batch)} floats; {FIX}")
    if len(values) != len(batch):
        raise RewardError(f"reward function {describe(component)} returned {len(values)} scores for "
                          f"{len(batch)} responses (expected {len(batch)}, got {len(values)}); {FIX}")
    out: list[float | None] = []
    for local, value in enumerate(values):
        if value is None:
            out.append(None)
            continue
        if not isinstance(value, numbers.Real):
            raise RewardError(f"reward function {describe(component)} returned {type(value).__name__} "
                              f"{_clip(value)} for {_sample(batch, local, indices[local])}; {FIX}")
        value = float(value)
        if not math.isfinite(value):
            raise RewardError(f"reward function {describe(component)} returned {value} for "
                              f"{_sample(batch, local, indices[local])}; {FIX}")
        out.append(value)
    return out


def score_in_caller(component: RewardComponent, batch: Batch) -> list[float | None]:
    """Scores the whole batch in one call on this thread; on failure names the failing sample."""
    try:
        raw = call_component(component, batch)
    except RewardError:
        raise
    except Exception as exc:
        raise _locate_failure(component, batch, exc) from exc
    return check_scores(component, raw, batch)
