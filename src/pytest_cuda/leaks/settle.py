"""Readings and settling: what a check's code left allocated, once what is not a leak
is released.

* **Readings** are this process's caching-allocator bytes per device
  (:class:`CudaMemory`), never driver-wide numbers, so other processes on the GPU
  (pytest-xdist workers, a notebook) cannot move them.
* **Settling** (:func:`settle`) runs the cheap-first ladder of :class:`SettleStep` s:
  young garbage, the memory libraries keep by design (cuBLAS/cuBLASLt workspaces, cuFFT
  plans), a full garbage collection, blocks waiting on other streams (and, only when
  asked, torch.compile's caches); it re-measures after each step and stops as soon as
  nothing is over the tolerance. No step sleeps, and none changes what the code under
  test does next.
* **Library caches** (:func:`kept_by_library`): growth that only a library's cache
  holds, as the holder walk found, is kept by design.

Touches CUDA only through :mod:`gpumagic.cuda`; never imports pytest.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from gpumagic import cuda
from pytest_cuda.leaks.result import LeakResult, Release

__all__ = [
    "FULL_COLLECTION",
    "LIBRARY_STEP",
    "CudaMemory",
    "MemorySource",
    "Readings",
    "SettleStep",
    "Steps",
    "growth",
    "kept_by_library",
    "over",
    "settle",
]

Readings = Mapping[int, int]

#: The release step of growth that only libraries' caches hold (:func:`kept_by_library`).
LIBRARY_STEP = "held by a library cache"

#: The settle step that collects garbage in the whole heap (or, where the heap older
#: than the check is frozen, in what the check's code made).
FULL_COLLECTION = "garbage collection"


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
    is also run before a check that settles its start takes its first reading, so that
    what was held before cannot be released during the check and hide a leak.
    """

    name: str
    run: Callable[[tuple[int, ...]], bool]
    at_start: bool = False


@dataclass(frozen=True)
class Steps:
    """A source read as ``source`` is, settled by ``steps`` alone."""

    source: MemorySource
    steps: tuple[SettleStep, ...]

    def read(self) -> dict[int, int]:
        return self.source.read()

    def settle_steps(self) -> Sequence[SettleStep]:
        return self.steps

    @classmethod
    def without(cls, source: MemorySource, name: str) -> Steps:
        """``source`` with its settle step ``name`` left out."""
        return cls(source, tuple(s for s in source.settle_steps() if s.name != name))


def growth(before: Readings, after: Readings, held: Readings | None = None) -> dict[int, int]:
    """``after - before - held`` per device (``held``: memory known not to be the code's
    own, such as a fixture of a wider scope set up in between). Missing readings are 0."""
    held = held or {}
    devices = sorted(set(before) | set(after) | set(held))
    return {d: after.get(d, 0) - before.get(d, 0) - held.get(d, 0) for d in devices}


def over(current: Mapping[int, int], tolerance: int) -> dict[int, int]:
    """The devices whose growth is past ``tolerance``, with their growth."""
    return {d: g for d, g in current.items() if g > tolerance}


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
        still = over(excess, tolerance)
        if not still:
            break
        if not step.run(tuple(sorted(still))):
            continue
        now = source.read()
        freed = {d: current.get(d, 0) - now.get(d, 0) for d in sorted(set(current) | set(now))}
        released.append(Release(step.name, freed))
        current = now
        excess = growth(before, current, held)
    return LeakResult(over(excess, tolerance), excess, tolerance, tuple(released))


def kept_by_library(result: LeakResult) -> LeakResult:
    """Growth that only libraries' caches hold (torch.compile's, a singleton's), as the
    holder walk found (here, in the re-run alone, or in a rank), is kept by design: not a leak.
    It is listed with what the settle steps released, under the holder's path."""
    scan = result.holders
    # Every leaked block lies in a tensor a library cache holds (a block no tensor
    # shows is a holder of its own kind), and those blocks make up the growth.
    if (
        scan is not None
        and scan.holders
        and scan.only_libraries
        and scan.found + result.tolerance * len(result.leaked) >= sum(result.leaked.values())
    ):
        step = f"{LIBRARY_STEP}: {scan.holders[0].path}"
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
