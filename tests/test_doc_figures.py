"""The measured figures the docs cite agree with the benchmark result files.

Pages cite the latest run through ``{bench}`KEY``` (``docs/_ext/bench_results.py``
reads ``benchmarks/results/``); every key must resolve. A figure typed by hand that
matches one of ``TYPED`` (the phrases the figures of the benchmarks were cited with)
must equal the latest run's value at the precision typed, or, in a section that names a
date and links to a subsection of performance.md's History (``performance.md#label``),
be typed there for the same figure (a dated older run, cited as such). performance.md's
History section itself is the record of those older runs.
Each benchmark's table renders from its latest file, and from records of the shape
its benchmark writes where no file holds it yet. No GPU, no Sphinx build.
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from collections.abc import Iterator
    from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted([*DOCS.glob("*.md"), *DOCS.glob("howto/*.md"), ROOT / "README.md"])
ROLE = re.compile(r"\{bench\}`([^`]+)`")
DATE_ROLE = re.compile(r"\{bench-date\}`([^`]+)`")
RUN_DIRECTIVE = re.compile(r"^(`{3,}|:{3,})\{bench-run\}\s+(\S+)\s*$", re.MULTILINE)
DATE = re.compile(r"20\d\d-\d\d-\d\d")
LINK = re.compile(r"performance(?:\.md)?#([\w-]+)")
NUMBER = r"([+\-\u2212]?\d+(?:\.\d+)?)"
#: Hand-typed phrases that cite a benchmark's figure: (pattern, figure key). The first
#: group is the number.
TYPED: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"(?<!≤ )(0\.0\d+) ms (?:per|a) test"), "sync.health_check_ms"),
    (re.compile(r"post-test (?:health )?check[^.|\n]{0,40}?(\d+\.\d+) ms"), "sync.health_check_ms"),
    (re.compile(r"per-op\b[^\u00d7\n]{0,80}?(\d+\.\d+)\u00d7"), "sync.per_op_x"),
    (re.compile(r"launch-blocking\b[^\u00d7\n]{0,80}?(\d+\.\d+)\u00d7"), "sync.launch_blocking_x"),
    (
        re.compile(r"--cuda-leak-check`?[ |:]*(?:about |costs? )?\+?(\d+(?:\.\d+)?) µs"),
        "leaks.check_us",
    ),
    (re.compile(r"--cuda-leak-trace`?[^%\n]{0,80}?" + NUMBER + r" ?%"), "leaks.trace_pct"),
    (
        re.compile(r"CudaMemoryLeakCheck`?[^\n]{0,60}?(\d+(?:\.\d+)?)(?: to \d+)? ms"),
        "leaks.torch_ms",
    ),
    (re.compile(r"whole plugin[^%\n]{0,40}?" + NUMBER + r" ?%"), "plugin_overhead.whole_pct"),
    (re.compile(r"kernels\s+take\s+(\d+) µs"), "timing.mm_kernel_us"),
    (re.compile(r"timed at (\d+) µs by `%timeit"), "timing.mm_timeit_us"),
    (re.compile(r"line_profiler charged (\d+(?:\.\d+)?) %"), "lprun.share_a_line_profiler_pct"),
]


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    sys.path.insert(0, str(DOCS / "_ext"))
    try:
        import bench_results

        yield bench_results
    finally:
        sys.path.remove(str(DOCS / "_ext"))


def prose(text: str) -> str:
    """The page without its fenced blocks (outputs and code are not citations); the
    fences of MyST directives are kept with their content."""
    kept: list[str] = []
    fence: str | None = None
    directive = False
    for line in text.splitlines():
        stripped = line.strip()
        found = re.match(r"(`{3,}|~{3,}|:{3,})(.*)", stripped)
        if fence is None and found:
            fence = found.group(1)
            directive = found.group(2).startswith("{") and "code" not in found.group(2)
            kept.append("" if not directive else line)
            continue
        if fence is not None and stripped == fence:
            fence = None
            kept.append("")
            continue
        kept.append(line if fence is None or directive else "")
    return "\n".join(kept)


def sections(text: str) -> list[tuple[str, str]]:
    """``[(heading, body)]``, split at every heading; the first heading is ``""``."""
    parts = re.split(r"^(#{1,6} .*)$", text, flags=re.MULTILINE)
    found = [("", parts[0])]
    found += [(parts[i], parts[i + 1]) for i in range(1, len(parts) - 1, 2)]
    return found


def history(page: Path) -> str:
    """performance.md from its History heading on: the typed record of older runs."""
    text = page.read_text(encoding="utf-8")
    start = text.index("\n## History")
    return text[start:]


def recorded(page: Path) -> set[tuple[str, str, str]]:
    """``(figure key, number as typed, label)`` of every typed figure of History, with
    the label (``(label)=``) of the subsection it is in."""
    found = set()
    parts = re.split(r"^\(([\w-]+)\)=\s*$", prose(history(page)), flags=re.MULTILINE)
    for label, body in zip(parts[1::2], parts[2::2], strict=True):
        for pattern, key in TYPED:
            for match in pattern.finditer(body):
                found.add((key, match.group(1), label))
    return found


def current(page: Path) -> str:
    text = prose(page.read_text(encoding="utf-8"))
    if page.name == "performance.md":
        text = text[: text.index("\n## History")]
    return text


def number(text: str) -> float:
    return float(text.replace("\u2212", "-").replace(",", ""))


def agrees(typed: str, value: float) -> bool:
    """``typed`` is ``value`` at the precision it was typed with."""
    decimals = len(typed.split(".")[1]) if "." in typed else 0
    return abs(number(typed) - round(value, decimals)) < 10 ** (-decimals) / 2 + 1e-9


def test_result_files_parse(bench: ModuleType) -> None:
    runs = bench.load()
    assert runs, "no result file under benchmarks/results"
    for name, found in runs.items():
        assert name in bench.SCRIPTS, f"{name}: which script wrote it? (SCRIPTS)"
        for run in found:
            assert DATE.fullmatch(run.date), (run.file.name, run.date)
            assert run.device != "unknown device", run.file.name
            assert run.file.name.startswith(run.date), (run.file.name, run.date)


def test_every_run_renders(bench: ModuleType) -> None:
    for name in bench.load():
        run = bench.latest(name)
        header, rows = bench.TABLES[name](run)
        assert rows, name
        assert all(len(row) <= len(header) for row in rows), name
        assert bench.describe(run).startswith("`benchmarks/")


def test_figures_of_every_run_resolve(bench: ModuleType) -> None:
    runs = bench.load()
    for key, fig in bench.FIGURES.items():
        if fig.bench in runs:
            text, value, _ = bench.figure(key)
            assert text, key
            assert math.isfinite(value), key


def test_roles_resolve(bench: ModuleType) -> None:
    problems = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for key in ROLE.findall(text):
            try:
                bench.figure(key)
            except KeyError as exc:
                problems.append(f"{page.name}: {exc}")
        for name in DATE_ROLE.findall(text):
            if name not in bench.load():
                problems.append(f"{page.name}: {{bench-date}}`{name}`: no result file")
    assert not problems, "\n".join(problems)


def test_bench_run_without_fallback_has_a_file(bench: ModuleType) -> None:
    text = (DOCS / "performance.md").read_text(encoding="utf-8")
    for found in RUN_DIRECTIVE.finditer(text):
        fence, name = found.groups()
        body = text[found.end() : text.index(fence, found.end())].strip()
        assert name in bench.TABLES, name
        assert body or name in bench.load(), f"{{bench-run}} {name}: no result file"


def test_typed_figures_agree(bench: ModuleType) -> None:
    """A typed figure is the latest run's, or a dated one found in History."""
    record = recorded(DOCS / "performance.md")
    runs = bench.load()
    problems = []
    for page in PAGES:
        for heading, body in sections(current(page)):
            for pattern, key in TYPED:
                for found in pattern.finditer(body):
                    typed = found.group(1)
                    where = f"{page.relative_to(ROOT)} ({heading.strip('# ') or 'top'})"
                    fig = bench.FIGURES[key]
                    if fig.bench in runs and agrees(typed, bench.figure(key)[1]):
                        continue
                    labels = LINK.findall(body)
                    if DATE.search(heading + body) and any(
                        (key, typed, label) in record for label in labels
                    ):
                        continue
                    latest = bench.figure(key)[0] if fig.bench in runs else "no result file"
                    problems.append(
                        f"{where}: {found.group(0)!r} types {typed} for {key} (latest: "
                        f"{latest}); cite {{bench}}`{key}`, or name the run's date and link "
                        "to the History subsection of performance.md that records it"
                    )
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("text", "key", "value"),
    [
        ("the post-test check costs 0.032 ms per test", "sync.health_check_ms", "0.032"),
        (
            "`--cuda-sync=per-op` | a synchronize after every op: 1.61\u00d7 on",
            "sync.per_op_x",
            "1.61",
        ),
        ("| `--cuda-leak-check` | about 70 µs (two reads)", "leaks.check_us", "70"),
        ("`--cuda-leak-trace` | about 86 µs: 16 % of a suite", "leaks.trace_pct", "16"),
        ("PyTorch's `CudaMemoryLeakCheck`, same process | 60 to 134 ms", "leaks.torch_ms", "60"),
        (
            "the whole plugin \u22120.58 % (paired median)",
            "plugin_overhead.whole_pct",
            "\u22120.58",
        ),
        # issue 29: the README's figures had no result file.
        ("a 4096³ bf16\nmatmul whose kernels take 170 µs is", "timing.mm_kernel_us", "170"),
        ("is timed at 12 µs by `%timeit -n 100`", "timing.mm_timeit_us", "12"),
        ("line_profiler charged 21.7 % of a", "lprun.share_a_line_profiler_pct", "21.7"),
    ],
)
def test_typed_patterns_find_the_issue_cases(text: str, key: str, value: str) -> None:
    """The phrases of the disagreements once found between pages are recognised."""
    matches = [(k, m.group(1)) for p, k in TYPED for m in p.finditer(text)]
    assert (key, value) in matches


