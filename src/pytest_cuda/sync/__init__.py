"""Asynchronous CUDA errors: sync modes (``--cuda-sync``), hidden-sync checks
(``cuda_no_sync``), and a suite that survives a sticky error (``--cuda-on-poison``,
``--cuda-rerun-blocking``).

* :mod:`~pytest_cuda.sync.plugin`: the hooks loaded on every run;
* :mod:`~pytest_cuda.sync.modes`: the sync modes' per-test checks, and
  :mod:`~pytest_cuda.sync.checks`: the checks after each test phase, each imported when
  it has work;
* :mod:`~pytest_cuda.sync.poison`, :mod:`~pytest_cuda.sync.poison_report`,
  :mod:`~pytest_cuda.sync.continuation`: the cure for a poisoned CUDA context.

Importing this package imports nothing.
"""

__all__ = ()
