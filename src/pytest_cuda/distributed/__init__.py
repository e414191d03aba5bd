"""Multi-rank tests: ``@pytest.mark.cuda_distributed`` and the ``cuda_rank`` fixture.

* :mod:`~pytest_cuda.distributed.ranks`: the marker, a rank's identity, the verdict;
* :mod:`~pytest_cuda.distributed.plugin`: the pytest glue in the pytest process;
* :mod:`~pytest_cuda.distributed.job`: the job every rank reads (the test, and this run
  of it), a frozen dataclass;
* :mod:`~pytest_cuda.distributed.launch` and :mod:`~pytest_cuda.distributed.pool`: the
  rank processes, fresh or warm;
* :mod:`~pytest_cuda.distributed.rank_main`: what runs inside each rank, and
  :mod:`~pytest_cuda.distributed.module_import`: the test module imported there;
* :mod:`~pytest_cuda.distributed.leftovers`: what a test left behind on a warm rank;
* a run that torchrun, ``srun`` or ``mpirun`` started (``--cuda-ranks=env``):
  :mod:`~pytest_cuda.distributed.world` (the launcher's environment),
  :mod:`~pytest_cuda.distributed.launched` (the ranks' pytest processes and what they
  tell each other), :mod:`~pytest_cuda.distributed.world_watch` (one job's ranks
  across hosts) and :mod:`~pytest_cuda.distributed.launched_plugin` (the pytest glue).

Importing this package imports nothing.
"""

__all__ = ()
