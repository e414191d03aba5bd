"""What a leak check leaves on a test's teardown report, typed.

One :class:`LeakReport` per check of a test: the pytest process's own, and one per
rank of a ``cuda_distributed`` test (``rank`` set), which the rank sends back as plain
data. The checker (:mod:`pytest_cuda.leaks.checker`) puts them on the teardown report
as a list of :meth:`LeakReport.to_dict` (attribute :data:`REPORT_LEAKS`: plain data,
so they cross from xdist workers to the controller); the glue
(:mod:`pytest_cuda.leaks.plugin`) reads them for the outcome, the JSON file and the
terminal summary. A leaf module: every side imports it, never each other for it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    import pytest

    from pytest_cuda.leaks.result import LeakResult

__all__ = [
    "LIMIT_MARKER",
    "MARKER",
    "REPORT_LEAKS",
    "REPORT_PEAK",
    "RERUN_OUT_ENV",
    "VERDICTS",
    "LeakReport",
    "json_report",
    "junit_properties",
    "leak_reports",
    "peaks",
    "worst",
]

#: The marker that asks for (or switches off) the check of one test.
MARKER = "cuda_leak_check"
#: The marker that sets one test's memory limit (:mod:`pytest_cuda.leaks.limit`).
LIMIT_MARKER = "cuda_limit_memory"
#: Attributes on teardown reports (plain data, so they cross from xdist workers).
REPORT_LEAKS = "cuda_leaks"
REPORT_PEAK = "cuda_peak"
#: Where a re-run child (:mod:`pytest_cuda.leaks.rerun`) writes its reports,
#: ``{nodeid: LeakReport.to_dict()}``, for the process that re-ran it.
RERUN_OUT_ENV = "PYTEST_CUDA_LEAK_RERUN_OUT"
#: A check's verdicts, the best first.
VERDICTS = ("clean", "kept", "warned", "leaked")

Amounts = tuple[tuple[int, int], ...]  # (device, bytes), by device


@dataclass(frozen=True)
class LeakReport:
    """One check's result: what leaked, what was kept, the text; plain data throughout,
    serialised from its fields (:meth:`to_dict`)."""

    #: ``"fail"`` or ``"warn"``.
    mode: str
    #: What is still allocated after the settling steps, per device: ``(device, bytes)``.
    leaked: Amounts
    #: What each settling step released (a library's cache, garbage collection):
    #: ``(step, ((device, bytes), ...))``; such memory is kept, not leaked.
    kept: tuple[tuple[str, Amounts], ...]
    #: The report's full text: the lines that allocated the leak and who holds it.
    details: str = ""
    #: The user's line that allocated the most of the leak (``file:line in function``).
    top: str | None = None
    #: Whether the leak failed the test (``mode="fail"`` and above the tolerance).
    failed_by_leak: bool = False
    #: Who holds the most of it: ``"mymod.CACHE['x'] (module global)"``.
    holder: str | None = None
    #: Bytes per device below which growth is not a leak.
    tolerance: int = 0
    #: The rank of a ``cuda_distributed`` test whose process was checked; ``None``: the
    #: pytest process itself.
    rank: int | None = None
    #: The one line a failure and a ``LEAKED`` line show (empty when nothing leaked).
    summary: str = ""

    @classmethod
    def of(
        cls,
        result: LeakResult | None,
        *,
        mode: str,
        tolerance: int,
        subject: str,
        root: str | None = None,
        rank: int | None = None,
    ) -> LeakReport:
        """The report of a check's result (``None``: nothing grew)."""
        if result is None:
            return cls(mode, (), (), tolerance=tolerance, rank=rank)
        rerun = result.rerun
        return cls(
            mode=mode,
            leaked=tuple(sorted(result.leaked.items())),
            kept=tuple(
                (step, tuple((d, b) for d, b in sorted(freed.items()) if b > 0))
                for step, freed in result.kept_by_libraries()
            ),
            details=result.details(subject, root) if result.leaked else "",
            top=result.top_frame(root) or (rerun.top if rerun else None),
            holder=result.holder() or (rerun.holder if rerun else None),
            tolerance=tolerance,
            rank=rank,
            summary=result.summary(subject, root) if result.leaked else "",
        )

    @property
    def verdict(self) -> str:
        """``leaked`` (fails), ``warned``, ``kept`` (what grew was released or kept by
        a library by design) or ``clean``."""
        if self.leaked:
            return "leaked" if self.mode == "fail" else "warned"
        return "kept" if any(freed for _, freed in self.kept) else "clean"

    def accepted(self, why: str) -> LeakReport:
        """This report with its leak kept, not leaked, under ``why`` (a
        ``pytest_cuda_leak_report`` hook's way to accept a known leak)."""
        if not self.leaked:
            return self
        return replace(self, leaked=(), kept=(*self.kept, (why, self.leaked)), summary="")

    def where(self, nodeid: str) -> str:
        """``nodeid``, and the rank when the check ran in one."""
        return nodeid if self.rank is None else f"{nodeid} on rank {self.rank}"

    def properties(self) -> list[tuple[str, str]]:
        """The verdict as JUnit XML properties (``record_property``'s form): named
        ``cuda_leak_*``, ``cuda_leak_rank<N>_*`` for a rank's check."""
        prefix = "cuda_leak_" if self.rank is None else f"cuda_leak_rank{self.rank}_"
        found = [("verdict", self.verdict), ("tolerance", str(self.tolerance))]
        if self.leaked:
            found.append(("bytes", ", ".join(f"cuda:{d}={b}" for d, b in self.leaked)))
        found += [("line", self.top)] if self.top else []
        found += [("holder", self.holder)] if self.holder else []
        return [(prefix + name, value) for name, value in found]

    def row(self, nodeid: str) -> dict[str, Any]:
        """One check's entry in the ``--cuda-leak-report`` JSON file."""
        return {
            "nodeid": nodeid,
            "rank": self.rank,
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
        """Plain data (JSON, execnet): every field by name. Its values are plain already
        (strings, numbers, tuples of them): taken as they are, where
        :func:`dataclasses.asdict` copied them deeply (70 µs a test)."""
        return {name: getattr(self, name) for name in _FIELDS}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LeakReport:
        """The report :meth:`to_dict` gave (lists read back as tuples; fields it does not
        carry take their defaults, keys it does not know are ignored)."""
        return cls(**{f.name: _tuples(data[f.name]) for f in fields(cls) if f.name in data})


#: The fields :meth:`LeakReport.to_dict` carries, in order.
_FIELDS = tuple(f.name for f in fields(LeakReport))


def _tuples(value: Any) -> Any:
    """JSON's lists back into the tuples a report holds, at every depth."""
    if isinstance(value, list | tuple):
        return tuple(_tuples(item) for item in value)
    return value


def worst(reports: Iterable[LeakReport]) -> str:
    """A test's verdict over its checks: the worst of theirs (``clean`` for none)."""
    return max((r.verdict for r in reports), key=VERDICTS.index, default="clean")


def junit_properties(reports: Sequence[LeakReport]) -> list[tuple[str, str]]:
    """A test's JUnit XML properties: ``cuda_leak_verdict`` is the test's verdict over
    the pytest process and its ranks; then each check's own (see
    :meth:`LeakReport.properties`)."""
    found = [("cuda_leak_verdict", worst(reports))]
    for report in reports:
        found += [p for p in report.properties() if p[0] != "cuda_leak_verdict"]
    return found


def json_report(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``--cuda-leak-report`` document: every check's row (see :meth:`LeakReport.row`;
    a ``cuda_distributed`` test has one per rank too) and the totals, by test: a test
    counts once, with the worst verdict of its rows."""
    by_test: dict[str, str] = {}
    leaked: dict[str, int] = {}
    for row in rows:
        seen = by_test.get(row["nodeid"], "clean")
        by_test[row["nodeid"]] = max(seen, row["verdict"], key=VERDICTS.index)
        if row["verdict"] == "leaked":
            for device, amount in row["leaked"].items():
                leaked[device] = leaked.get(device, 0) + amount
    counts = {verdict: list(by_test.values()).count(verdict) for verdict in VERDICTS}
    summary = {"checked": len(by_test), **counts, "leaked_bytes": leaked}
    return {"version": 1, "tests": rows, "summary": summary}


def leak_reports(report: pytest.TestReport) -> list[LeakReport]:
    """The leak checks' reports a teardown report carries (none: not checked)."""
    found = getattr(report, REPORT_LEAKS, None)
    if not isinstance(found, list | tuple):
        return []
    return [LeakReport.from_dict(data) for data in found if isinstance(data, dict)]


def peaks(report: pytest.TestReport) -> list[tuple[int, int, int]]:
    """``(device, peak, start)`` for each device a checked test used, or nothing."""
    rows = getattr(report, REPORT_PEAK, None) or ()
    return [(int(device), int(peak), int(start)) for device, peak, start in rows]
