"""Measured figures from the benchmarks' result files, so that no page types one by hand.

The benchmarks in ``benchmarks/`` append JSON lines (``--json``); each run's lines are
committed under ``benchmarks/results/`` as one file, ``YYYY-MM-DDTHHMM-DEVICE-WHAT.jsonl``. A file
may hold several benchmarks (``GPU_CHECK_BENCH=all`` appends them all to one); the
latest run of a benchmark is its records in the file with the latest date (then the
latest file name) that has any.

``{bench}`KEY```
    One figure of the latest run, formatted with its unit (``{bench}`leaks.check_us```
    gives ``+114 µs``); hovering shows the benchmark, device and date. ``FIGURES`` lists
    the keys; an unknown key or a run without the figure is a build warning (an error
    under ``-W``). A figure may declare its ``Spread``: how to read, from the run, the
    width its rounds spread over (an IQR, the min..max of rounds or trials) and what its
    effect is (its distance from 0 for a difference, from 1 for a ratio). Where the run
    records the spread and it is wider than the effect, the figure says so after its
    value, ``+12 µs (within the noise: spread 30 µs)``, and the hover says how the
    spread was read. A page writes no such words itself: the test fails on a sentence
    that cites figures and words their noise by hand, and on one comparing figures where
    a figure within its noise lacks the words.
``{bench-date}`BENCH```
    The device and date of a benchmark's latest run (``H100 80GB HBM3, 2026-11-25``).
``{bench-run} BENCH``
    A paragraph naming the latest run (script, date, device, driver, versions, result
    file), then the run's table.

``tests/test_doc_figures.py`` reads the same files through this module and compares
every figure the pages cite, the roles and the hand-typed ones, with them.
"""

from __future__ import annotations

import functools
import json
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

    from sphinx.application import Sphinx

TIMES = "\N{MULTIPLICATION SIGN}"
RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
#: The benchmark script of each benchmark name (a result file's "bench" value).
SCRIPTS = {
    "gpumem": "bench_gpumem.py",
    "gpumem_timeline": "bench_gpumem_timeline.py",
    "leaks": "bench_leaks.py",
    "leaks_suite": "bench_leaks.py --suite (the harness before suites that grow)",
    "leaks_growing": "bench_leaks.py --suite",
    "gc_freeze": "bench_gc_freeze.py",
    "holder_walk": "bench_holder_walk.py",
    "leak_teardown": "bench_leak_teardown.py",
    "warm_ranks_gloo": "bench_warm_ranks.py",
    "warm_ranks_nccl": "bench_warm_ranks.py",
    "leaks_suite_torch": "bench_leaks.py --suite --with-torch",
    "lprun": "bench_lprun.py",
    "memory_limit": "bench_memory_limit.py",
    "plugin_overhead": "bench_plugin_overhead.py",
    "sync": "bench_sync.py",
    "timing": "bench_timing.py",
    "timing_clocks": "bench_timing.py --only",
    "timing_stability": "bench_timing_stability.py",
}
#: Version keys shown with a run, in this order, when its records have them.
VERSIONS = (
    ("python", "Python"),
    ("torch", "torch"),
    ("cuda", "CUDA"),
    ("pytest", "pytest"),
    ("pytest_xdist", "pytest-xdist"),
    ("ipython", "IPython"),
    ("line_profiler", "line_profiler"),
    ("triton", "triton"),
    ("suite", "suite"),
)


@dataclass
class Run:
    """One benchmark's records in one result file."""

    bench: str
    file: Path
    records: list[dict[str, Any]] = field(default_factory=list)

    @property
    def env(self) -> dict[str, Any]:
        """Device, date and versions: the environment record's, else the first record's."""
        found: dict[str, Any] = {}
        for record in self.records:
            for key, value in record.items():
                if key in ("device", "driver", "date") or key in dict(VERSIONS):
                    found.setdefault(key, value)
        return found

    @property
    def date(self) -> str:
        return str(self.env.get("date", self.file.name[:10]))[:10]

    @property
    def device(self) -> str:
        return str(self.env.get("device", "unknown device"))

    def short(self) -> str:
        """``H100 80GB HBM3, 2026-11-25``."""
        return f"{self.device.removeprefix('NVIDIA ')}, {self.date}"

    def rows(self, **match: Any) -> list[dict[str, Any]]:
        return [r for r in self.records if all(r.get(k) == v for k, v in match.items())]

    def one(self, **match: Any) -> dict[str, Any]:
        found = self.rows(**match)
        if not found:
            raise KeyError(f"no record with {match} in {self.file.name}")
        return found[0]


def bench_of(record: dict[str, Any]) -> str | None:
    name = record.get("bench", record.get("benchmark"))
    return str(name) if name else None


@functools.cache
def load(folder: Path = RESULTS) -> dict[str, list[Run]]:
    """``{bench: [runs, oldest first]}`` from every ``*.jsonl`` under ``folder``."""
    runs: dict[str, list[Run]] = {}
    for path in sorted(folder.glob("*.jsonl")):
        by_bench: dict[str, Run] = {}
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path.name}:{number}: {exc}") from None
            name = bench_of(record)
            if name is None or "skipped" in record:
                continue
            by_bench.setdefault(name, Run(name, path)).records.append(record)
        for name, run in by_bench.items():
            runs.setdefault(name, []).append(run)
    for found in runs.values():
        found.sort(key=lambda run: (run.date, run.file.name))
    return runs


def latest(bench: str, folder: Path = RESULTS) -> Run:
    found = load(folder).get(bench)
    if not found:
        raise KeyError(f"no result file under {folder} holds benchmark {bench!r}")
    return found[-1]


# ---------------------------------------------------------------------------
# Figures: a key, the benchmark it comes from, how to read it, how to write it.


#: What a figure whose spread is larger than its effect says after its value.
NOISE = "within the noise"
NOISE_NOTE = "({noise}: spread {spread})"


@dataclass(frozen=True)
class Spread:
    """How a run records a figure's noise, and the effect the noise is compared to.

    ``read`` gives the width of the range the run's rounds (or trials, or quartiles)
    spread over, in the figure's unit; it raises ``KeyError`` where the run did not record
    it (an older result file, a single round), and ``fallback``, if any, is read instead;
    with none, the figure says nothing of its noise. The effect is the figure's distance
    from ``null``: 0 for a difference (a cost), 1 for a ratio. A spread wider than the
    effect is noise the figure cannot be told from, and the figure says so (``NOISE``).
    """

    read: Callable[[Run], float]
    how: str
    null: float = 0.0
    fallback: Spread | None = None


@dataclass(frozen=True)
class Noise:
    spread: float
    effect: float
    how: str

    @property
    def within(self) -> bool:
        return self.spread > self.effect


@dataclass(frozen=True)
class Figure:
    bench: str
    read: Callable[[Run], float]
    form: str  # str.format of the value; a leading "+" in the result is kept
    what: str
    spread: Spread | None = None

    def value(self, run: Run) -> float:
        return float(self.read(run))

    def noise(self, run: Run) -> Noise | None:
        """The run's spread of this figure against its effect; None where not recorded."""
        spread = self.spread
        while spread is not None:
            try:
                width = float(spread.read(run))
            except (KeyError, StopIteration, TypeError, ValueError, ZeroDivisionError):
                spread = spread.fallback
                continue
            return Noise(width, abs(self.value(run) - spread.null), spread.how)
        return None

    def bare(self, run: Run) -> str:
        """The value alone, formatted with its unit."""
        return _minus(self.form.format(self.value(run)))

    def spread_text(self, width: float) -> str:
        """The spread's width, formatted as the value is, without its sign or its ratio sign."""
        return _minus(self.form.replace("{:+", "{:").removesuffix(TIMES).format(width))

    def text(self, run: Run) -> str:
        """The value, and, when its spread is wider than its effect, that it is noise."""
        shown = self.bare(run)
        noise = self.noise(run)
        if noise is not None and noise.within:
            note = NOISE_NOTE.format(noise=NOISE, spread=self.spread_text(noise.spread))
            shown = f"{shown} {note}"
        return shown


