"""CUDA memory leak arithmetic: what a test left allocated, after settling, and where.

The pure core of pytest_cuda's leak checks. It never imports pytest and
touches CUDA only through :mod:`gpumagic.cuda`:

* **Readings** are this process's caching-allocator bytes per device
  (:class:`CudaMemory`), never driver-wide numbers, so other processes on the GPU
  (pytest-xdist workers, a notebook) cannot move them.
* **Settling** (:func:`settle`) runs the cheap-first ladder of :class:`SettleStep` s:
  young garbage, the memory libraries keep by design (cuBLAS/cuBLASLt workspaces, cuFFT
  plans), a full garbage collection, blocks waiting on other streams (and, only when
  asked, torch.compile's caches); it re-measures after each step and stops as soon as
  nothing is over the tolerance. No step sleeps, and none changes what the code under
  test does next.
* **Attribution** reads one allocator snapshot taken with allocation-stack recording on:
  the event ring says which live blocks were allocated since the check began
  (:func:`blocks_allocated_since`, the diff against the start), and those are grouped
  by the user frames of their allocating stack, largest first (:func:`group_by_stack`).
* **Text**: :meth:`LeakResult.summary` (one line) and :meth:`LeakResult.details`.

:func:`no_cuda_leak` puts the pieces together for a block of code.
"""

from __future__ import annotations

import gc
import os
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal, Protocol

from gpumagic import cuda
from gpumagic.stacks import StackGroup, short_path
from gpumagic.units import format_bytes, parse_size
from pytest_cuda.leaks.stacks import StackRecording, attribute
from pytest_cuda.leaks.walk.holders import LIBRARY

if TYPE_CHECKING:
    from types import TracebackType

    from pytest_cuda.leaks.walk.holders import LeakHolderScan

__all__ = [
    "FULL_COLLECTION",
    "LIBRARY_STEP",
    "MODES",
    "CudaLeakError",
    "CudaLeakWarning",
    "CudaMemory",
    "LeakResult",
    "MemorySource",
    "Mode",
    "NoCudaLeak",
    "Release",
    "Rerun",
    "SettleStep",
    "growth",
    "kept_by_library",
    "no_cuda_leak",
    "parse_leak_settings",
    "settle",
]

Mode = Literal["fail", "warn", "off"]
#: ``fail``: a leak fails; ``warn``: it is reported without failing; ``off``: no check.
MODES: tuple[Mode, ...] = ("fail", "warn", "off")

#: At most this many stacks in a report (frames per stack: :data:`gpumagic.stacks.MAX_FRAMES`).
MAX_STACKS = 8

Readings = Mapping[int, int]


class CudaLeakError(AssertionError):
    """Code left CUDA memory allocated; the message says how much, on which device, and
    (with stack recording) which lines allocated it."""


class CudaLeakWarning(UserWarning):
    """A leak found by a check in ``mode="warn"``; the message is the full report."""


# ---------------------------------------------------------------------------
# Settings.


def parse_leak_settings(
    tolerance: object = 0, mode: object = "fail", *, where: str = "cuda_leak_check"
) -> tuple[int, Mode]:
    """``(tolerance in bytes, mode)`` from a marker's or a call's arguments.

    ``tolerance`` is bytes per device (an int, or a size such as ``"4KiB"``); ``mode``
    is one of :data:`MODES`. Raises :class:`ValueError` naming ``where`` otherwise.
    """
    try:
        if isinstance(tolerance, bool) or not isinstance(tolerance, int | float | str):
            raise ValueError(f"not a memory size: {tolerance!r}")
        size = parse_size(tolerance)
    except ValueError as exc:
        raise ValueError(
            f"{where}: tolerance must be a size in bytes >= 0 (an int or a string such "
            f'as "4KiB"), got {tolerance!r} ({exc})'
        ) from None
    if mode not in MODES:
        raise ValueError(
            f"{where}: mode must be one of {', '.join(repr(m) for m in MODES)}, got {mode!r}"
        )
    return size, mode


# ---------------------------------------------------------------------------
# Readings and settling.


