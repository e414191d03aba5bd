"""The one-screen summary at the end of ``scripts/gpu-check.sh``.

    python scripts/gpu_check_summary.py LOGS --seconds N --exit STATUS

Reads what the check left in LOGS (``environment.txt``, the pytest phases' JUnit files
``pytest-*.xml``, ``notebook.rc``, ``benchmarks.rc``) and prints the device, passed /
failed / skipped per area of the suite, every failure with the end of its report (the
summary is the one file a job runner that returns few files must bring back), the ten
slowest tests and the total time.
"""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

OUTCOMES = ("passed", "failed", "error", "skipped")


@dataclass(frozen=True)
class Case:
    """One test case as JUnit recorded it."""

    phase: str
    nodeid: str
    outcome: str
    seconds: float
    #: The end of a failure's or an error's report (empty for the other outcomes).
    detail: str = ""


#: How many lines of each failure's report the summary keeps (its end: the assertion).
DETAIL_LINES = 25


def area(nodeid: str) -> str:
    """``tests/gpumagic/x.py::t`` -> ``gpumagic``; top-level test files -> ``docs, demo``."""
    parts = nodeid.split("::", 1)[0].split("/")
    return parts[1] if len(parts) > 2 else "docs, demo"


def _nodeid(case: ET.Element) -> str:
    classname = case.get("classname", "")
    name = case.get("name", "")
    module, _, klass = classname.partition(".Test")
    path = module.replace(".", "/") + ".py"
    return f"{path}::{'Test' + klass + '::' if klass else ''}{name}"


def _detail(case: ET.Element) -> str:
    for tag in ("failure", "error"):
        found = case.find(tag)
        if found is not None:
            text = (found.text or found.get("message") or "").rstrip()
            return "\n".join(text.splitlines()[-DETAIL_LINES:])
    return ""


def _outcome(case: ET.Element) -> str:
    for tag in ("failure", "error", "skipped"):
        if case.find(tag) is not None:
            return {"failure": "failed"}.get(tag, tag)
    return "passed"


def read_cases(logs: Path) -> list[Case]:
    cases = []
    for xml in sorted(logs.glob("pytest-*.xml")):
        phase = xml.stem.removeprefix("pytest-")
        for case in ET.parse(xml).iter("testcase"):
            seconds = float(case.get("time") or 0.0)
            cases.append(Case(phase, _nodeid(case), _outcome(case), seconds, _detail(case)))
    return cases


def _step(logs: Path, name: str) -> str | None:
    """``ok`` / ``FAILED …`` for the notebook or the benchmarks; ``None`` if not run."""
    rc = logs / f"{name}.rc"
    if not rc.exists():
        return None
    if name == "notebook":
        code = rc.read_text().strip()
        return "ok" if code == "0" else f"FAILED (exit {code}, see notebook.log)"
    rows = [line.rsplit(" ", 1) for line in rc.read_text().splitlines() if line.strip()]
    failed = [f"{script} (exit {code})" for script, code in rows if code != "0"]
    ok = len(rows) - len(failed)
    return f"{ok} ok" + (f", FAILED: {', '.join(failed)} (see benchmarks.log)" if failed else "")


def summary(logs: Path, seconds: int, status: int) -> str:
    lines = ["", "=" * 30 + " gpu-check summary " + "=" * 30]
    env = logs / "environment.txt"
    if env.exists():
        head = env.read_text().splitlines()
        lines += [line for line in head[1:4] if line.strip()]
        lines += [line for line in head if line.startswith("gpu-check:")]
    cases = read_cases(logs)
    if cases:
        counts: dict[str, Counter[str]] = {}
        for c in cases:
            counts.setdefault(area(c.nodeid), Counter())[c.outcome] += 1
        width = max(len(a) for a in counts)
        lines.append(f"{'tests':<{width}}  " + "  ".join(f"{o:>7}" for o in OUTCOMES))
        total: Counter[str] = Counter()
        for name in sorted(counts):
            total.update(counts[name])
            lines.append(
                f"{name:<{width}}  " + "  ".join(f"{counts[name][o]:>7}" for o in OUTCOMES)
            )
        lines.append(f"{'all':<{width}}  " + "  ".join(f"{total[o]:>7}" for o in OUTCOMES))
        phases = Counter(c.phase for c in cases)
        spent = {p: sum(c.seconds for c in cases if c.phase == p) for p in phases}
        lines.append(
            "phases: "
            + ", ".join(f"{p} {phases[p]} tests ({spent[p]:.0f} s of test time)" for p in phases)
        )
        bad = [c for c in cases if c.outcome in ("failed", "error")]
        for c in bad:
            lines.append(f"  {c.outcome.upper()} {c.nodeid}")
            lines += [f"      {line}" for line in c.detail.splitlines()]
        lines.append("slowest 10:")
        for c in sorted(cases, key=lambda c: -c.seconds)[:10]:
            lines.append(f"  {c.seconds:7.2f} s  {c.phase:<8} {c.nodeid}")
    else:
        lines.append("tests: not run")
    for name in ("notebook", "benchmarks"):
        step = _step(logs, name)
        if step is not None:
            lines.append(f"{name}: {step}")
    verdict = "PASSED" if status == 0 else "FAILED"
    lines.append(f"gpu-check {verdict} in {seconds} s (exit {status}; logs in {logs})")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", type=Path)
    parser.add_argument("--seconds", type=int, required=True, help="wall time of the check")
    parser.add_argument("--exit", type=int, required=True, help="the check's exit status")
    args = parser.parse_args()
    print(summary(args.logs, args.seconds, args.exit))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