def _minus(text: str) -> str:
    return text.replace("-", "\u2212")


def _width(values: list[float]) -> float:
    """max - min of two values or more; a single one has no spread (KeyError)."""
    if len(values) < 2:
        raise KeyError("fewer than two rounds")
    return max(values) - min(values)


def _leak_iqr(which: str, scale: float = 1.0) -> Callable[[Run], float]:
    """The interquartile range of a leak configuration's paired per-test differences."""

    def read(run: Run) -> float:
        q1, q3 = run.one()["overhead_iqr_us"][which]
        return (float(q3) - float(q1)) * scale

    return read


def _leak_iqr_pct(which: str) -> Callable[[Run], float]:
    return lambda run: _leak_iqr(which)(run) * 100 / float(run.one()["median_per_test_us"]["none"])


def _leak_iqrs_added(run: Run) -> float:
    """Both costs' interquartile ranges added: the spread of the trace's cost less the check's."""
    return _leak_iqr("trace")(run) + _leak_iqr("check")(run)


def _leak_estimates_gap(run: Run) -> float:
    """The gap between the run's two estimates of the trace's cost less the check's: the
    paired costs' difference and the medians' of a clean test."""
    r = run.one()
    paired = float(r["overhead_per_test_us"]["trace"]) - float(r["overhead_per_test_us"]["check"])
    medians = float(r["median_per_test_us"]["trace"]) - float(r["median_per_test_us"]["check"])
    return abs(paired - medians)


def _round_ratios(walls: list[float], anchor: list[float]) -> list[float]:
    """Each round's wall time over the anchor's of the same round (rounds interleaved)."""
    if len(walls) != len(anchor):
        raise KeyError("rounds do not pair")
    return [w / a for w, a in zip(walls, anchor, strict=True)]


def _suite_ratio_spread(label: str) -> Callable[[Run], float]:
    def read(run: Run) -> float:
        walls = [float(w) for w in run.one(label=label)["walls"]]
        anchor = [float(w) for w in run.one(label="plugin off")["walls"]]
        return _width(_round_ratios(walls, anchor))

    return read


def _growing_ratio_spread(run: Run, *, suite: str, label: str) -> float:
    run = _suite_run(run, suite, label)
    walls = [float(w) for w in run.one(suite=suite, label=label)["walls"]]
    anchor = [float(w) for w in run.one(suite=suite, label="plugin loaded")["walls"]]
    return _width(_round_ratios(walls, anchor))


def _sync_spread(
    prefix: str, variant: str, anchor: str, *, relative: bool = False
) -> Callable[[Run], float]:
    """The narrower min..max, over rounds, of the two times a sync figure compares (as a
    share of each one's median for a ratio): either spreads at least that wide."""

    def read(run: Run) -> float:
        widths = []
        for name in (variant, anchor):
            row = next(
                r
                for r in run.records
                if str(r.get("case", "")).startswith(prefix) and r.get("variant") == name
            )
            width = float(row["max"]) - float(row["min"])
            widths.append(width / float(row["median"]) if relative else width)
        return min(widths)

    return read


def _timeline_spread(name: str, base: str) -> Callable[[Run], float]:
    """The interquartile range of a cell's times, over the median of the cell alone."""

    def read(run: Run) -> float:
        row = run.one(name=name)
        return (float(row["q3"]) - float(row["q1"])) / _named(run, base)

    return read


def _timing_spread(workload: str, method: str = "gpumagic") -> Callable[[Run], float]:
    """min..max over trials of a method's time over CUPTI's kernel time of the same trial."""

    def read(run: Run) -> float:
        by_trial: dict[int, dict[str, float]] = {}
        for r in run.records:
            if "trial" in r and str(r["workload"]).startswith(workload):
                by_trial.setdefault(int(r["trial"]), {})[str(r["method"])] = float(r["seconds"])
        return _width(
            [
                t[method] / t["CUPTI warm"]
                for t in by_trial.values()
                if method in t and "CUPTI warm" in t
            ]
        )

    return read


IQR = "the interquartile range of the paired per-test differences"
ROUNDS = "min..max over rounds of each round's wall time over the anchor's"
SYNC_RATIO = "min..max over rounds of the two times compared, each over its median: the narrower"
TIMELINE = "the interquartile range of the cell's times over the median of the cell alone"
TRIALS = "min..max over trials of the method's time over CUPTI's kernel time of the same trial"


def _suite(run: Run, variant: str, key: str = "ratio") -> float:
    rows = [r for r in run.records if str(r.get("case", "")).startswith("pytest suite")]
    return float(next(r for r in rows if r["variant"] == variant)[key])


def _case(run: Run, prefix: str, variant: str, key: str = "median") -> float:
    for r in run.records:
        if str(r.get("case", "")).startswith(prefix) and r.get("variant") == variant:
            return float(r[key])
    raise KeyError(f"{prefix} / {variant}")


def _named(run: Run, name: str, key: str = "median") -> float:
    return float(run.one(name=name)[key])


def _loop_ratio(run: Run, name: str, base: str) -> float:
    return _named(run, name) / _named(run, base)


def _suite_run(run: Run, suite: str, label: str | None = None) -> Run:
    """The latest run of ``run``'s benchmark that ran ``suite`` (in the configuration
    ``label``, when given): ``bench_leaks.py --suite`` runs one suite at a time, and a
    later file may hold only some of them, or some configurations (``--no-trace``)."""
    for found in reversed(load(run.file.parent)[run.bench]):
        if found.rows(suite=suite) if label is None else found.rows(suite=suite, label=label):
            return found
    raise KeyError(f"no result file of {run.bench} ran {suite}" + (f", {label}" if label else ""))


def _growing(run: Run, *, suite: str, label: str, key: str) -> float:
    value = _suite_run(run, suite, label).one(suite=suite, label=label)[key]
    if value is None:
        raise KeyError(f"{suite}, {label}: {key} is not comparable in {run.file.name}")
    return float(value)


def _suite_wall(run: Run, label: str) -> float:
    return float(run.one(label=label)["wall_s"])


def _variant(run: Run, variant: str, key: str) -> float:
    return float(run.one(kind="variant", variant=variant)[key])


def _teardown_ms(run: Run, test: str, config: str) -> float:
    return float(run.one(kind="row", test=test, config=config)["protocol_s"]) * 1e3


def _summary(run: Run, key: str) -> float:
    return float(run.one(kind="summary")[key])


def _timing(run: Run, workload: str, method: str) -> float:
    for r in run.rows(kind="summary"):
        if str(r["workload"]).startswith(workload):
            return float(r[method])
    raise KeyError(workload)


def _leak(key: str, which: str) -> Callable[[Run], float]:
    return lambda run: float(run.one()[key][which])


