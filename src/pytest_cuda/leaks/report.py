"""What a leak check leaves on a test's teardown report, typed.

The checker (:mod:`pytest_cuda.leaks.checker`) writes a :class:`LeakReport` and the
test's peaks onto the report; the glue (:mod:`pytest_cuda.leaks.plugin`) reads them for
the outcome and the terminal summary. Reports cross from xdist workers to the
controller as plain data, so the report attribute holds :meth:`LeakReport.to_dict`.
A leaf module: both sides import it, never each other for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pytest

__all__ = [
    "MARKER",
    "REPORT_LEAK",
    "REPORT_PEAK",
    "LeakReport",
    "json_report",
    "leak_report",
    "peaks",
]

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
    tolerance: int = 0

    @property
    def verdict(self) -> str:
        """``leaked`` (fails), ``warned``, ``kept`` (what grew was released or kept by
        a library by design) or ``clean``."""
        if self.leaked:
            return "leaked" if self.mode == "fail" else "warned"
        return "kept" if any(freed for _, freed in self.kept) else "clean"

    def properties(self) -> list[tuple[str, str]]:
        """The verdict as JUnit XML properties (``record_property``'s form)."""
        found = [("cuda_leak_verdict", self.verdict), ("cuda_leak_tolerance", str(self.tolerance))]
        if self.leaked:
            found.append(("cuda_leak_bytes", ", ".join(f"cuda:{d}={b}" for d, b in self.leaked)))
        found += [("cuda_leak_line", self.top)] if self.top else []
        found += [("cuda_leak_holder", self.holder)] if self.holder else []
        return found

    def row(self, nodeid: str) -> dict[str, Any]:
        """One test's entry in the ``--cuda-leak-report`` JSON file."""
        return {
            "nodeid": nodeid,
            "verdict": self.verdict,
            "mode": self.mode,
            "tolerance": self.tolerance,
            "leaked": {f"cuda:{d}": b for d, b in self.leaked},
            "kept": [
                {"step": step, "bytes": {f"cuda:{d}": b for d, b in freed}}
                for step, freed in self.kept
                if freed
            ],
            "line": self.top,
            "holder": self.holder,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "leaked": [list(pair) for pair in self.leaked],
            "kept": [[step, [list(pair) for pair in freed]] for step, freed in self.kept],
            "details": self.details,
            "top": self.top,
            "failed_by_leak": self.failed_by_leak,
            "holder": self.holder,
            "tolerance": self.tolerance,
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
            tolerance=int(data.get("tolerance", 0)),
        )


def json_report(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``--cuda-leak-report`` document: every checked test's row (see
    :meth:`LeakReport.row`) and the totals."""
    counts = dict.fromkeys(("clean", "kept", "warned", "leaked"), 0)
    leaked: dict[str, int] = {}
    for row in rows:
        counts[row["verdict"]] += 1
        if row["verdict"] == "leaked":
            for device, amount in row["leaked"].items():
                leaked[device] = leaked.get(device, 0) + amount
    summary = {"checked": len(rows), **counts, "leaked_bytes": leaked}
    return {"version": 1, "tests": rows, "summary": summary}


def leak_report(report: pytest.TestReport) -> LeakReport | None:
    """The leak result a report carries, or ``None``."""
    data = getattr(report, REPORT_LEAK, None)
    return LeakReport.from_dict(data) if isinstance(data, dict) else None


def peaks(report: pytest.TestReport) -> list[tuple[int, int, int]]:
    """``(device, peak, start)`` for each device a checked test used, or nothing."""
    rows = getattr(report, REPORT_PEAK, None) or ()
    return [(int(device), int(peak), int(start)) for device, peak, start in rows]
