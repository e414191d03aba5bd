"""What a leak check leaves on a test's teardown report, typed.

The checker (:mod:`pytest_cuda.leak_checker`) writes a :class:`LeakReport` and the
test's peaks onto the report; the glue (:mod:`pytest_cuda.leak_plugin`) reads them for
the outcome and the terminal summary. Reports cross from xdist workers to the
controller as plain data, so the report attribute holds :meth:`LeakReport.to_dict`.
A leaf module: both sides import it, never each other for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pytest

__all__ = ["MARKER", "REPORT_LEAK", "REPORT_PEAK", "LeakReport", "leak_report", "peaks"]

#: The marker that asks for (or switches off) the check of one test.
MARKER = "cuda_leak_check"
#: Attributes on teardown reports (plain data, so they cross from xdist workers).
REPORT_LEAK = "cuda_leak"
REPORT_PEAK = "cuda_peak"

Amounts = tuple[tuple[int, int], ...]  # (device, bytes), by device


@dataclass(frozen=True)
class LeakReport:
    """One checked test's result: what leaked, what libraries kept by design, the text."""

    mode: str  # "fail" or "warn"
    leaked: Amounts
    kept: tuple[tuple[str, Amounts], ...]  # (settle step, what it released)
    details: str = ""
    top: str | None = None  # the user's line that allocated the most of the leak
    failed_by_leak: bool = False
    holder: str | None = None  # who holds the most of it: "mymod.CACHE['x'] (module global)"

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "leaked": [list(pair) for pair in self.leaked],
            "kept": [[step, [list(pair) for pair in freed]] for step, freed in self.kept],
            "details": self.details,
            "top": self.top,
            "failed_by_leak": self.failed_by_leak,
            "holder": self.holder,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LeakReport:
        return cls(
            mode=str(data["mode"]),
            leaked=tuple((int(d), int(b)) for d, b in data["leaked"]),
            kept=tuple(
                (str(step), tuple((int(d), int(b)) for d, b in freed))
                for step, freed in data["kept"]
            ),
            details=str(data.get("details", "")),
            top=data.get("top"),
            failed_by_leak=bool(data.get("failed_by_leak", False)),
            holder=data.get("holder"),
        )


def leak_report(report: pytest.TestReport) -> LeakReport | None:
    """The leak result a report carries, or ``None``."""
    data = getattr(report, REPORT_LEAK, None)
    return LeakReport.from_dict(data) if isinstance(data, dict) else None


def peaks(report: pytest.TestReport) -> list[tuple[int, int, int]]:
    """``(device, peak, start)`` for each device a checked test used, or nothing."""
    rows = getattr(report, REPORT_PEAK, None) or ()
    return [(int(device), int(peak), int(start)) for device, peak, start in rows]