FIGURES: dict[str, Figure] = {
    # bench_leaks.py: the clean-test cost of the leak check.
    "leaks.check_us": Figure(
        "leaks",
        _leak("overhead_per_test_us", "check"),
        "{:+.0f} µs",
        "--cuda-leak-check",
        Spread(_leak_iqr("check"), IQR),
    ),
    "leaks.trace_us": Figure(
        "leaks",
        _leak("overhead_per_test_us", "trace"),
        "{:+.0f} µs",
        "with --cuda-leak-trace",
        Spread(_leak_iqr("trace"), IQR),
    ),
    "leaks.fixture_check_us": Figure(
        "leaks",
        _leak("overhead_per_test_us", "fixture check"),
        "{:+.0f} µs",
        "--cuda-leak-check, function-scoped CUDA fixture",
        Spread(_leak_iqr("fixture check"), IQR),
    ),
    "leaks.anchor_us": Figure(
        "leaks", _leak("median_per_test_us", "none"), "{:.0f} µs", "a clean test, no check"
    ),
    "leaks.check_median_us": Figure(
        "leaks",
        _leak("median_per_test_us", "check"),
        "{:.0f} µs",
        "a clean test, --cuda-leak-check",
    ),
    "leaks.trace_minus_check_us": Figure(
        "leaks",
        lambda run: (
            float(run.one()["overhead_per_test_us"]["trace"])
            - float(run.one()["overhead_per_test_us"]["check"])
        ),
        "{:+.0f} µs",
        "--cuda-leak-trace's cost minus --cuda-leak-check's",
        Spread(
            _leak_iqrs_added,
            "the interquartile ranges of both costs' paired per-test differences, added",
            fallback=Spread(
                _leak_estimates_gap,
                "no IQR recorded: the gap between the run's two estimates of the difference, "
                "the paired costs' and the medians' of a clean test",
            ),
        ),
    ),
    "leaks.check_pct": Figure(
        "leaks",
        lambda run: float(run.one()["check_overhead_pct"]),
        "{:+.1f} %",
        "check",
        Spread(_leak_iqr_pct("check"), IQR),
    ),
    "leaks.trace_pct": Figure(
        "leaks",
        lambda run: float(run.one()["trace_overhead_pct"]),
        "{:+.1f} %",
        "trace",
        Spread(_leak_iqr_pct("trace"), IQR),
    ),
    "leaks.torch_ms": Figure(
        "leaks",
        lambda run: float(run.one()["overhead_per_test_us"]["torch"]) / 1000,
        "{:.0f} ms",
        "PyTorch's CudaMemoryLeakCheck per test",
        Spread(_leak_iqr("torch", 1 / 1000), IQR),
    ),
    # bench_leaks.py --suite: torch_geometric's CUDA tests.
    "leaks_suite.check_ratio": Figure(
        "leaks_suite",
        lambda run: _suite_wall(run, "--cuda-leak-check") / _suite_wall(run, "plugin off"),
        "{:.3f}",
        "--cuda-leak-check wall time / plugin off",
        Spread(_suite_ratio_spread("--cuda-leak-check"), ROUNDS, null=1.0),
    ),
    "leaks_suite.loaded_ratio": Figure(
        "leaks_suite",
        lambda run: _suite_wall(run, "plugin loaded") / _suite_wall(run, "plugin off"),
        "{:.3f}",
        "plugin loaded / plugin off",
        Spread(_suite_ratio_spread("plugin loaded"), ROUNDS, null=1.0),
    ),
    "leaks_suite.changes": Figure(
        "leaks_suite",
        lambda run: sum(len(r.get("changed", [])) for r in run.rows()),
        "{:.0f}",
        "outcome changes, all configurations",
    ),
    "leaks_suite.leaked": Figure(
        "leaks_suite",
        lambda run: sum(len(r.get("leaked", [])) for r in run.rows()),
        "{:.0f}",
        "LEAKED, all configurations",
    ),
    # bench_leaks.py --suite on suites that grow: each suite's rows, plugin loaded = 1.
    **{
        f"leaks_growing.{short}.{what}": Figure(
            "leaks_growing",
            functools.partial(_growing, suite=suite, label=label, key=key),
            fmt,
            f"{suite}: {label}, {key}",
            None
            if key != "ratio_to_loaded"
            else Spread(
                functools.partial(_growing_ratio_spread, suite=suite, label=label),
                ROUNDS,
                null=1.0,
            ),
        )
        for short, suite in (
            ("gpytorch", "gpytorch 1.15.2 test/ (CUDA tests)"),
            ("vision", "torchvision test_ops.py TestDeformConv (CUDA tests)"),
            ("pyg", "torch_geometric 2.8.0.post1, 30 CUDA test files"),
        )
        for what, label, key, fmt in (
            ("check_ratio", "--cuda-leak-check", "ratio_to_loaded", "{:.2f}"),
            ("trace_ratio", "--cuda-leak-check --cuda-leak-trace", "ratio_to_loaded", "{:.2f}"),
            ("leaked", "--cuda-leak-check", "leaked_count", "{:.0f}"),
            ("with_line", "--cuda-leak-check", "with_line", "{:.0f}"),
            ("with_holder", "--cuda-leak-check", "with_holder_or_why", "{:.0f}"),
            ("teardown", "--cuda-leak-check", "teardown_s", "{:.1f} s"),
            ("worst_teardown", "--cuda-leak-check", "worst_teardown_growth_s", "{:.2f} s"),
            (
                "trace_worst_teardown",
                "--cuda-leak-check --cuda-leak-trace",
                "worst_teardown_growth_s",
                "{:.2f} s",
            ),
        )
    },
    # bench_warm_ranks.py: 20 cuda_distributed tests, warm ranks against fresh ones.
    **{
        f"warm_ranks_{backend}.{short}": Figure(
            f"warm_ranks_{backend}",
            functools.partial(_variant, variant=variant, key=key),
            unit,
            f"{variant}: {what}",
        )
        for backend in ("gloo", "nccl")
        for short, variant, key, unit, what in (
            ("warm_wall", "warm ranks", "wall_median", "{:.1f} s", "the pytest run"),
            ("warm_per_test", "warm ranks", "per_test_median", "{:.3f} s", "a test once up"),
            ("warm_first", "warm ranks", "first_test_median", "{:.1f} s", "the first test"),
            ("isolate_wall", "isolate=True", "wall_median", "{:.1f} s", "the pytest run"),
            ("isolate_per_test", "isolate=True", "per_test_median", "{:.2f} s", "a test"),
            (
                "before_wall",
                "before (fresh ranks, older plugin)",
                "wall_median",
                "{:.1f} s",
                "the pytest run",
            ),
        )
        # On two GPUs the older plugin's file was not run (--before-src).
        if (backend, short) != ("nccl", "before_wall")
    },
    "warm_ranks_gloo.warm_to_before": Figure(
        "warm_ranks_gloo",
        lambda run: (
            _variant(run, "warm ranks", "wall_median")
            / _variant(run, "before (fresh ranks, older plugin)", "wall_median")
        ),
        "{:.2f}",
        "the warm ranks' pytest run ÷ the older plugin's",
    ),
    # bench_gc_freeze.py: the leak check's heap boundary, on the CPU.
    "gc_freeze.freeze_unfreeze_us": Figure(
        "gc_freeze",
        functools.partial(_summary, key="freeze_unfreeze_us"),
        "{:.1f} µs",
        "gc.freeze() and gc.unfreeze()",
    ),
    "gc_freeze.full_collect_ms": Figure(
        "gc_freeze",
        functools.partial(_summary, key="full_collect_ms"),
        "{:.0f} ms",
        "a full collection of 1.4 million objects",
    ),
    "gc_freeze.frozen_collect_ms": Figure(
        "gc_freeze",
        functools.partial(_summary, key="frozen_collect_ms"),
        "{:.2f} ms",
        "a collection with the older heap frozen",
    ),
    "gc_freeze.search_whole_ms": Figure(
        "gc_freeze",
        functools.partial(_summary, key="search_whole_ms"),
        "{:.0f} ms",
        "the search for a leaking test's tensors over the whole heap",
    ),
    "gc_freeze.search_young_ms": Figure(
        "gc_freeze",
        functools.partial(_summary, key="search_young_ms"),
        "{:.2f} ms",
        "the same search over what the test made",
    ),
    "holder_walk.ratio_limited": Figure(
        "holder_walk",
        lambda run: statistics.median(
            float(r["ratio_to_thawed"]) for r in run.rows(kind="summary") if r["budget_s"]
        ),
        "{:.2f}",
        "the young-first walk ÷ the thawed-first one, 0.3 s limit (median over tests)",
    ),
    "holder_walk.ratio_trace": Figure(
        "holder_walk",
        lambda run: statistics.median(
            float(r["ratio_to_thawed"]) for r in run.rows(kind="summary") if r["budget_s"] is None
        ),
        "{:.2f}",
        "the young-first walk ÷ the thawed-first one, no limit (median over tests)",
    ),
    "holder_walk.young_ms": Figure(
        "holder_walk",
        lambda run: max(float(r["young_s"]) for r in run.rows(kind="summary")) * 1e3,
        "{:.0f} ms",
        "the slowest young-first walk",
    ),
    # bench_leak_teardown.py: one planted test's protocol under one configuration.
    **{
        f"leak_teardown.{key}": Figure(
            "leak_teardown",
            functools.partial(_teardown_ms, test=test, config=config),
            "{:.0f} ms",
            what,
        )
        for key, test, config, what in (
            (
                "promoted_check",
                "test_promoted_garbage",
                "--cuda-leak-check",
                "a promoted garbage cycle, checked",
            ),
            (
                "promoted_before",
                "test_promoted_garbage",
                "check, no boundary",
                "the same without the boundary",
            ),
            (
                "promoted_loaded",
                "test_promoted_garbage",
                "plugin loaded",
                "the same, plugin loaded",
            ),
            (
                "cpp_check",
                "test_leak_held_from_cpp",
                "--cuda-leak-check",
                "a leak held from C++, checked",
            ),
            (
                "cpp_before",
                "test_leak_held_from_cpp",
                "check, no boundary",
                "the same without the boundary",
            ),
            (
                "cpp_thawed",
                "test_leak_held_from_cpp",
                "check, walk thawed first",
                "the same, walk thawed first",
            ),
            (
                "global_check",
                "test_leak_module_global",
                "--cuda-leak-check",
                "a module global's leak, checked",
            ),
            (
                "global_before",
                "test_leak_module_global",
                "check, no boundary",
                "the same without the boundary",
            ),
            ("clean_check", "test_clean", "--cuda-leak-check", "the first (clean) test, checked"),
        )
    },
    "leaks_suite_torch.ratio": Figure(
        "leaks_suite_torch",
        lambda run: float(run.one(label="PyTorch CudaMemoryLeakCheck")["ratio"]),
        "{:.3f}",
        "PyTorch's checker, wall time / plugin off",
    ),
    "leaks_suite_torch.check_ratio": Figure(
        "leaks_suite_torch",
        lambda run: float(run.one(label="--cuda-leak-check")["ratio"]),
        "{:.3f}",
        "--cuda-leak-check, wall time / plugin off",
    ),
    # bench_sync.py: the post-test check and the debug modes.
    "sync.health_check_ms": Figure(
        "sync",
        lambda run: _case(run, "health check per test", "default"),
        "{:.3f} ms",
        "post-test health check per test",
        Spread(
            _sync_spread("pytest suite", "default", "plugin off"),
            "min..max over rounds of the per-test time, "
            "the narrower of the default's and the plugin off's",
        ),
    ),
    "sync.hooks_ms": Figure(
        "sync",
        lambda run: _case(run, "of which the plugin's hooks", "default"),
        "{:.3f} ms",
        "the plugin's hooks per test",
        Spread(
            _sync_spread("pytest suite", "hooks only (check swapped out)", "plugin off"),
            "min..max over rounds of the per-test time, the narrower of the hooks-only "
            "run's and the plugin off's",
        ),
    ),
    "sync.per_op_x": Figure(
        "sync",
        lambda run: _suite(run, "per-op"),
        "{:.2f}" + TIMES,
        "per-op, suite",
        Spread(
            _sync_spread("pytest suite", "per-op", "default", relative=True), SYNC_RATIO, null=1.0
        ),
    ),
    "sync.launch_blocking_x": Figure(
        "sync",
        lambda run: _suite(run, "launch-blocking"),
        "{:.2f}" + TIMES,
        "launch-blocking, suite",
        Spread(
            _sync_spread("pytest suite", "launch-blocking", "default", relative=True),
            SYNC_RATIO,
            null=1.0,
        ),
    ),
    "sync.async_error_us": Figure(
        "sync",
        lambda run: _case(run, "gpumagic.cuda.async_error()", "idle GPU"),
        "{:.1f} µs",
        "async_error() on an idle GPU",
    ),
    "sync.async_error_no_context_us": Figure(
        "sync",
        lambda run: _case(run, "gpumagic.cuda.async_error()", "no CUDA context"),
        "{:.2f} µs",
        "async_error() without a CUDA context",
    ),
    "sync.tiny_ops_per_op_x": Figure(
        "sync",
        lambda run: _case(run, "tiny ops", "per-op", "ratio"),
        "{:.2f}" + TIMES,
        "per-op, 4,000 tiny launches",
        Spread(_sync_spread("tiny ops", "per-op", "plain", relative=True), SYNC_RATIO, null=1.0),
    ),
    "sync.mlp_per_op_x": Figure(
        "sync",
        lambda run: _case(run, "MLP training step", "per-op", "ratio"),
        "{:.2f}" + TIMES,
        "per-op, MLP training step",
        Spread(
            _sync_spread("MLP training step", "per-op", "plain", relative=True),
            SYNC_RATIO,
            null=1.0,
        ),
    ),
    "sync.launch_blocking_child_x": Figure(
        "sync",
        lambda run: _case(run, "tiny ops", "CUDA_LAUNCH_BLOCKING=1 child", "ratio"),
        "{:.2f}" + TIMES,
        "CUDA_LAUNCH_BLOCKING=1, 4,000 tiny launches",
        Spread(
            _sync_spread("tiny ops", "CUDA_LAUNCH_BLOCKING=1 child", "plain child", relative=True),
            SYNC_RATIO,
            null=1.0,
        ),
    ),
    # bench_plugin_overhead.py: the plugin on a CPU-only suite.
    "plugin_overhead.whole_pct": Figure(
        "plugin_overhead",
        lambda run: float(run.one()["on_overhead_pct"]),
        "{:+.2f} %",
        "whole plugin, paired median",
    ),
    "plugin_overhead.core_pct": Figure(
        "plugin_overhead",
        lambda run: float(run.one()["core_overhead_pct"]),
        "{:+.2f} %",
        "core only, paired median",
    ),
    "plugin_overhead.discovery_ms": Figure(
        "plugin_overhead",
        lambda run: float(run.one()["discovery_median_ms"]),
        "{:.1f} ms",
        "device discovery",
    ),
    # bench_gpumem.py
    "gpumem.per_call_ms": Figure(
        "gpumem", lambda run: _named(run, "gpumem"), "{:.3f} ms", "%gpumem per call"
    ),
    "gpumem.cell_added_ms": Figure(
        "gpumem",
        lambda run: _named(run, "cell_gpumem_added"),
        "{:.3f} ms",
        "%%gpumem added to a one-line cell",
    ),
    "gpumem.trace_ops_x": Figure(
        "gpumem",
        lambda run: _loop_ratio(run, "loop_ops_trace", "loop_ops"),
        "{:.3f}" + TIMES,
        "--trace on a cell of 10,000 multiplies",
        Spread(_timeline_spread("loop_ops_trace", "loop_ops"), TIMELINE, null=1.0),
    ),
    "gpumem.trace_empty_x": Figure(
        "gpumem",
        lambda run: _loop_ratio(run, "loop_empty_trace", "loop_empty"),
        "{:.3f}" + TIMES,
        "--trace on a cell of 10,000 allocations",
        Spread(_timeline_spread("loop_empty_trace", "loop_empty"), TIMELINE, null=1.0),
    ),
    # bench_gpumem_timeline.py
    "gpumem_timeline.trace_ops_x": Figure(
        "gpumem_timeline",
        lambda run: _named(run, "loop_ops_trace", "ratio"),
        "{:.3f}" + TIMES,
        "--trace on a cell of 10,000 multiplies",
        Spread(_timeline_spread("loop_ops_trace", "loop_ops"), TIMELINE, null=1.0),
    ),
    "gpumem_timeline.timeline_ops_x": Figure(
        "gpumem_timeline",
        lambda run: _named(run, "loop_ops_timeline", "ratio"),
        "{:.3f}" + TIMES,
        "--timeline on a cell of 10,000 multiplies",
        Spread(_timeline_spread("loop_ops_timeline", "loop_ops"), TIMELINE, null=1.0),
    ),
    "gpumem_timeline.recording_ops_x": Figure(
        "gpumem_timeline",
        lambda run: _named(run, "loop_ops_recording", "ratio"),
        "{:.3f}" + TIMES,
        "--timeline's recording alone on a cell of 10,000 multiplies",
        Spread(_timeline_spread("loop_ops_recording", "loop_ops"), TIMELINE, null=1.0),
    ),
    "gpumem_timeline.timeline_empty_x": Figure(
        "gpumem_timeline",
        lambda run: _named(run, "loop_empty_timeline", "ratio"),
        "{:.3f}" + TIMES,
        "--timeline on a cell of 10,000 allocations",
        Spread(_timeline_spread("loop_empty_timeline", "loop_empty"), TIMELINE, null=1.0),
    ),
    "gpumem_timeline.snapshot_ms": Figure(
        "gpumem_timeline",
        lambda run: _named(run, "timeline_breakdown_ops", "snapshot_ms"),
        "{:.1f} ms",
        "torch's snapshot of 20,000 events",
    ),
    "gpumem_timeline.replay_ms": Figure(
        "gpumem_timeline",
        lambda run: _named(run, "timeline_breakdown_ops", "replay_ms"),
        "{:.1f} ms",
        "replaying 20,000 events",
    ),
    "gpumem_timeline.svg_ms": Figure(
        "gpumem_timeline",
        lambda run: _named(run, "timeline_breakdown_ops", "svg_ms"),
        "{:.1f} ms",
        "drawing the SVG",
    ),
    "gpumem_timeline.us_per_event": Figure(
        "gpumem_timeline",
        lambda run: (
            (_named(run, "loop_ops_timeline") - _named(run, "loop_ops"))
            * 1000
            / _named(run, "timeline_breakdown_ops", "events")
        ),
        "{:.1f} µs",
        "--timeline's cost per allocator event, cell of multiplies",
    ),
    "gpumem_timeline.record_us": Figure(
        "gpumem_timeline",
        lambda run: (
            _named(run, "recording_us_per_allocation", "trace")
            - _named(run, "recording_us_per_allocation", "off")
        ),
        "{:.2f} µs",
        "recording a Python stack per allocation",
    ),
    "gpumem_timeline.events": Figure(
        "gpumem_timeline",
        lambda run: _named(run, "timeline_breakdown_ops", "events"),
        "{:,.0f}",
        "allocator events of the cell of multiplies",
    ),
    # bench_lprun.py
    "lprun.share_a_pct": Figure(
        "lprun",
        lambda run: _summary(run, "share_a_gpumagic"),
        "{:.1f} %",
        "line A's kernel time charged to line A",
    ),
    "lprun.share_a_line_profiler_pct": Figure(
        "lprun",
        lambda run: _summary(run, "share_a_line_profiler"),
        "{:.1f} %",
        "the same, line_profiler alone",
    ),
    "lprun.gpu_column_pct": Figure(
        "lprun",
        lambda run: _summary(run, "gpu_column_ratio_gpumagic --gpu"),
        "{:.2f} %",
        "--gpu's GPU Time of line A / CUPTI",
    ),
    "lprun.overhead_us": Figure(
        "lprun",
        lambda run: _summary(run, "overhead_us_gpumagic"),
        "{:.2f} µs",
        "%lprun per line hit",
    ),
    "lprun.sync_us": Figure(
        "lprun",
        lambda run: _summary(run, "idle_sync_us"),
        "{:.2f} µs",
        "one idle torch.cuda.synchronize()",
    ),
    "lprun.launch_x": Figure(
        "lprun",
        lambda run: _summary(run, "launch_ms_gpumagic") / _summary(run, "launch_ms_unprofiled"),
        "{:.2f}" + TIMES,
        "launch-bound loop under %lprun / unprofiled",
    ),
    # bench_timing.py: %cudatime / CUPTI kernel time.
    "timing.spin_x": Figure(
        "timing",
        lambda run: _timing(run, "spin", "gpumagic"),
        "{:.3f}",
        "spin 1 ms",
        Spread(_timing_spread("spin"), TRIALS, null=1.0),
    ),
    "timing.copy_x": Figure(
        "timing",
        lambda run: _timing(run, "copy", "gpumagic"),
        "{:.3f}",
        "copy 4x L2",
        Spread(_timing_spread("copy"), TRIALS, null=1.0),
    ),
    "timing.mm_x": Figure(
        "timing",
        lambda run: _timing(run, "bf16 mm", "gpumagic"),
        "{:.3f}",
        "bf16 mm 4096",
        Spread(_timing_spread("bf16 mm"), TRIALS, null=1.0),
    ),
    "timing.copy_span_x": Figure(
        "timing",
        lambda run: _timing(run, "copy", "gpumagic / CUPTI span"),
        "{:.3f}",
        "copy 4x L2, against the CUPTI span",
    ),
    "timing.mm_span_x": Figure(
        "timing",
        lambda run: _timing(run, "bf16 mm", "gpumagic / CUPTI span"),
        "{:.3f}",
        "bf16 mm 4096, against the CUPTI span",
    ),
    "timing.side_stream_span_x": Figure(
        "timing",
        lambda run: _timing(run, "side-stream", "gpumagic / CUPTI span"),
        "{:.3f}",
        "side-stream mm, against the CUPTI span",
    ),
    "timing.side_stream_x": Figure(
        "timing",
        lambda run: _timing(run, "side-stream", "gpumagic"),
        "{:.3f}",
        "side stream",
        Spread(_timing_spread("side-stream"), TRIALS, null=1.0),
    ),
    "timing.mm_kernel_us": Figure(
        "timing",
        lambda run: _timing(run, "bf16 mm", "cupti_warm_s") * 1e6,
        "{:.0f} µs",
        "bf16 mm 4096: CUPTI kernel time per call",
    ),
    "timing.mm_timeit_us": Figure(
        "timing",
        lambda run: _trials_median(run, "bf16 mm", "%timeit") * 1e6,
        "{:.0f} µs",
        "bf16 mm 4096: %timeit -n 100 -r 3 per call (median over trials)",
    ),
    "timing.slowest_default_s": Figure(
        "timing",
        lambda run: max(float(r["wall_max"]) for r in run.rows(kind="checks")),
        "{:.2f} s",
        "the slowest default %cudatime call (1 s budget) of any workload",
    ),
}


