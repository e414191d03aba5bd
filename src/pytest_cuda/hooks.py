"""pytest_cuda's own hooks, for a project's ``conftest.py`` or a plugin (added by
:func:`pytest_cuda.plugin.pytest_addhooks`, as pytest-xdist adds its ``newhooks``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pytest_cuda.leaks.report import LeakReport

__all__ = ["pytest_cuda_leak_report"]


@pytest.hookspec(firstresult=True)
def pytest_cuda_leak_report(report: LeakReport, item: pytest.Item) -> LeakReport | None:
    """A leak check of ``item`` has its result: act on it before it becomes the test's.

    Called at the test's teardown for each check of a test checked for leaks (the
    pytest process's own, and one per rank of a ``cuda_distributed`` test, ``report.rank``
    set), in the process that makes the verdict: an xdist worker, not the controller.
    ``report`` (:class:`~pytest_cuda.leaks.report.LeakReport`, frozen) holds the verdict
    (``report.verdict``: ``clean``, ``kept``, ``warned`` or ``leaked``), the amounts, the
    allocating line and the holder, and ``report.to_dict()`` its plain data.

    Return ``None`` to leave it as it is (to upload it, count it, open an issue), or a
    report to put in its place: ``report.accepted("known leak: issue 12")`` keeps a
    known leak as kept (the test passes, the JSON report and the summary say why),
    ``dataclasses.replace(report, mode="warn")`` makes it a warning. The first hook
    that returns a report decides; the report it returns is the one the outcome, the
    ``--cuda-leak-report`` file, the JUnit properties and the summary show.
    """
