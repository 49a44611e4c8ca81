"""Load a `Config` from YAML and `key=value` overrides, with errors that say what to fix."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
import warnings
from pathlib import Path
from typing import Any, Iterable

import yaml

from hybridrl.config.schema import Config


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the key and the fix."""


# Deprecated dotted key -> (its replacement, the replacement's value as a function of the old value).
DEPRECATED_KEYS: dict[str, tuple[str, Any]] = {
    "train.fp32_master_weights": ("train.master_weights", lambda old: "fp32" if old else "none"),
}


def load_config(path: str | Path | None = None, overrides: Iterable[str] = ()) -> Config:
    """Reads a YAML file (optional), applies dotted `key=value` overrides, validates once."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = read_yaml(path)
    return _build(raw, overrides)


def apply_overrides(config: Config, overrides: Iterable[str]) -> Config:
    """A copy of `config` with dotted `key=value` overrides applied, checked as `load_config` checks them."""
    return _build(to_dict(config), overrides)


def _build(raw: dict[str, Any], overrides: Iterable[str]) -> Config:
    from hybridrl.config.validate import validate_config

    for item in overrides:
        key, value = parse_override(item)
        set_dotted(raw, key, value)
    upgrade_deprecated_keys(raw)
    config = from_dict(Config, raw, prefix="")
    validate_config(config)
    return config


def upgrade_deprecated_keys(raw: dict[str, Any], *, warn: bool = True) -> dict[str, Any]:
    """Replaces deprecated keys of a raw config dict (in place) by their replacements, with a FutureWarning."""
    for old, (new, convert) in DEPRECATED_KEYS.items():
        section, key = old.split(".")
        node = raw.get(section)
        if not isinstance(node, dict) or key not in node:
            continue
        value = node.pop(key)
        if not isinstance(value, bool):
            raise ConfigError(f"{old} must be true or false, got {value!r}; it is deprecated: set {new} instead")
        replacement, new_key = convert(value), new.split(".")[1]
        if new_key in node and node[new_key] != replacement:
            raise ConfigError(f"{old}={str(value).lower()} contradicts {new}={node[new_key]!r}; remove {old} (deprecated)")
        node[new_key] = replacement
        if warn:
            warnings.warn(f"config key {old} is deprecated: use {new}={replacement}", FutureWarning, stacklevel=3)
    return raw


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist (looked in {Path.cwd()}); pass the path of a YAML file such as examples/arith_grpo.yaml")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(
            f"config file {path} is not valid YAML{where}: {getattr(e, 'problem', None) or e}. Fix the syntax (brackets, "
            "quotes, indentation); tags such as !!python/... are refused: a config is data and is never executed"
        ) from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text: {e}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections (model:, data:, ...), got {type(raw).__name__}")
    return raw


def parse_override(item: str) -> tuple[str, Any]:
    """`train.lr=1e-5` -> ("train.lr", 1e-5); values are parsed as YAML scalars."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like section.key=value, e.g. train.lr=1e-5")
    key, _, text = item.partition("=")
    key = key.strip()
    if not key:
        raise ConfigError(f"override {item!r} has no key before '='")
    try:
        value = yaml.safe_load(text) if text.strip() else ""  # write key=null for None
    except yaml.YAMLError:
        value = text
    return key, value


def set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    node = raw
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {key}: {part!r} is a value, not a section")
        node = child
    node[parts[-1]] = value


def to_dict(config: Any) -> dict[str, Any]:
    """A plain, YAML-safe dict of a config (tuples become lists)."""
    def convert(value: Any) -> Any:
        if dataclasses.is_dataclass(value):
            return {f.name: convert(getattr(value, f.name)) for f in dataclasses.fields(value)}
        if isinstance(value, (list, tuple)):
            return [convert(v) for v in value]
        if isinstance(value, dict):
            return {k: convert(v) for k, v in value.items()}
        return value

    return convert(config)


def diff_configs(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """Lines `key: old -> new` for every leaf that differs between two config dicts."""
    lines = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, "<absent>"), new.get(key, "<absent>")
        name = f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            lines.extend(diff_configs(a, b, name + "."))
        elif a != b:
            lines.append(f"{name}: {a!r} -> {b!r}")
    return lines


def from_dict(cls: type, raw: Any, prefix: str) -> Any:
    """Builds dataclass `cls` from a dict, checking keys and value types."""
    where = prefix.rstrip(".") or "the config"
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a mapping, got {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    unknown = [k for k in raw if k not in fields]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(str(key), list(fields), n=1)
        hint = f"did you mean {prefix}{close[0]}?" if close else f"valid keys: {', '.join(fields)}"
        raise ConfigError(f"unknown config key {prefix}{key}: {hint}")
    values = {}
    for name, value in raw.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            values[name] = from_dict(hint, value, f"{prefix}{name}.")
        else:
            values[name] = coerce(value, hint, f"{prefix}{name}")
    return cls(**values)


def coerce(value: Any, hint: Any, key: str) -> Any:
    """Checks `value` against a type hint, allowing int -> float and list -> tuple."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key}: invalid value {value!r}")
    if hint is Any:
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(f"{key} must have {len(args)} items, got {value!r}")
            return tuple(coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        inner = args[0] if args else Any
        return [coerce(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping, got {value!r}")
        return dict(value)
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{key} must be an integer, got {value!r}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key} must be a number, got {value!r}")
    if hint is str:
        if isinstance(value, bool):  # YAML 1.1 reads unquoted off/on/no/yes as booleans
            return "on" if value else "off"
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key} must be a string, got {value!r}")
    return value