class MemorySource(Protocol):
    """Where readings come from, and how to settle them (a fake one in the tests)."""

    def read(self) -> dict[int, int]:
        """Allocated bytes per device; ``{}`` while CUDA is not initialised."""
        ...

    def settle_steps(self) -> Sequence[SettleStep]:
        """The steps that release what is not a leak, cheapest and gentlest first."""
        ...


@dataclass(frozen=True)
class SettleStep:
    """One rung of the settling ladder.

    ``run`` gets the devices still over the tolerance and returns whether it did
    anything (``False``: nothing to release, so no re-measure). ``at_start``: the step
    is also run before :func:`no_cuda_leak` takes its first reading, so that what was
    held before the block cannot be released during the check and hide a leak.
    """

    name: str
    run: Callable[[tuple[int, ...]], bool]
    at_start: bool = False


@dataclass(frozen=True)
class Release:
    """What one settle step gave back, in bytes per device."""

    step: str
    freed: dict[int, int]


def growth(before: Readings, after: Readings, held: Readings | None = None) -> dict[int, int]:
    """``after - before - held`` per device (``held``: memory known not to be the code's
    own, such as a fixture of a wider scope set up in between). Missing readings are 0."""
    held = held or {}
    devices = sorted(set(before) | set(after) | set(held))
    return {d: after.get(d, 0) - before.get(d, 0) - held.get(d, 0) for d in devices}


def _over(current: Mapping[int, int], tolerance: int) -> dict[int, int]:
    return {d: g for d, g in current.items() if g > tolerance}


@dataclass(frozen=True)
class Rerun:
    """What a leaking test showed when re-run alone in a fresh process
    (``--cuda-leak-reruns``): its allocating line and holder, the report, or why there
    is none (it leaks only after the tests before it)."""

    top: str | None = None
    holder: str | None = None
    details: str = ""
    note: str = ""
    library: str | None = None  # alone, only a library cache held it: which

    def lines(self) -> list[str]:
        if self.note:
            return [f"Re-run alone in a fresh process: {self.note}"]
        lines = ["Re-run alone in a fresh process:"]
        return lines + [f"  {line}" for line in self.details.splitlines()]


