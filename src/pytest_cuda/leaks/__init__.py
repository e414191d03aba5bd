"""CUDA memory leak checks: the engine, its report, and the pytest glue.

* :mod:`~pytest_cuda.leaks.engine`: the arithmetic and the one check (settling,
  attribution, the verdict) that the pytest checker, ``no_cuda_leak`` and every rank
  process use;
* :mod:`~pytest_cuda.leaks.report`: what a check leaves on a test's report, as plain
  data that crosses from xdist workers and rank processes;
* :mod:`~pytest_cuda.leaks.stacks`, :mod:`~pytest_cuda.leaks.blocks`,
  :mod:`~pytest_cuda.leaks.heap`: allocation stacks, the allocator's blocks, the
  test's part of the heap;
* :mod:`~pytest_cuda.leaks.walk`: who holds a leaked tensor;
* :mod:`~pytest_cuda.leaks.plugin` and :mod:`~pytest_cuda.leaks.checker`: the pytest
  side (options' effects, the per-test measurement, the summary, JSON and JUnit).

The public names (``no_cuda_leak``, ``CudaLeakError``) are re-exported by
:mod:`pytest_cuda`. Importing this package imports nothing.
"""

__all__ = ()
