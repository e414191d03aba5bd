"""Python's cyclic garbage collector held off for a block of code.

A collection that starts inside a timed window charges its time to the code being
timed, and one that starts while thousands of new containers are being built (a
snapshot of the allocator's events) walks every object of the process, often more than
once. :func:`paused_gc` keeps it out of such blocks and leaves the collector as it
found it (a user who turned it off keeps it off).
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ["paused_gc"]


@contextmanager
def paused_gc() -> Iterator[None]:
    """Turn the cyclic collector off for the ``with`` block, then back on if it was on."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