@dataclass(frozen=True)
class LeakResult:
    """The verdict of one check.

    ``leaked``: bytes per device over the baseline for the devices over the tolerance
    (empty: no leak). ``growth``: the final figure for every device read. ``released``:
    the settle steps that ran and what each gave back. ``stacks``: the blocks still
    alive grouped by allocating stack, ``None`` when stacks were not recorded, with
    ``stack_note`` saying why or how to get them.
    """

    leaked: dict[int, int]
    growth: dict[int, int]
    tolerance: int
    released: tuple[Release, ...] = ()
    stacks: tuple[StackGroup, ...] | None = None
    stack_note: str = ""
    holders: LeakHolderScan | None = None
    rerun: Rerun | None = None

    @property
    def clean(self) -> bool:
        return not self.leaked

    def kept_by_libraries(self) -> list[tuple[str, dict[int, int]]]:
        """The settle steps that gave memory back, with what they freed (non-zero only)."""
        return [(r.step, r.freed) for r in self.released if any(v > 0 for v in r.freed.values())]

    def amounts(self) -> str:
        """``"8.0 MiB on cuda:0, 512 B on cuda:1"``."""
        return ", ".join(f"{format_bytes(b)} on cuda:{d}" for d, b in sorted(self.leaked.items()))

    def top_frame(self, root: str | None = None) -> str | None:
        """The innermost user line of the largest stack, when stacks were recorded."""
        for group in self.stacks or ():
            if group.frames:
                return group.frames[0].describe(root)
        return None

    def summary(self, subject: str, root: str | None = None) -> str:
        """One line: who leaked how much where, and the top allocating line if known."""
        text = (
            f"CUDA memory leak: {subject} left {self.amounts()} allocated "
            f"(tolerance {format_bytes(self.tolerance)})"
        )
        top, holder = self.top_frame(root), self.holder()
        if top is None and holder is None and self.rerun is not None:
            top, holder = self.rerun.top, self.rerun.holder
            if top or holder:
                text += " (re-run alone)"
        text = f"{text}, allocated at {top}" if top else text
        return f"{text}, held by {holder}" if holder else text

    def holder(self) -> str | None:
        """The largest holder that Python objects reach, when the walk ran, or why
        there is none: what holds the blocks on the C++ side, or that the walk ran out
        of time. ``None`` when no walk ran."""
        scan = self.holders
        if scan is None:
            return None
        found = scan.first()
        # A holder the walk reached; a block's allocating library call is only a guess
        # when the walk stopped before reading everything.
        if found is not None and (scan.complete or scan.holders[0].tensors):
            return found
        if not scan.complete:
            return (
                "an unknown holder (the search stopped at its time limit; "
                "--cuda-leak-trace searches to the end)"
            )
        if scan.hidden:
            return (
                f"an unknown holder ({scan.hidden} objects frozen by gc.freeze() are "
                "invisible to the search)"
            )
        if scan.holders:
            top = scan.holders[0]
            if top.path.startswith("no Python object"):
                return f"{top.path} ({top.kind})"
            return f"no Python object: {top.path} ({top.kind})"
        return (
            "no Python object ("
            + ("; ".join(scan.notes) or "no live tensor shows the blocks")
            + ")"
        )

    def details(self, subject: str, root: str | None = None) -> str:
        """The report section: amounts, how they were measured, the allocating stacks."""
        lines = []
        for device, amount in sorted(self.leaked.items()):
            lines.append(
                f"{subject} left {format_bytes(amount)} ({amount:,} B) allocated on "
                f"cuda:{device}; tolerance {format_bytes(self.tolerance)}."
            )
        steps = ", ".join(r.step for r in self.released) or "no settling needed"
        lines.append(f"Measured in this process's caching allocator after: {steps}.")
        if self.stacks is None:
            if self.stack_note:
                lines.append(self.stack_note)
            if self.rerun is not None:
                lines += self.rerun.lines()
            return "\n".join(lines)
        if not self.stacks:
            lines.append(
                "No block allocated during the check is still alive: the growth is in "
                "blocks allocated earlier or by allocations recorded without a stack."
            )
            return "\n".join(lines)
        lines.append("Blocks still alive, by allocating stack (largest first):")
        for group in self.stacks[:MAX_STACKS]:
            lines.append(f"  {group.describe()}")
            if group.frames:
                lines.extend(f"    {frame.describe(root)}" for frame in group.frames)
            else:
                lines.append("    (no stack: allocated while recording was off)")
        rest = self.stacks[MAX_STACKS:]
        if rest:
            size = sum(g.size for g in rest)
            lines.append(f"  ... and {len(rest)} more stacks holding {format_bytes(size)}")
        if self.stack_note:
            lines.append(self.stack_note)
        lines += self._holder_lines()
        if self.rerun is not None:
            lines += self.rerun.lines()
        return "\n".join(lines)

    def _holder_lines(self) -> list[str]:
        if self.holders is None:
            return []
        lines = ["Who holds them (the reference path from a root, largest first):"]
        lines += [f"  {holder.describe()}" for holder in self.holders.holders[:MAX_STACKS]]
        if not self.holders.holders:
            lines.append("  no live tensor shows these blocks")
        lines += [f"  ({note})" for note in self.holders.notes]
        return lines


def settle(
    before: Readings,
    source: MemorySource,
    tolerance: int,
    *,
    held: Readings | None = None,
    after: Readings | None = None,
) -> LeakResult:
    """Compare ``source``'s reading with ``before``; while a device is over
    ``tolerance``, run the next settle step and re-measure.

    ``after``: a reading already taken (saves one read on the clean path). ``held``:
    bytes per device that are not the code's own (see :func:`growth`).
    """
    current = dict(source.read() if after is None else after)
    excess = growth(before, current, held)
    released: list[Release] = []
    for step in source.settle_steps():
        still = _over(excess, tolerance)
        if not still:
            break
        if not step.run(tuple(sorted(still))):
            continue
        now = source.read()
        freed = {d: current.get(d, 0) - now.get(d, 0) for d in sorted(set(current) | set(now))}
        released.append(Release(step.name, freed))
        current = now
        excess = growth(before, current, held)
    return LeakResult(_over(excess, tolerance), excess, tolerance, tuple(released))


