"""CUDA memory leak checks: one engine, its report, and the pytest glue.

* :mod:`~pytest_cuda.leaks.engine`: the one check (:class:`~pytest_cuda.leaks.engine.LeakCheck`,
  ``begin``/``finish``) that the pytest checker, ``no_cuda_leak`` and every rank
  process run;
* :mod:`~pytest_cuda.leaks.settle` and :mod:`~pytest_cuda.leaks.result`: readings and
  the settling ladder; the verdict and its text;
* :mod:`~pytest_cuda.leaks.block`: ``no_cuda_leak``, a block of code checked;
* :mod:`~pytest_cuda.leaks.report`: what a check leaves on a test's report, as plain
  data that crosses from xdist workers and rank processes;
* :mod:`~pytest_cuda.leaks.recording`, :mod:`~pytest_cuda.leaks.heap`: allocation-stack
  recording, the checked code's part of the heap;
* :mod:`~pytest_cuda.leaks.stacks`, :mod:`~pytest_cuda.leaks.blocks`: a leak's
  allocating stacks and its blocks' holders (imported at the first leak);
* :mod:`~pytest_cuda.leaks.walk`: who holds a leaked tensor;
* :mod:`~pytest_cuda.leaks.plugin`, :mod:`~pytest_cuda.leaks.checker`,
  :mod:`~pytest_cuda.leaks.remains`, :mod:`~pytest_cuda.leaks.peaks` and
  :mod:`~pytest_cuda.leaks.rerun`: the pytest side (options' effects, the per-test
  check, what pytest keeps of a test, the peaks, re-runs, the summary, JSON and JUnit).

The public names (``no_cuda_leak``, ``CudaLeakError``) are re-exported by
:mod:`pytest_cuda`. Importing this package imports nothing.
"""

__all__ = ()
