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


# ---------------------------------------------------------------------------
# Spread against effect: a figure its run cannot tell from noise says so, through the
# figure's ``Spread`` (bench_results.py), never in words a page types by hand.

#: Words a page used for a figure within its noise before the figures said it themselves.
NOISE_BY_HAND = re.compile(
    r"within the noise|(?:cannot|can't|could not) tell|noise being larger"
    r"|(?:less|lower|smaller) than (?:the|that|this|its) (?:run's )?noise"
    r"|below (?:the|that|this|its) (?:run's )?noise",
    re.IGNORECASE,
)
#: Sentence ends, table cells, list items and paragraphs.
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z`{(*])|\|| *\n\s*\n|\n\s*[-*] ")


def sentences(text: str) -> list[str]:
    return [s.strip() for s in SENTENCE_END.split(text) if s.strip()]


def cited(sentence: str) -> list[tuple[str, str | None]]:
    """``(figure key, number typed or None for a role)`` of every figure a sentence cites."""
    found: list[tuple[str, str | None]] = [(key, None) for key in ROLE.findall(sentence)]
    found += [(key, m.group(1)) for p, key in TYPED for m in p.finditer(sentence)]
    return found


def rendered(bench: ModuleType, sentence: str, folder: Path | None = None) -> str:
    """The sentence as the page shows it: every role replaced with its figure's text."""
    args = () if folder is None else (folder,)
    return ROLE.sub(lambda m: bench.figure(m.group(1), *args)[0], sentence)


def unmarked(bench: ModuleType, sentence: str, folder: Path | None = None) -> list[str]:
    """Keys of the figures a sentence comparing two figures or more cites within their
    noise without saying so (the noise wording must follow each such figure)."""
    found = cited(sentence)
    if len(found) < 2:
        return []
    args = () if folder is None else (folder,)
    runs = bench.load(*args)
    problems = []
    for key, typed in found:
        fig = bench.FIGURES[key]
        if fig.bench not in runs:
            continue
        run = bench.latest(fig.bench, *args)
        noise = fig.noise(run)
        if noise is None or not noise.within:
            continue
        if typed is None:
            shown = bench.figure(key, *args)[0]
            ok = shown in rendered(bench, sentence, folder) and bench.NOISE in shown
        else:
            ok = bench.NOISE in sentence
        if not ok:
            problems.append(key)
    return problems


def test_figures_within_their_noise_say_so(bench: ModuleType) -> None:
    """A sentence comparing two figures or more says so of each one within its noise."""
    problems = []
    for page in PAGES:
        for heading, body in sections(current(page)):
            for sentence in sentences(body):
                for key in unmarked(bench, sentence):
                    where = f"{page.relative_to(ROOT)} ({heading.strip('# ') or 'top'})"
                    problems.append(
                        f"{where}: {key} is within its run's noise and the sentence does "
                        f"not say so; cite it as {{bench}}`{key}`, which does: {sentence[:120]!r}"
                    )
    assert not problems, "\n".join(problems)


def test_no_page_words_a_figures_noise_by_hand(bench: ModuleType) -> None:
    """The noise of a cited figure comes from its Spread, not from the page's words (the
    words outlive the run that justified them)."""
    problems = []
    for page in PAGES:
        for sentence in sentences(current(page)):
            if cited(sentence) and NOISE_BY_HAND.search(ROLE.sub("", sentence)):
                problems.append(
                    f"{page.relative_to(ROOT)}: {sentence[:160]!r} words a figure's noise by "
                    "hand; declare the figure's Spread in docs/_ext/bench_results.py instead"
                )
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("page", "key"),
    [
        # issue 29, item 13: both were worded by hand.
        ("leaks.md", "leaks.trace_minus_check_us"),
        ("debugging.md", "sync.health_check_ms"),
    ],
)
def test_the_issue_cases_come_from_the_spread(bench: ModuleType, page: str, key: str) -> None:
    fig = bench.FIGURES[key]
    assert fig.spread is not None, key
    run = bench.latest(fig.bench)
    noise = fig.noise(run)
    assert noise is not None, f"{key}: {run.file.name} records no spread"
    text = (DOCS / page).read_text(encoding="utf-8")
    assert f"{{bench}}`{key}`" in text
    [sentence] = [s for s in sentences(prose(text)) if f"{{bench}}`{key}`" in s]
    assert not NOISE_BY_HAND.search(ROLE.sub("", sentence))
    # In the latest runs both are within their noise, and the page shows it.
    assert noise.within, (key, noise)
    assert f"{bench.NOISE}: spread " in rendered(bench, sentence)


def _leaks_record(**extra: Any) -> dict[str, Any]:
    return {
        "benchmark": "leaks",
        **ENV,
        "median_per_test_us": {
            "none": 1000.0,
            "check": 1100.0,
            "trace": 1110.0,
            "fixture none": 1000.0,
            "fixture check": 1150.0,
        },
        "overhead_per_test_us": {
            "none": 0.0,
            "check": 100.0,
            "trace": 112.0,
            "fixture none": 0.0,
            "fixture check": 150.0,
        },
        "check_overhead_pct": 10.0,
        "trace_overhead_pct": 11.2,
        **extra,
    }


def _results(tmp_path: Path, records: list[dict[str, Any]]) -> Path:
    import json

    folder = tmp_path / "results"
    folder.mkdir()
    lines = "\n".join(json.dumps(r) for r in records)
    (folder / "2026-11-21T0739-h200-test.jsonl").write_text(lines + "\n")
    return folder


def test_a_spread_wider_than_the_effect_is_said(bench: ModuleType, tmp_path: Path) -> None:
    # Trace +112 µs and check +100 µs, each over an IQR 40 µs wide: +12 µs is noise.
    iqr = {"check": [80.0, 120.0], "trace": [90.0, 130.0]}
    folder = _results(tmp_path, [_leaks_record(overhead_iqr_us=iqr)])
    text = bench.figure("leaks.trace_minus_check_us", folder)[0]
    assert text == "+12 µs (within the noise: spread 80 µs)"
    # The costs themselves stand well outside their IQRs.
    assert bench.figure("leaks.check_us", folder)[0] == "+100 µs"
    assert bench.figure("leaks.check_pct", folder)[0] == "+10.0 %"


def test_a_spread_narrower_than_the_effect_is_not(bench: ModuleType, tmp_path: Path) -> None:
    iqr = {"check": [98.0, 102.0], "trace": [110.0, 114.0]}
    folder = _results(tmp_path, [_leaks_record(overhead_iqr_us=iqr)])
    assert bench.figure("leaks.trace_minus_check_us", folder)[0] == "+12 µs"


def test_a_run_without_a_spread_says_nothing_of_it(bench: ModuleType, tmp_path: Path) -> None:
    folder = _results(tmp_path, [_leaks_record()])
    fig = bench.FIGURES["leaks.check_us"]
    assert fig.noise(bench.latest("leaks", folder)) is None
    assert bench.figure("leaks.check_us", folder)[0] == "+100 µs"
    # Without IQRs the difference's spread is its two estimates' gap: the paired costs
    # say +12 µs, the medians +10 µs; 2 µs is narrower than 12 µs.
    assert bench.figure("leaks.trace_minus_check_us", folder)[0] == "+12 µs"


def test_rounds_spread_a_suite_ratio(bench: ModuleType, tmp_path: Path) -> None:
    def row(label: str, walls: list[float]) -> dict[str, Any]:
        return {"bench": "leaks_suite", "label": label, "wall_s": sum(walls) / 2, "walls": walls}

    records = [
        {"bench": "leaks_suite", "kind": "environment", **ENV},
        row("plugin off", [40.0, 44.0]),
        row("plugin loaded", [44.0, 40.0]),  # 1.000, rounds 1.10 and 0.91: noise
        row("--cuda-leak-check", [48.0, 52.8]),  # 1.200, rounds 1.20 and 1.20
    ]
    folder = _results(tmp_path, records)
    assert bench.figure("leaks_suite.loaded_ratio", folder)[0] == (
        "1.000 (within the noise: spread 0.191)"
    )
    assert bench.figure("leaks_suite.check_ratio", folder)[0] == "1.200"
    # One round has no spread.
    records[1:] = [row("plugin off", [40.0]), row("plugin loaded", [44.0])]
    folder.joinpath("2026-11-21T0739-h200-test.jsonl").unlink()
    folder.rmdir()
    bench.load.cache_clear()
    folder = _results(tmp_path, records)
    assert bench.figure("leaks_suite.loaded_ratio", folder)[0] == "1.100"


@pytest.mark.parametrize(
    ("sentence", "found"),
    [
        # A hand-typed figure within its noise, compared with another, not said so.
        (
            "`--cuda-leak-check` costs +100 µs, {bench}`leaks.fixture_check_us` with a fixture.",
            ["leaks.check_us"],
        ),
        # The same through the role, which says so.
        ("{bench}`leaks.check_us`, {bench}`leaks.fixture_check_us` with a fixture.", []),
        # One figure compares nothing.
        ("`--cuda-leak-check` costs +100 µs.", []),
    ],
)
def test_an_unmarked_comparison_is_found(
    bench: ModuleType, tmp_path: Path, sentence: str, found: list[str]
) -> None:
    iqr = {"check": [0.0, 200.0], "trace": [90.0, 130.0], "fixture check": [140.0, 160.0]}
    folder = _results(tmp_path, [_leaks_record(overhead_iqr_us=iqr)])
    noise = bench.FIGURES["leaks.check_us"].noise(bench.latest("leaks", folder))
    assert noise is not None
    assert noise.within
    assert unmarked(bench, sentence, folder) == found


def test_without_iqrs_the_two_estimates_spread_the_difference(
    bench: ModuleType, tmp_path: Path
) -> None:
    # The latest leaks run's case: the paired costs put the trace 12 µs above the check,
    # the medians of a clean test 20 µs below it; their gap, 32 µs, is the spread.
    record = _leaks_record()
    record["median_per_test_us"]["trace"] = 1080.0
    folder = _results(tmp_path, [record])
    key = "leaks.trace_minus_check_us"
    assert bench.figure(key, folder)[0] == "+12 µs (within the noise: spread 32 µs)"
    noise = bench.FIGURES[key].noise(bench.latest("leaks", folder))
    assert noise is not None
    assert noise.how.startswith("no IQR recorded")