def _trials_median(run: Run, workload: str, method: str) -> float:
    return statistics.median(
        float(r["seconds"])
        for r in run.records
        if "trial" in r and str(r["workload"]).startswith(workload) and r["method"] == method
    )


def figure(key: str, folder: Path = RESULTS) -> tuple[str, float, Run]:
    """``(text, value, run)`` of a figure of the latest run."""
    if key not in FIGURES:
        raise KeyError(f"unknown figure {key!r} (docs/_ext/bench_results.py: FIGURES)")
    fig = FIGURES[key]
    run = latest(fig.bench, folder)
    try:
        return fig.text(run), fig.value(run), run
    except (KeyError, StopIteration, TypeError, ValueError) as exc:
        raise KeyError(f"{key}: not in {run.file.name} ({exc})") from None


# ---------------------------------------------------------------------------
# Tables: one per benchmark, the latest run's.

Table = tuple[list[str], list[list[str]]]


def _ms(value: float) -> str:
    return f"{value:.3f}" if value < 10 else f"{value:.1f}"


def _table_leaks(run: Run) -> Table:
    r = run.one()
    med, over = r["median_per_test_us"], r["overhead_per_test_us"]
    labels = [
        ("none", "plugin loaded, no leak option (anchor)"),
        ("check", "`--cuda-leak-check`"),
        ("trace", "`--cuda-leak-check --cuda-leak-trace`"),
        ("fixture none", "fixture suite, no leak option (anchor)"),
        ("fixture check", "fixture suite, `--cuda-leak-check`"),
        ("torch none", "first 40 tests, no check (anchor)"),
        ("torch", "first 40 tests, PyTorch's `CudaMemoryLeakCheck`"),
    ]
    spread = r.get("overhead_iqr_us", {})

    def cost(k: str) -> str:
        if "none" in k:
            return ""
        if k not in spread:  # runs before the spread was recorded
            return f"{over[k]:+,.1f} (spread not recorded)"
        return f"{over[k]:+,.1f} (IQR {spread[k][0]:+,.0f} to {spread[k][1]:+,.0f})"

    rows = [[label, f"{med[k]:,.0f}", cost(k)] for k, label in labels if k in med]
    return ["configuration", "median per test (µs)", "overhead per test (µs)"], rows


