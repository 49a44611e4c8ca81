"""Reward functions from references ("pkg.module:attr", "path/to/file.py:attr") and spec entries."""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from hybridrl.reward.functions import raise_site
from hybridrl.reward.scorers import BUILTIN_SCORERS, get_builtin
from hybridrl.reward.types import RewardError

SPEC_KEYS = {
    "name": "a built-in scorer's name; with 'function', the component's name",
    "function": "'package.module:attr' or 'path/to/file.py:attr'",
    "weight": "the component's weight in the sum (default 1.0)",
    "kwargs": "fixed keyword arguments passed on every call",
    "timeout_s": "per-sample deadline in seconds",
    "num_workers": "worker threads (or processes) for per-sample calls",
    "timeout_score": "the score of a sample that timed out (default 0.0)",
    "use_processes": "run per-sample calls in worker processes",
}


@dataclass
class SpecEntry:
    """One parsed spec entry: the function and how the engine should run and weight it."""

    fn: Callable
    name: str | None  # None: the function's own name
    weight: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)
    timeout_s: float | None = None
    num_workers: int = 0
    timeout_score: float = 0.0
    use_processes: bool = False


def _did_you_mean(word: str, options) -> str:
    hint = difflib.get_close_matches(word, list(options), n=1)
    return f" (did you mean {hint[0]!r}?)" if hint else ""


def _import_module(module_name: str, ref: str) -> ModuleType:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise RewardError(f"cannot import module {module_name!r} for reward function {ref!r}: {exc}. Install it "
                              "or put it on PYTHONPATH, or give a file path 'path/to/file.py:attr'") from exc
        raise RewardError(f"importing module {module_name!r} for reward function {ref!r} failed: {exc}") from exc
    except Exception as exc:
        raise RewardError(f"importing module {module_name!r} for reward function {ref!r} raised "
                          f"{type(exc).__name__}: {exc} [at {raise_site(exc)}]") from exc


def _load_file(file_part: str, ref: str, base_dir: str | Path | None) -> ModuleType:
    path = Path(file_part).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    path = path.resolve()
    if not path.is_file():
        raise RewardError(f"reward function file {file_part!r} (from {ref!r}) does not exist: looked for {path}")
    module_name = f"hybridrl_reward_file_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if module_name in sys.modules:  # loading one file twice gives the same functions
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise RewardError(f"cannot load {path} as a Python module (from {ref!r}); it must be a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise RewardError(f"loading reward file {path} (from {ref!r}) raised {type(exc).__name__}: {exc} "
                          f"[at {raise_site(exc)}]") from exc
    return module


def load_function(ref: str, base_dir: str | Path | None = None) -> Callable:
    """The callable named by `ref`: "pkg.module:attr" (imported) or "path/file.py:attr" (loaded from
    the file; a relative path is taken from `base_dir`, else the working directory)."""
    source, sep, attr = ref.rpartition(":")
    if not sep or not source or not attr:
        raise RewardError(f"reward function reference {ref!r} must look like 'package.module:function' "
                          "or 'path/to/file.py:function'")
    is_file = source.endswith(".py") or "/" in source or "\\" in source
    module = _load_file(source, ref, base_dir) if is_file else _import_module(source, ref)
    where = getattr(module, "__file__", source)
    if not hasattr(module, attr):
        public = sorted(name for name, value in vars(module).items() if not name.startswith("_") and callable(value))
        raise RewardError(f"{where} has no attribute {attr!r} (from {ref!r}){_did_you_mean(attr, public)}; "
                          f"its public callables: {', '.join(public) or 'none'}")
    fn = getattr(module, attr)
    if not callable(fn):
        raise RewardError(f"{ref!r} is a {type(fn).__name__}, not a function; point it at a callable")
    return fn


def _number(entry: dict, key: str, where: str, default: Any) -> Any:
    value = entry.get(key, default)
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if value is not None and not (is_number and math.isfinite(value)):
        raise RewardError(f"{where}: {key!r} must be a finite number, got {value!r}")
    return value


def parse_entry(entry: Any, index: int, base_dir: str | Path | None = None) -> SpecEntry:
    """One spec entry, checked: {"name": builtin} or {"function": ref, "name": label?}, plus settings."""
    where = f"reward spec entry {index}"
    if not isinstance(entry, dict):
        raise RewardError(f"{where} must be a dict such as {{'name': 'gsm8k', 'weight': 1.0}}, "
                          f"got {type(entry).__name__} {entry!r}")
    for key in entry:
        if key not in SPEC_KEYS:
            raise RewardError(f"{where} has unknown key {key!r}{_did_you_mean(str(key), SPEC_KEYS)}; allowed keys: "
                              + "; ".join(f"{k} ({doc})" for k, doc in SPEC_KEYS.items()))
    kwargs = entry.get("kwargs") or {}
    if not isinstance(kwargs, dict):
        raise RewardError(f"{where}: 'kwargs' must be a dict of keyword arguments, got {kwargs!r}")
    if "function" not in entry and "name" not in entry:
        raise RewardError(f"{where} needs 'name' (a built-in scorer: {', '.join(BUILTIN_SCORERS)}) or 'function' "
                          "('package.module:attr' or 'path/to/file.py:attr'); got keys " + str(sorted(entry)))
    try:
        if "function" in entry:
            fn, name = load_function(str(entry["function"]), base_dir), entry.get("name")
        else:
            fn, name = get_builtin(str(entry["name"]), kwargs), entry["name"]
    except RewardError as exc:  # say which entry
        raise RewardError(f"{where}: {exc}") from exc
    return SpecEntry(
        fn=fn,
        name=name,
        weight=_number(entry, "weight", where, 1.0),
        kwargs=kwargs,
        timeout_s=_number(entry, "timeout_s", where, None),
        num_workers=entry.get("num_workers", 0),
        timeout_score=_number(entry, "timeout_score", where, 0.0),
        use_processes=bool(entry.get("use_processes", False)),
    )
