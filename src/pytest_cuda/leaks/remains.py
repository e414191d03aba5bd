"""What pytest still holds of a test once it ran: its fixture values and, when it
failed, the failure's traceback (``sys.last_value``, ``sys.last_traceback``,
``sys.last_exc`` on Python 3.12+, and a unittest item's ``_excinfo``).

The leak checker drops them before judging, only for a test whose memory grew:
:func:`release_test_references` clears what pytest would drop anyway (the frames'
locals, the fixture values); :func:`drop_failure` lets go of the traceback itself,
which pytest keeps until the next test's call for ``pdb.pm()``. Memory that only the
traceback kept alive is then free: it was no leak.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from types import TracebackType

    import pytest

__all__ = ["clear_frames", "drop_failure", "release_test_references"]

_LAST = ("last_type", "last_value", "last_traceback", "last_exc")


def release_test_references(item: pytest.Item) -> None:
    """Drop what pytest still holds of the test before it would itself: the failed
    test's frames (every frame of every exception of its failure, chained or grouped)
    and the fixture values (``item.funcargs``, dropped right after this teardown)."""
    for exc in _chain(_failures(item)):
        clear_frames(exc.__traceback__)
    clear_frames(getattr(sys, "last_traceback", None))
    if getattr(item, "funcargs", None):
        item.funcargs = {}  # type: ignore[attr-defined]


def drop_failure(item: pytest.Item) -> bool:
    """Let go of the failed test's traceback (pytest drops it at the next test's call);
    whether there was one."""
    had = bool(_failures(item))
    for name in _LAST:
        if hasattr(sys, name):
            delattr(sys, name)
    if item.__dict__.get("_excinfo"):
        item.__dict__["_excinfo"] = []
    return had


def _failures(item: pytest.Item) -> list[BaseException]:
    """The exceptions pytest keeps of the test's failure."""
    found: list[BaseException] = []
    for name in ("last_value", "last_exc"):
        exc = getattr(sys, name, None)
        if isinstance(exc, BaseException):
            found.append(exc)
    # A unittest test's failures (pytest's TestCaseFunction); one of them each report
    # takes, the rest stays with the item.
    for info in item.__dict__.get("_excinfo") or ():
        exc = getattr(info, "value", None)
        if isinstance(exc, BaseException):
            found.append(exc)
    return found


def _chain(roots: list[BaseException]) -> list[BaseException]:
    """``roots`` and every exception they lead to: causes, contexts, a group's members."""
    seen: dict[int, BaseException] = {}
    pending = list(roots)
    while pending:
        exc = pending.pop()
        if id(exc) in seen:
            continue
        seen[id(exc)] = exc
        pending += [e for e in (exc.__cause__, exc.__context__) if e is not None]
        if isinstance(exc, BaseExceptionGroup):
            pending += exc.exceptions
    return list(seen.values())


def clear_frames(tb: TracebackType | None) -> None:
    """Clear every frame of ``tb`` that is done running: their variables are dropped."""
    while tb is not None:
        frame = tb.tb_frame
        try:
            frame.clear()
        except RuntimeError:  # still running
            pass
        else:
            # Before Python 3.13 a frame keeps the snapshot dict ``f_locals`` made for
            # the traceback's display; reading it again drops the cleared names.
            frame.f_locals  # noqa: B018
        tb = tb.tb_next