def _table_leaks_suite(run: Run) -> Table:
    rows = [r for r in run.records if "label" in r]
    base = next(r["wall_s"] for r in rows if r["label"] == "plugin off")
    out = []
    for r in rows:
        walls = ", ".join(f"{w:.1f}" for w in r.get("walls", []))
        out.append(
            [
                f"`{r['label']}`" if r["label"].startswith("-") else r["label"],
                f"{r['wall_s']:.1f} s ({walls})",
                f"{r['wall_s'] / base:.3f}",
                f"{r.get('teardown_s', 0):.1f} s",
                str(len(r.get("changed", []))),
                str(len(r.get("leaked", []))),
            ]
        )
    header = [
        "configuration",
        "wall (rounds)",
        TIMES + " plugin off",
        "teardown",
        "changes",
        "LEAKED",
    ]
    return header, out


def _table_leaks_growing(run: Run) -> Table:
    """Each suite's rows, each configuration's from the latest file that ran it
    (:func:`_suite_run`)."""
    # Newest first: the suites of the latest file, then those only older files ran.
    runs_all = list(reversed(load(run.file.parent)[run.bench]))
    suites = {r["suite"]: None for found in runs_all for r in found.rows() if "suite" in r}
    out = []
    for suite in suites:
        labels = {
            r["label"]: None for found in runs_all for r in found.rows(suite=suite) if "label" in r
        }
        for label in labels:
            found = _suite_run(run, suite, label)
            out.append(_growing_row(found, found.one(suite=suite, label=label)))
    header = [
        "suite",
        "run",
        "configuration",
        "wall, median (rounds)",
        TIMES + " plugin loaded",
        "teardown",
        "worst test's teardown growth",
        "tests",
        "LEAKED",
        "with the line",
        "with a holder or why none",
    ]
    return header, out


