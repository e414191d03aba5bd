"""Multi-rank tests: ``@pytest.mark.cuda_distributed`` and the ``cuda_rank`` fixture.

* :mod:`~pytest_cuda.distributed.ranks`: the marker, a rank's identity, the verdict;
* :mod:`~pytest_cuda.distributed.plugin`: the pytest glue in the pytest process;
* :mod:`~pytest_cuda.distributed.job`: the job every rank reads (the test, and this run
  of it), a frozen dataclass;
* :mod:`~pytest_cuda.distributed.launch` and :mod:`~pytest_cuda.distributed.pool`: the
  rank processes, fresh or warm;
* :mod:`~pytest_cuda.distributed.rank_main`: what runs inside each rank;
* :mod:`~pytest_cuda.distributed.leftovers`: what a test left behind on a warm rank.

Importing this package imports nothing.
"""

__all__ = ()
