"""Units, read and written the same way everywhere: memory sizes, compute capabilities,
durations, counts (``parse_amount``), the quantile that medians and spreads come from,
and text wrapped without breaking a number from its unit. Pure functions."""

from __future__ import annotations

import ast
import contextlib
import math
import re
import textwrap
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

__all__ = [
    "format_bytes",
    "format_rate",
    "format_time",
    "parse_amount",
    "parse_capability",
    "parse_size",
    "quantile",
    "wrap_text",
]


_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}


def parse_size(value: int | float | str) -> int:
    """Bytes from an int or a human string: ``4096``, ``"512MiB"``, ``"40 GiB"``, ``"1.5GB"``.

    Raises :class:`ValueError` with the accepted forms when ``value`` is not a size.
    """
    if isinstance(value, bool):
        raise ValueError(f"not a memory size: {value!r}")
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError(f"memory size must not be negative: {value!r}")
        return int(value)
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError(
            f"not a memory size: {value!r}; use bytes or a number with a unit "
            "such as '512MiB', '40GiB' or '1.5GB'"
        )
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def parse_capability(value: tuple[int, int] | str | float) -> tuple[int, int]:
    """A compute capability from ``(8, 0)``, ``"8.0"``, ``"sm_80"`` or ``8.0``."""
    if isinstance(value, tuple):
        if len(value) == 2 and all(isinstance(v, int) and v >= 0 for v in value):
            return (value[0], value[1])
        raise ValueError(f"not a compute capability: {value!r}; use (major, minor) like (8, 0)")
    text = str(value).strip().lower()
    match = re.fullmatch(r"(?:sm_?)?(\d+)(?:\.(\d))?", text)
    if match is None:
        raise ValueError(f"not a compute capability: {value!r}; use (8, 0), '8.0' or 'sm_80'")
    if match.group(2) is None:
        digits = match.group(1)
        if text.startswith("sm") and len(digits) >= 2:
            return (int(digits[:-1]), int(digits[-1]))
        return (int(digits), 0)
    return (int(match.group(1)), int(match.group(2)))


def format_bytes(n: float) -> str:
    """``1536`` → ``"1.5 KiB"``; binary units, one decimal, sign kept."""
    sign = "-" if n < 0 else ""
    value = float(abs(n))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            if unit == "B":
                return f"{sign}{int(value)} B"
            return f"{sign}{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_rate(value: float, unit: str) -> str:
    """``6.66e14, "FLOP/s"`` → ``"666 TFLOP/s"``: decimal prefixes, three significant
    digits (also for counts: ``1.37e11, "FLOP"`` → ``"137 GFLOP"``)."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile with linear interpolation (numpy's default), ``nan`` if empty."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    position = (len(ordered) - 1) * q
    low = math.floor(position)
    high = math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def format_time(seconds: float | None, precision: int = 3) -> str:
    """``170 µs``, ``1.23 ms``, ``2.5 s`` with ``precision`` significant digits."""
    if seconds is None or math.isnan(seconds):
        return "n/a"
    if seconds == 0:
        return "0 s"
    seconds = float(f"{seconds:.{precision}g}")  # 999.9 ns rounds to 1 µs, not "1e+03 ns"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(seconds) >= scale:
            return f"{seconds / scale:.{precision}g} {unit}"
    return f"{seconds / 1e-9:.{precision}g} ns"


_OPERATORS: dict[type, Callable[[float, float], float]] = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}


def parse_amount(text: str, *, sizes: bool = False) -> float:
    """A positive count from ``"1.2e12"``, ``"2*4096**3"`` or, with ``sizes``, ``"3GiB"``.

    Only numbers and ``+ - * / **`` are evaluated; :class:`ValueError` says what is accepted.
    """
    accepted = "a number or arithmetic of numbers such as 2*4096**3"
    if text.strip().startswith("-"):
        raise ValueError(f"{text!r} is not a positive count: use {accepted}")
    if sizes:
        accepted += ", or a size such as 512MiB"
        with contextlib.suppress(ValueError):
            if text.strip() and not text.strip()[-1].isdigit():
                return float(parse_size(text))

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return float(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            inner = value(node.operand)
            return -inner if isinstance(node.op, ast.USub) else inner
        if isinstance(node, ast.BinOp):
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow):
                if abs(right) > 64:
                    raise ValueError("exponent too large")
                return float(left**right)
            operator = _OPERATORS.get(type(node.op))
            if operator is not None:
                return operator(left, right)
        raise ValueError(type(node).__name__)

    try:
        result = value(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as exc:
        raise ValueError(f"{text!r} is not a count: use {accepted}") from exc
    if not (result > 0 and math.isfinite(result)):
        raise ValueError(f"{text!r} is not a positive count: use {accepted}")
    return result


_NBSP = "\u00a0"  # no-break space: textwrap does not break at it
#: A number and the unit after it ("60.0 MiB", "220 µs", "5 %"): kept on one line.
_NUMBER_UNIT = re.compile(r"(\d) (%|[KMGT]i?B\b|[mµnk]?s\b|B\b|[KMGT]?Hz\b)")


def wrap_text(text: str, **options: Any) -> list[str]:
    """``textwrap.wrap(text, **options)``, never breaking a number from its unit or ``%``
    ("60.0 MiB", "220 µs", "5 %")."""
    joined = _NUMBER_UNIT.sub(lambda m: m[1] + _NBSP + m[2], text)
    return [line.replace(_NBSP, " ") for line in textwrap.wrap(joined, **options)]