def _growing_row(found: Run, r: dict[str, Any]) -> list[str]:
    walls = ", ".join(f"{w:.1f}" for w in r.get("walls", []))
    ratio = r.get("ratio_to_loaded")
    worst = r.get("worst_teardown_growth_s")
    return [
        r["suite"],
        f"{found.device.removeprefix('NVIDIA ')}, {found.file.name[:15]}",
        f"`{r['label']}`" if r["label"].startswith("-") else r["label"],
        f"{r['wall_s']:.1f} s ({walls})",
        "not comparable" if ratio is None else f"{ratio:.2f}",
        f"{r.get('teardown_s', 0):.1f} s",
        "not recorded" if worst is None else f"{worst:.2f} s",
        str(r["tests"]),
        str(r["leaked_count"]),
        str(r["with_line"]),
        str(r["with_holder_or_why"]),
    ]


def _table_gc_freeze(run: Run) -> Table:
    found = run.one(kind="summary")
    rows = [
        ["tracked objects", f"{found['tracked_objects']:,.0f}"],
        ["`gc.freeze()` + `gc.unfreeze()`", f"{found['freeze_unfreeze_us']:.1f} µs"],
        ["`gc.collect()`, the whole heap", f"{found['full_collect_ms']:.0f} ms"],
        ["`gc.collect()`, the older heap frozen", f"{found['frozen_collect_ms']:.2f} ms"],
    ]
    if "search_whole_ms" in found:
        drawn = "drawn" if found["boundary_drawn"] else "not drawn"
        rows += [
            ["the search for the tensors, the whole heap", f"{found['search_whole_ms']:.1f} ms"],
            ["the search, what the test made", f"{found['search_young_ms']:.2f} ms"],
            [
                f"objects the interpreter froze itself: {found['interpreter_frozen']:.0f}",
                f"boundary {drawn}",
            ],
        ]
    return ["what", "median"], rows


def _table_warm_ranks(run: Run) -> Table:
    rows = [
        [
            str(r["variant"]),
            str(r["tests"]),
            f"{r['wall_median']:.2f} s ({r['wall_min']:.2f} to {r['wall_max']:.2f})",
            f"{r['per_test_median']:.3f} s",
            f"{r['first_test_median']:.2f} s",
            f"{r['wall_ratio_to_isolate']:.2f}",
        ]
        for r in run.rows(kind="variant")
    ]
    header = ["variant", "tests", "pytest run (min to max)", "per test once up", "first test"]
    return [*header, "run a test ÷ isolate=True"], rows


def _table_leaks_suite_torch(run: Run) -> Table:
    rows = [r for r in run.records if "label" in r]
    out = [
        [
            f"`{r['label']}`" if r["label"].startswith("-") else r["label"],
            str(r.get("scope", "")),
            f"{r['wall_s']:.1f} s",
            f"{r['ratio']:.3f} ({r['anchor_wall_s']:.1f} s)",
            str(len(r.get("changed", []))),
            str(len(r.get("leaked", []))),
        ]
        for r in rows
    ]
    header = ["checker", "tests", "wall", TIMES + " plugin off", "tests it fails", "LEAKED"]
    return header, out


GPUMEM_LABELS = {
    "gpumem": "`%gpumem` per call (1 device)",
    "gpumem_o": "`%gpumem -o` (no display)",
    "memory_summary": "`torch.cuda.memory_summary()`",
    "list_gpu_processes": "`torch.cuda.list_gpu_processes()`",
    "gpumem_top": "`%gpumem --top 10`",
    "cell": "one-line cell alone",
    "cell_gpumem": "one-line cell under `%%gpumem`",
    "cell_capture": "one-line cell under `%%capture`",
    "cell_gpumem_added": "`%%gpumem` added to a one-line cell",
    "cell_gpumem_beyond_capture": "`%%gpumem` beyond `%%capture`",
    "loop_ops": "cell alone: `y = x * 2` " + TIMES + "10,000",
    "loop_ops_gpumem": "`%%gpumem`",
    "loop_ops_trace": "`%%gpumem --trace`",
    "loop_ops_timeline": "`%%gpumem --timeline`",
    "loop_ops_recording": "`--timeline`'s recording alone, nothing read back",
    "loop_empty": "cell alone: `torch.empty(256)` " + TIMES + "10,000",
    "loop_empty_gpumem": "`%%gpumem`",
    "loop_empty_trace": "`%%gpumem --trace`",
    "loop_empty_timeline": "`%%gpumem --timeline`",
    "loop_empty_recording": "`--timeline`'s recording alone, nothing read back",
}


def _table_gpumem(run: Run) -> Table:
    out = []
    for r in run.records:
        name = r.get("name")
        if "median" not in r or name not in GPUMEM_LABELS:
            continue
        cells = [
            GPUMEM_LABELS[name],
            f"{_ms(r['median'])} ({_ms(r['q1'])} to {_ms(r['q3'])})",
        ]
        ratio = r.get("ratio")
        if ratio is None and name.startswith("loop_") and name.count("_") > 1:
            ratio = r["median"] / _named(run, "_".join(name.split("_")[:2]))
        cells.append(f"{ratio:.3f}{TIMES}" if ratio is not None else "")
        out.append(cells)
    for r in run.rows(name="timeline_breakdown_ops"):
        out.append(
            [
                f"reading back {r['events']:,} events: snapshot / replay / SVG",
                f"{r['snapshot_ms']:.1f} / {r['replay_ms']:.1f} / {r['svg_ms']:.1f}",
                "",
            ]
        )
    for r in run.rows(name="recording_us_per_allocation"):
        names = {
            "off": "off",
            "trace": "--trace",
            "state_python": "--trace",
            "timeline": "--timeline",
            "torch_default_python": "torch's default",
            "all_python": "torch's default",
        }
        keys = [k for k in names if k in r]
        out.append(
            [
                "µs per `torch.empty(256)`: " + " / ".join(names[k] for k in keys),
                " / ".join(f"{r[k]:.2f}" for k in keys),
                "",
            ]
        )
    return ["measurement", "median, ms (IQR)", TIMES + " the cell alone"], out