def test_agrees_at_typed_precision() -> None:
    assert agrees("0.026", 0.02559)
    assert not agrees("0.032", 0.02559)
    assert agrees("+114", 113.8)
    assert agrees("\u22120.58", -0.5812)
    assert not agrees("1.61", 1.53)


# Records of the shape each benchmark writes, for the benchmarks no committed file holds
# yet: their tables must render when one arrives.
ENV: dict[str, Any] = {
    "device": "NVIDIA H200",
    "torch": "2.11.0+cu130",
    "cuda": "13.0",
    "pytest": "9.1.1",
    "python": "3.12.3",
    "date": "2026-11-21",
}
SHAPES: dict[str, list[dict[str, Any]]] = {
    "sync": [
        {
            "bench": "sync",
            "case": "pytest suite of 200 small-op tests, per test",
            "variant": variant,
            "unit": "ms",
            "median": median,
            "min": median * 0.98,
            "max": median * 1.02,
            "ratio": median / 0.7016,
            **ENV,
        }
        for variant, median in (
            ("default", 0.7016),
            ("plugin off", 0.676),
            ("hooks only (check swapped out)", 0.691),
            ("per-op", 1.074),
            ("launch-blocking", 0.8443),
        )
    ]
    + [
        {
            "bench": "sync",
            "case": "health check per test (default - plugin off)",
            "variant": "default",
            "unit": "ms per test",
            "median": 0.02559,
            "target_ms": 0.05,
            **ENV,
        },
        {
            "bench": "sync",
            "case": "of which the plugin's hooks (hooks only - plugin off)",
            "variant": "default",
            "unit": "ms per test",
            "median": 0.01496,
            **ENV,
        },
        {
            "bench": "sync",
            "case": "gpumagic.cuda.async_error() per call",
            "variant": "idle GPU",
            "unit": "us",
            "median": 2.139,
            "min": 1.98,
            "max": 60.9,
            **ENV,
        },
        {
            "bench": "sync",
            "case": "tiny ops (4000 launches)",
            "variant": "per-op",
            "unit": "ms",
            "median": 64.86,
            "min": 64.1,
            "max": 66.9,
            "ratio": 2.52,
            "kernel_ms": 3.43,
            **ENV,
        },
    ],
    "plugin_overhead": [
        {
            "benchmark": "plugin_overhead",
            "date": "2026-11-21T07:45:00Z",
            "device": "NVIDIA H200",
            "python": "3.12.3",
            "pytest": "9.1.1",
            **{f"{n}_median_s": 0.92 for n in ("off", "core", "on")},
            **{f"{n}_s": [0.91, 0.92, 0.93] for n in ("off", "core", "on")},
            **{f"torch_imported_{n}": False for n in ("off", "core", "on")},
            "core_paired_diff_median_s": -0.0137,
            "core_overhead_pct": -1.49,
            "on_paired_diff_median_s": -0.0054,
            "on_overhead_pct": -0.58,
            "discovery_median_ms": 57.24,
        }
    ],
}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_tables_render_from_the_benchmarks_shape(
    bench: ModuleType, name: str, tmp_path: Path
) -> None:
    import json

    folder = tmp_path / "results"
    folder.mkdir()
    lines = "\n".join(json.dumps(r) for r in SHAPES[name])
    (folder / "2026-11-21T0739-h200-test.jsonl").write_text(lines + "\n")
    run = bench.latest(name, folder)
    _, rows = bench.TABLES[name](run)
    assert rows
    for key, fig in bench.FIGURES.items():
        if fig.bench == name and key not in (
            "sync.async_error_no_context_us",
            "sync.mlp_per_op_x",
            "sync.launch_blocking_child_x",
        ):
            assert bench.figure(key, folder)[0], key
    assert bench.figure(f"{name}.{'per_op_x' if name == 'sync' else 'whole_pct'}", folder)[0] in (
        "1.53\u00d7",
        "\u22120.58 %",
    )