#: The release step of growth that only libraries' caches hold (:func:`kept_by_library`).
LIBRARY_STEP = "held by a library cache"

#: The settle step that collects garbage in the whole heap (or, where the heap older
#: than the test is frozen, in what the test made).
FULL_COLLECTION = "garbage collection"


def kept_by_library(result: LeakResult) -> LeakResult:
    """Growth that only libraries' caches hold (torch.compile's, a singleton's), as the
    holder walk found (here, in the re-run alone, or in a rank), is kept by design: not a leak.
    It is listed with what the settle steps released, under the holder's path."""
    holders = result.holders.holders if result.holders is not None else ()
    # Every leaked block lies in a tensor a library cache holds (a block no tensor
    # shows is a holder of its own kind), and those blocks make up the growth.
    reached = result.holders.found if result.holders is not None else 0
    if (
        holders
        and all(h.kind == LIBRARY for h in holders)
        and reached + result.tolerance * len(result.leaked) >= sum(result.leaked.values())
    ):
        step = f"{LIBRARY_STEP}: {holders[0].path}"
    elif result.rerun is not None and result.rerun.library:
        step = f"{LIBRARY_STEP}: {result.rerun.library} (re-run alone)"
    else:
        return result
    released = (*result.released, Release(step, dict(result.leaked)))
    return replace(result, leaked={}, released=released)


def _collect_young(devices: tuple[int, ...]) -> bool:
    gc.collect(1)
    return True


def _collect_all(devices: tuple[int, ...]) -> bool:
    gc.collect()
    return True


def _release_cached_blocks(devices: tuple[int, ...]) -> bool:
    cuda.release_cached_blocks(devices)
    return True


@dataclass(frozen=True)
class CudaMemory:
    """This process's caching allocator, read and settled through :mod:`gpumagic.cuda`.

    Reading costs one nested C call per device (about 8 µs) and touches nothing
    before CUDA is initialised. Settling changes nothing the code under test relies
    on: collecting garbage, and releasing what libraries re-create on demand (cuBLAS
    workspaces, cuFFT plans, cached blocks). ``reset_caches`` adds
    ``torch._dynamo.reset()``, which throws compiled code away (later calls compile
    again): only when the user asks for it (``--cuda-leak-reset-caches``).
    """

    reset_caches: bool = False

    def read(self) -> dict[int, int]:
        return cuda.allocated_bytes()

    def settle_steps(self) -> Sequence[SettleStep]:
        # Cheapest first. A full collection costs 339 ms (median) in a large suite's
        # process (torch_geometric's, on an H100) and was the whole 24 s of settling
        # there, while every one of its 71 runs left the growth to the next step, the
        # cuBLAS workspaces (0.03 ms): the library caches go before the full collection.
        # No step sleeps, and none drops what the suite would have to rebuild
        # differently: workspaces, plans and cached blocks come back on demand, the same.
        steps = (
            SettleStep("young garbage (gc generation 1)", _collect_young),
            SettleStep(
                "cuBLAS/cuBLASLt workspaces",
                lambda d: cuda.release_blas_workspaces(),
                at_start=True,
            ),
            SettleStep("cuFFT plan caches", cuda.clear_fft_plan_caches, at_start=True),
            SettleStep(FULL_COLLECTION, _collect_all, at_start=True),
            SettleStep(
                "blocks freed on other streams (synchronize, empty_cache)",
                _release_cached_blocks,
                at_start=True,
            ),
        )
        if not self.reset_caches:
            return steps
        return (
            *steps,
            SettleStep(
                "torch.compile caches (torch._dynamo.reset, --cuda-leak-reset-caches)",
                lambda d: cuda.reset_compile_caches(),
            ),
        )


# ---------------------------------------------------------------------------
# A block of code: ``with no_cuda_leak(): ...``.