def _table_sync(run: Run) -> Table:
    out = []
    for r in run.rows():
        if "case" not in r:
            continue
        unit = str(r.get("unit", ""))
        spread = f"{r['min']:.4g} to {r['max']:.4g}" if "min" in r else ""
        ratio = f"{r['ratio']:.2f}{TIMES}" if "ratio" in r else ""
        kernel = f"{r['kernel_ms']:.2f} ms" if "kernel_ms" in r else ""
        variant = str(r["variant"])
        out.append(
            [
                str(r["case"]),
                f"`{variant}`" if variant in ("per-op", "launch-blocking") else variant,
                f"{r['median']:.4g} {unit}",
                spread,
                ratio,
                kernel,
            ]
        )
    return ["case", "variant", "median", "min to max", "ratio", "kernel time"], out


def _table_plugin_overhead(run: Run) -> Table:
    r = run.one()
    out = []
    labels = (
        ("off", "`-p no:cuda` (anchor)"),
        ("core", "core only (leak and sync modules blocked)"),
        ("on", "whole plugin, as installed"),
    )
    for key, label in labels:
        times = [t * 1000 for t in r.get(f"{key}_s", [])]
        q = statistics.quantiles(times, n=4) if len(times) > 1 else [float("nan")] * 3
        diff = r.get(f"{key}_paired_diff_median_s")
        out.append(
            [
                label,
                f"{r[f'{key}_median_s'] * 1000:.0f} ({q[0]:.0f} to {q[2]:.0f})",
                "" if diff is None else f"{diff * 1000:+.1f} ({r[f'{key}_overhead_pct']:+.2f} %)",
                str(r.get(f"torch_imported_{key}", "")),
            ]
        )
    header = ["run", "median wall, ms (IQR)", "paired diff, ms (%)", "torch imported"]
    return header, out


def _table_lprun(run: Run) -> Table:
    s = run.one(kind="summary")
    out = [["line A's CUPTI kernel time", f"{s['cupti_matmul_ms']:.3f} ms"]]
    for key, value in s.items():
        if key.startswith("share_a_"):
            out.append([f"host time on line A / kernel time, {key[8:]}", f"{value:.1f} %"])
        elif key.startswith("gpu_column_ratio_"):
            out.append([f"GPU Time of line A / kernel time, {key[17:]}", f"{value:.2f} %"])
        elif key.startswith("overhead_us_"):
            out.append([f"overhead per line hit, {key[12:]}", f"{value:.2f} µs"])
        elif key.startswith("launch_ms_"):
            out.append([f"launch-bound loop per call, {key[10:]}", f"{value:.3f} ms"])
    out.append(["one idle `torch.cuda.synchronize()`", f"{s['idle_sync_us']:.2f} µs"])
    out.append(["the hook's raw synchronize", f"{s['idle_sync_raw_us']:.2f} µs"])
    return ["measurement", "median"], out


def _table_timing(run: Run) -> Table:
    methods = ("gpumagic", "gpumagic / CUPTI span", "torch Timer", "%timeit", "gpumagic --graph")
    cold = ("do_bench", "gpumagic --cold")
    out = []
    clocks = any("clock_mhz_min" in r for r in run.rows(kind="summary"))
    for r in run.rows(kind="summary"):
        cells = [str(r["workload"])]
        warm = r.get("cupti_warm_s")
        cells.append(f"{warm * 1e6:.1f} µs" if warm else "n/a")
        cells += [f"{r[m]:.3f}" if r.get(m) is not None else "n/a" for m in methods]
        cold_s = r.get("cupti_cold_s")
        cells.append(f"{cold_s * 1e6:.1f} µs" if cold_s else "n/a")
        cells += [f"{r[m]:.3f}" if r.get(m) is not None else "n/a" for m in cold]
        if clocks:
            cells += _timing_clock_cells(r)
        out.append(cells)
    header = [
        "workload",
        "CUPTI warm",
        "gpumagic",
        "÷ CUPTI span",
        "torch Timer",
        "`%timeit`",
        "`--graph`",
        "CUPTI cold",
        "do_bench",
        "`--cold`",
    ]
    if clocks:  # runs since issue 28 carry the clocks and the new timers
        header += ["`--timer cupti`", "SM MHz", "at default", "throttle", "IQR", "cold ÷ warm"]
    return header, out


def _timing_clock_cells(r: dict[str, Any]) -> list[str]:
    """Issue 28's columns of one workload: --timer cupti, the clock range %cudatime's
    runs read, their share at the default clock, NVML's reasons, their spread, the L2
    check."""
    low, high = r.get("clock_mhz_min"), r.get("clock_mhz_max")
    share, iqr = r.get("at_default_clock"), r.get("gpumagic_rel_iqr")
    cold = r.get("cold_warm_ratio")
    cupti = r.get("gpumagic --timer cupti")
    return [
        f"{cupti:.3f}" if cupti is not None else "n/a",
        f"{low}\N{EN DASH}{high}" if low is not None else "n/a",
        f"{share * 100:.0f} %" if share is not None else "n/a",
        ", ".join(r.get("throttle_reasons") or []) or "none",
        f"{iqr * 100:.1f} %" if iqr is not None else "n/a",
        f"{cold:.2f}{TIMES}" if cold is not None else "n/a",
    ]


def _table_holder_walk(run: Run) -> Table:
    """Per test and limit: the walk with the heap thawed first (the anchor) and young
    first, medians over the rounds, and whether each got to its end."""
    rows = []
    for r in run.rows(kind="summary"):
        limit = "none (trace)" if r["budget_s"] is None else f"{r['budget_s']:g} s"
        done = r["complete"]
        rows.append(
            [
                str(r["case"]),
                limit,
                f"{r['thawed_s'] * 1e3:.0f} ms" + ("" if done["thawed first"] else " (cut)"),
                f"{r['young_s'] * 1e3:.0f} ms" + ("" if done["young first"] else " (cut)"),
                f"{r['ratio_to_thawed']:.2f}",
                str(r["holders"]["young first"][0]) if r["holders"]["young first"] else "",
            ]
        )
    header = ["leaking test (CPU variant)", "limit", "thawed first", "young first"]
    return [*header, "ratio", "the first holder line (young first)"], rows


def _table_leak_teardown(run: Run) -> Table:
    """Per planted test: its median protocol time under each configuration."""
    configs: list[str] = []
    by_test: dict[str, dict[str, float]] = {}
    for r in run.rows(kind="row"):
        config = str(r["config"])
        if config not in configs:
            configs.append(config)
        by_test.setdefault(str(r["test"]), {})[config] = float(r["protocol_s"])
    rows = [
        [f"`{test}`", *(f"{times[c] * 1e3:.1f} ms" for c in configs)]
        for test, times in by_test.items()
    ]
    return ["test", *configs], rows


