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
already (the user's own :func:`gc.freeze`; Python 3.12 freezes a few hundred objects at
start-up), :meth:`TestHeap.begin` freezes nothing; the checker then collects the young
generations, and the whole heap only where the holder walk proved nothing.
"""

from __future__ import annotations

import gc

__all__ = ["TestHeap"]


class TestHeap:
    """One test's boundary in the heap: :meth:`begin` at its baseline, :meth:`thaw`
    once its memory is judged (always called, also when the check failed)."""

    __test__ = False  # not a pytest test class, despite its name

    def __init__(self) -> None:
        self.frozen = False
        #: How many objects were frozen before :meth:`begin` (by someone else).
        self.frozen_before = 0

    def begin(self) -> None:
        """Freeze the heap as it is, unless the collector is off or already frozen."""
        if self.frozen:
            return
        self.frozen_before = gc.get_freeze_count()
        if not gc.isenabled() or self.frozen_before:
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