@dataclass
class NoCudaLeak:
    """The context manager behind :func:`no_cuda_leak`; after the block, ``result`` holds
    the :class:`LeakResult` (``None`` when the block raised)."""

    tolerance: int = 0
    mode: Mode = "fail"
    trace: bool = True
    source: MemorySource = field(default_factory=CudaMemory)
    #: How reports name what was checked; default "the block at <file>:<line>".
    subject: str | None = None
    result: LeakResult | None = field(default=None, init=False)
    _before: dict[int, int] = field(default_factory=dict, init=False, repr=False)
    _start_us: int = field(default=0, init=False, repr=False)
    _frozen_before: int = field(default=0, init=False, repr=False)
    _recording: StackRecording | None = field(default=None, init=False, repr=False)
    _where: str = field(default="the block", init=False, repr=False)
    _caller: tuple[str, str] | None = field(default=None, init=False, repr=False)

    def __enter__(self) -> NoCudaLeak:
        caller = sys._getframe(1)
        self._caller = (caller.f_code.co_filename, caller.f_code.co_name)
        self._where = self.subject or (
            f"the block at {short_path(caller.f_code.co_filename, os.getcwd())}:{caller.f_lineno}"
        )
        self.result = None
        if self.mode == "off":
            return self
        if self.trace:
            self._recording = StackRecording()
            if cuda.is_initialized():
                self._recording.ensure()
            else:
                self._recording.ensure_at_init()
        self._before = self._settled_start()
        self._start_us = time.time_ns() // 1000
        self._frozen_before = gc.get_freeze_count()
        return self

    def _settled_start(self) -> dict[int, int]:
        """The first reading, taken once garbage and library caches held from before the
        block are released: otherwise the check could release them and hide a leak."""
        reading = self.source.read()
        if reading:
            devices = tuple(sorted(reading))
            for step in self.source.settle_steps():
                if step.at_start:
                    step.run(devices)
            reading = self.source.read()
        return reading

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]:
        __tracebackhide__ = True  # pytest shows the ``with`` line, not this method
        if self.mode == "off":
            return False
        try:
            if exc is not None:
                # Its frames still hold the block's locals: any figure would be wrong.
                exc.add_note(f"no_cuda_leak: {self._where} raised, so it was not checked")
                return False
            result = settle(self._before, self.source, self.tolerance)
            if not result.clean:
                result = kept_by_library(self._with_stacks(result))
            self.result = result
        finally:
            if self._recording is not None:
                self._recording.close()
        if result.clean:
            return False
        root = os.getcwd()
        text = f"{result.summary(self._where, root)}\n{result.details(self._where, root)}"
        if self.mode == "fail":
            raise CudaLeakError(text)
        warnings.warn(CudaLeakWarning(text), stacklevel=2)
        return False

    def _with_stacks(self, result: LeakResult) -> LeakResult:
        if self._recording is None:
            return replace(
                result,
                stack_note="Stacks not recorded: no_cuda_leak(trace=True) names the lines "
                "that allocated these blocks.",
            )
        if not cuda.memory_history_enabled():
            return replace(
                result,
                stack_note="Stacks not recorded: CUDA was first used inside the block "
                "before torch was imported; import torch before the block.",
            )
        stacks, holders = attribute(
            self._start_us, result.leaked, self._caller, frozen_before=self._frozen_before
        )
        return replace(result, stacks=stacks, holders=holders)


def no_cuda_leak(
    tolerance: int | str = 0, *, mode: Mode = "fail", trace: bool = True
) -> NoCudaLeak:
    """Check that a block of code leaves no CUDA memory allocated.

    ``with no_cuda_leak(): ...`` measures this process's caching allocator on every
    device before and after the block (after garbage collection and after releasing
    what libraries keep by design: cuBLAS/cuBLASLt workspaces, cuFFT plans, blocks
    waiting on other streams, torch.compile caches). Growth above ``tolerance`` bytes
    per device (an int or a size like ``"4KiB"``) raises :class:`CudaLeakError`
    (``mode="warn"``: a :class:`CudaLeakWarning`) naming the amounts and, with
    ``trace`` (recording allocation stacks for the block: about 2 µs per CUDA
    allocation), the lines that allocated the blocks still alive. A block that raises
    is not checked. Without CUDA it checks nothing. Also a pytest fixture.
    """
    size, checked = parse_leak_settings(tolerance, mode, where="no_cuda_leak")
    return NoCudaLeak(tolerance=size, mode=checked, trace=trace)
