"""The CUDA calls of the debug modes in :mod:`gpumagic.cuda`, on the CPU (plain calls).

Their GPU behaviour is checked in ``test_sync_gpu.py`` and ``test_poison_gpu.py``.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from gpumagic import cuda
from gpumagic.cuda import debug

torch = pytest.importorskip("torch")


def test_async_error_without_a_context_touches_nothing() -> None:
    code = (
        "import sys\n"
        "from gpumagic import cuda\n"
        "assert cuda.async_error() is None\n"
        "assert 'torch' not in sys.modules\n"
        "import torch\n"
        "assert cuda.async_error() is None\n"
        "assert not torch.cuda.is_initialized()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_async_error_result() -> None:
    error = cuda.AsyncCudaError("CUDA error: device-side assert triggered", sticky=True)
    assert error.sticky
    assert error.message.startswith("CUDA error")


def test_per_op_mode_leaves_cpu_work_alone() -> None:
    initialised = torch.cuda.is_initialized()  # earlier GPU tests may have done it
    x = torch.arange(6.0)
    with cuda.sync_after_each_op():
        y = (x * 2 + 1).reshape(2, 3).sum(dim=1)
        parts = torch.split(x, 2)
        z = torch.cat(parts)
    assert y.tolist() == [9.0, 27.0]
    assert torch.equal(z, x)
    assert torch.cuda.is_initialized() == initialised


def test_per_op_mode_passes_op_errors_through_unchanged() -> None:
    with (
        pytest.raises(RuntimeError, match="must match the size") as raised,
        cuda.sync_after_each_op(),
    ):
        torch.ones(2) + torch.ones(3)
    assert not getattr(raised.value, "__notes__", None)


def test_per_op_mode_nests_and_unwinds() -> None:
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    assert _get_current_dispatch_mode() is None
    with cuda.sync_after_each_op(), cuda.sync_after_each_op():
        torch.ones(1) + 1
    assert _get_current_dispatch_mode() is None


def test_first_cuda_device_ignores_cpu_tensors() -> None:
    cpu = torch.ones(1)
    assert debug._first_cuda_device(torch, (cpu, [cpu], (), None, 3)) is None


def test_forbid_implicit_sync_needs_cuda() -> None:
    if cuda.status().available:
        pytest.skip("this machine has a GPU")
    with pytest.raises(cuda.CudaUnavailable), cuda.forbid_implicit_sync():
        pass


def test_implicit_sync_error_names_the_op() -> None:
    error = cuda.ImplicitSyncError("aten.nonzero.default", "called a synchronizing CUDA operation")
    assert isinstance(error, RuntimeError)
    assert error.op == "aten.nonzero.default"
    assert cuda.SYNC_WARNING_MESSAGE in str(error)
