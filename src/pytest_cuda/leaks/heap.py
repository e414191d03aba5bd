"""The objects a test made, told apart from the rest of the heap.

A full garbage collection walks every object of the process: in a large suite's
process (torch, the suite, compiled code) that is 0.3-0.5 s, paid again by every test
whose memory grew. :class:`TestHeap` puts the heap that existed before the test began
into the collector's permanent generation (:func:`gc.freeze`), so a collection at the
test's end walks only what the test made; :meth:`TestHeap.thaw` puts it back.

What the test made is where its leaked tensors are (:meth:`TestHeap.young_objects`
lists it cheaply), and a garbage cycle made by the test is collected as usual. Garbage
that includes older objects is not: a checker that wants a verdict beyond doubt thaws
and collects everything (:meth:`TestHeap.collect_everything`) whenever the holder walk could not
prove the leaked memory reachable.

Never touches a collector the user changed: when gc is disabled or something is frozen
already by someone (the user's own :func:`gc.freeze`, a plugin's), :meth:`TestHeap.begin`
freezes nothing; the checker then collects the young generations, and the whole heap
only where the holder walk proved nothing. What the interpreter freezes by itself is no
one's change (:func:`interpreter_frozen`: CPython 3.12 freezes a few hundred immortal
tuples of its built-in types at start-up): the boundary is drawn on top of it, and the
first thaw puts those tuples into the oldest generation with the rest, as any
:func:`gc.unfreeze` does (immortal, no collection frees them).
"""

from __future__ import annotations

import functools
import gc
import subprocess
import sys

__all__ = ["TestHeap", "interpreter_frozen"]


@functools.cache
def interpreter_frozen() -> int:
    """How many objects this interpreter freezes by itself before any code runs: read
    once from a bare interpreter of the same executable (``-I -S``); 0 when that cannot
    be run (then nothing frozen counts as the interpreter's)."""
    try:
        done = subprocess.run(
            [sys.executable, "-I", "-S", "-c", "import gc; print(gc.get_freeze_count())"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        return int(done.stdout)
    except (OSError, ValueError, subprocess.SubprocessError):
        return 0


class TestHeap:
    """One test's boundary in the heap: :meth:`begin` at its baseline, :meth:`thaw`
    once its memory is judged (always called, also when the check failed)."""

    __test__ = False  # not a pytest test class, despite its name

    def __init__(self) -> None:
        self.frozen = False
        #: How many objects were frozen before :meth:`begin` (by someone else).
        self.frozen_before = 0

    def begin(self) -> None:
        """Freeze the heap as it is, unless the collector is off or someone froze
        objects already (the interpreter's own start-up freeze aside)."""
        if self.frozen:
            return
        self.frozen_before = gc.get_freeze_count()
        if not gc.isenabled():
            return
        if self.frozen_before and self.frozen_before != interpreter_frozen():
            return
        gc.freeze()
        self.frozen = True

    def young_objects(self) -> list[object] | None:
        """The objects made since :meth:`begin` (``None`` when nothing was frozen:
        then every object is a candidate)."""
        return gc.get_objects() if self.frozen else None

    def thaw(self) -> None:
        """The frozen heap back into the collector's oldest generation."""
        if self.frozen:
            self.frozen = False
            gc.unfreeze()

    def collect_everything(self, devices: tuple[int, ...] = ()) -> bool:
        """A full collection over the whole heap, older objects included (a settle
        step's signature: ``devices`` is not needed, and it always ran)."""
        self.thaw()
        gc.collect()
        return True
