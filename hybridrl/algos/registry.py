"""A name -> object registry, so algorithms are picked by name from config, never by if-chains."""

from __future__ import annotations

import difflib
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to functions (or classes) of one kind, e.g. advantage estimators."""

    def __init__(self, kind: str):
        self.kind = kind  # what the entries are, used in error messages ("advantage estimator")
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: `@REGISTRY.register("grpo")` adds the decorated object under `name`."""

        def decorator(obj: T) -> T:
            if name in self._entries:
                raise ValueError(
                    f"{self.kind} {name!r} is already registered; pick another name "
                    f"(taken: {', '.join(self.names())})"
                )
            self._entries[name] = obj
            return obj

        return decorator

    def get(self, name: str) -> T:
        """The entry registered as `name`; ValueError listing the valid names otherwise."""
        if name not in self._entries:
            message = f"unknown {self.kind} {name!r}; valid names: {', '.join(self.names())}"
            close = difflib.get_close_matches(str(name), self.names(), n=1)
            if close:
                message += f". Did you mean {close[0]!r}?"
            raise ValueError(message)
        return self._entries[name]

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={self.names()})"
