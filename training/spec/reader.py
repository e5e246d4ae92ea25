"""Parsing and validation: ``_Reader`` and the small value readers built on it."""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import fields
from enum import StrEnum
from typing import Any, TypeVar, cast

_T = TypeVar("_T")


class _Reader:
    """Reads typed values out of TOML tables, collecting every problem with its field path."""

    def __init__(self) -> None:
        self.problems: list[str] = []
        self._path: list[str] = []

    def where(self, key: str | None = None) -> str:
        parts = [*self._path, key] if key else self._path
        out = ""
        for p in parts:
            out += p if p.startswith("[") or not out else f".{p}"
        return out or "(top level)"

    def problem(self, key: str | None, message: str) -> None:
        self.problems.append(f"{self.where(key)}: {message}")

    @contextmanager
    def at(self, key: str) -> Iterator[None]:
        self._path.append(key)
        try:
            yield
        finally:
            self._path.pop()

    def check_keys(
        self, table: Mapping[str, Any], cls: Any, internal: tuple[str, ...] = ()
    ) -> None:
        allowed = {f.name for f in fields(cls)} - set(internal)
        for key in table:
            if key not in allowed:
                close = difflib.get_close_matches(key, sorted(allowed), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                self.problem(key, f"unknown key{hint}; valid keys: {', '.join(sorted(allowed))}")

    def get(
        self, table: Mapping[str, Any], key: str, kind: type[_T] | tuple[type, ...], default: _T
    ) -> _T:
        if key not in table:
            return default
        value = table[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        # TOML integers are valid floats; bools are not ints here.
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
            names = " or ".join(k.__name__ for k in kinds)
            self.problem(key, f"expected {names}, got {type(value).__name__} {value!r}")
            return default
        return cast(_T, value)

    def positive(self, table: Mapping[str, Any], key: str, default: int, minimum: int = 1) -> int:
        value: int = self.get(table, key, int, default)
        if isinstance(value, int) and value < minimum:
            self.problem(key, f"must be at least {minimum}, got {value}")
            return default
        return value

    def choice(self, table: Mapping[str, Any], key: str, enum: type[StrEnum], default: Any) -> Any:
        raw = self.get(table, key, str, None)
        if raw is None:
            return default
        try:
            return enum(raw)
        except ValueError:
            valid = ", ".join(repr(e.value) for e in enum)
            self.problem(key, f"{raw!r} is not valid; use one of {valid}")
            return default

    def table(self, table: Mapping[str, Any], key: str) -> Mapping[str, Any]:
        value = table.get(key, {})
        if not isinstance(value, dict):
            self.problem(key, f"expected a table ([{key}]), got {type(value).__name__}")
            return {}
        return value


def _fraction(
    r: _Reader,
    t: Mapping[str, Any],
    key: str,
    default: float,
    *,
    low: float = 0.0,
    high: float = 1.0,
    low_open: bool = False,
) -> float:
    """A float in [low, high] (or (low, high] with ``low_open``)."""
    value = r.get(t, key, float, default)
    if not isinstance(value, float):
        return default
    if not (low < value if low_open else low <= value) or not value <= high:
        left = "(" if low_open else "["
        r.problem(key, f"must be in {left}{low:g}, {high:g}], got {value:g}")
        return default
    return value


def _pair(r: _Reader, t: Mapping[str, Any], key: str, *, low: float) -> tuple[float, float] | None:
    raw = r.get(t, key, list, None)
    if raw is None:
        return None
    if (
        len(raw) != 2
        or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in raw)
        or not low <= raw[0] <= raw[1]
    ):
        r.problem(key, f"expected [min, max] with {low:g} <= min <= max, got {raw!r}")
        return None
    return float(raw[0]), float(raw[1])


def _cap(r: _Reader, t: Mapping[str, Any], key: str, unit: str) -> float | None:
    """A budget cap: a positive, finite number, or None when left out."""
    value = r.get(t, key, float, None)
    if value is None:
        return None
    if not math.isfinite(value) or value <= 0:
        r.problem(key, f"must be a positive number of {unit}, got {value!r}; remove it for no cap")
        return None
    return value