def _table_timing_stability(run: Run) -> Table:
    """Per strategy, over its rounds: the median of the rounds' medians and IQRs, the
    clock range and the share of power-capped runs."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in run.rows(kind="strategy"):
        by.setdefault(str(r["strategy"]), []).append(r)
    base = statistics.median(r["median_s"] for r in by["back-to-back"])
    rows = []
    for name, rounds in by.items():
        median = statistics.median(r["median_s"] for r in rounds)
        iqr = statistics.median(r["rel_iqr"] for r in rounds)
        clocks = [c for r in rounds for c in r["clocks_mhz"] if c is not None]
        reasons = sorted({why for r in rounds for why in r["reasons"]})
        rows.append(
            [
                name,
                f"{median * 1e6:.1f} µs",
                f"{median / base:.3f}",
                f"{iqr:.2%}",
                "yes" if iqr < 0.02 else "no",
                f"{min(clocks)}\N{EN DASH}{max(clocks)}" if clocks else "none read",
                f"{statistics.mean(r['throttled_share'] for r in rounds):.0%}",
                ", ".join(reasons) or "none",
            ]
        )
    header = ["strategy", "per matmul", "vs back-to-back", "IQR (median of rounds)"]
    return [*header, "IQR < 2 %", "SM MHz", "power-capped runs", "reasons"], rows


def _targets(run: Run) -> Table | None:
    rows = [
        [str(t["target"]), str(t["measured"]), "yes" if t.get("met") else "no"]
        for t in run.rows(kind="target")
    ]
    return (["target", "measured", "met"], rows) if rows else None


def _table_memory_limit(run: Run) -> Table:
    r = run.records[0]
    rows = []
    for suffix, where in (("", "one device in use"), ("_all_devices", "two devices in use")):
        if f"limit_cost_unrecorded{suffix}_us" not in r:
            continue
        rows += [
            [f"clean body, {where}", f"{r[f'body_recorded{suffix}_median_us']:.2f} µs"],
            [
                f"the limit's work around it, {where} (the limit's own recording: reset, "
                "one read at the end)",
                f"+{r[f'limit_cost_recorded{suffix}_us']:.2f} µs",
            ],
            [
                f"the limit's work around it, {where}, events not recorded (a read at each end)",
                f"+{r[f'limit_cost_unrecorded{suffix}_us']:.2f} µs",
            ],
        ]
    if "suite_tests" in r:
        rows.append(
            [
                f"{r['suite_tests']}-test suite, with a limit minus without (paired, median "
                f"of {r['suite_rounds']})",
                f"{r['suite_paired_diff_median_s']:+.2f} s ({r['suite_overhead_pct']:+.1f} %)",
            ]
        )
    return ["what", "median"], rows


TABLES: dict[str, Callable[[Run], Table]] = {
    "gpumem": _table_gpumem,
    "gpumem_timeline": _table_gpumem,
    "leaks": _table_leaks,
    "leaks_suite": _table_leaks_suite,
    "leaks_suite_torch": _table_leaks_suite_torch,
    "leaks_growing": _table_leaks_growing,
    "gc_freeze": _table_gc_freeze,
    "holder_walk": _table_holder_walk,
    "leak_teardown": _table_leak_teardown,
    "warm_ranks_gloo": _table_warm_ranks,
    "warm_ranks_nccl": _table_warm_ranks,
    "lprun": _table_lprun,
    "memory_limit": _table_memory_limit,
    "plugin_overhead": _table_plugin_overhead,
    "sync": _table_sync,
    "timing": _table_timing,
    "timing_clocks": _table_timing,
    "timing_stability": _table_timing_stability,
}


def describe(run: Run) -> str:
    """One sentence: which script ran where, with which versions, into which file."""
    env = run.env
    versions = ", ".join(f"{label} {env[key]}" for key, label in VERSIONS if key in env)
    driver = f" (driver {env['driver']})" if env.get("driver") else ""
    # "2 x NVIDIA H100", "CPU only (...)": already say how many.
    one = "" if run.device[:1].isdigit() or run.device.startswith("CPU") else "one "
    return (
        f"`benchmarks/{SCRIPTS.get(run.bench, run.bench)}` on {run.date}: {one}"
        f"{run.device}{driver}; {versions}. Result file: "
        f"`benchmarks/results/{run.file.name}`."
    )


# ---------------------------------------------------------------------------
# Sphinx


def _inline(text: str) -> list[Any]:
    """Text with ``code`` spans as literals."""
    from docutils import nodes

    # An option outside backticks would have its "--" turned into a dash by smartquotes.
    out: list[Any] = []
    for i, part in enumerate(re.split(r"`([^`]*)`", text)):
        if i % 2:
            out.append(nodes.literal(part, part))
            continue
        for j, piece in enumerate(re.split(r"(?<!\S)(--[A-Za-z][\w-]*)", part)):
            if piece:
                out.append(nodes.literal(piece, piece) if j % 2 else nodes.Text(piece))
    return out


def _table_node(header: list[str], rows: list[list[str]]) -> Any:
    from docutils import nodes

    table = nodes.table(classes=["bench-results"])
    group = nodes.tgroup(cols=len(header))
    table += group
    for _ in header:
        group += nodes.colspec(colwidth=1)

    def row_node(cells: list[str]) -> Any:
        row = nodes.row()
        for cell in cells:
            entry = nodes.entry()
            entry += nodes.paragraph("", "", *_inline(cell))
            row += entry
        return row

    head = nodes.thead()
    head += row_node(header)
    body = nodes.tbody()
    for cells in rows:
        body += row_node(cells + [""] * (len(header) - len(cells)))
    group += head
    group += body
    return table


def setup(app: Sphinx) -> dict[str, Any]:
    from docutils import nodes
    from sphinx.util import logging
    from sphinx.util.docutils import SphinxDirective

    logger = logging.getLogger(__name__)

    def bench_role(
        name: str, rawtext: str, text: str, lineno: int, inliner: Any, **_: Any
    ) -> tuple[list[Any], list[Any]]:
        key = text.strip()
        try:
            shown, _, run = figure(key)
        except KeyError as exc:
            msg = inliner.reporter.error(str(exc), line=lineno)
            return [inliner.problematic(rawtext, rawtext, msg)], [msg]
        inliner.document.settings.env.note_dependency(str(run.file))
        script = SCRIPTS.get(run.bench, run.bench)
        explanation = f"{script}, {run.short()} ({run.file.name})"
        noise = FIGURES[key].noise(run)
        if noise is not None:
            width = FIGURES[key].spread_text(noise.spread)
            explanation += f"; spread {width}: {noise.how}"
        node = nodes.abbreviation(shown, shown, explanation=explanation)
        return [node], []

    def date_role(
        name: str, rawtext: str, text: str, lineno: int, inliner: Any, **_: Any
    ) -> tuple[list[Any], list[Any]]:
        try:
            run = latest(text.strip())
        except KeyError as exc:
            msg = inliner.reporter.error(str(exc), line=lineno)
            return [inliner.problematic(rawtext, rawtext, msg)], [msg]
        inliner.document.settings.env.note_dependency(str(run.file))
        return [nodes.Text(run.short())], []

    class BenchRun(SphinxDirective):
        """The latest run's sentence and table; the directive's content, if any, is shown
        instead while no result file holds the benchmark (no content: a warning)."""

        required_arguments = 1
        has_content = True

        def run(self) -> list[Any]:
            bench = self.arguments[0]
            if bench not in TABLES:
                logger.warning(f"unknown benchmark {bench!r}", location=self.get_location())
                return []
            try:
                found = latest(bench)
            except KeyError as exc:
                if not self.content:
                    logger.warning(str(exc), location=self.get_location())
                    return []
                return self.parse_content_to_nodes()
            self.env.note_dependency(str(found.file))
            header, rows = TABLES[bench](found)
            shown = [
                nodes.paragraph("", "", *_inline("Latest run: " + describe(found))),
                _table_node(header, rows),
            ]
            targets = _targets(found)
            if targets is not None:
                shown.append(_table_node(*targets))
            return shown

    class BenchIndex(SphinxDirective):
        """A table of every benchmark's latest run: device, date, versions, file."""

        def run(self) -> list[Any]:
            rows = []
            for bench, runs in sorted(load().items()):
                run = runs[-1]
                self.env.note_dependency(str(run.file))
                env = run.env
                versions = ", ".join(
                    f"{label} {env[key]}" for key, label in VERSIONS[:3] if key in env
                )
                rows.append(
                    [
                        f"`{SCRIPTS.get(bench, bench)}`",
                        run.date,
                        run.device,
                        versions,
                        f"`{run.file.name}`",
                    ]
                )
            header = ["benchmark", "date", "device", "versions", "result file"]
            return [_table_node(header, rows)]

    app.add_role("bench", bench_role)
    app.add_directive("bench-index", BenchIndex)
    app.add_role("bench-date", date_role)
    app.add_directive("bench-run", BenchRun)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
