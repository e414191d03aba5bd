"""The synchronous modes and the implicit-sync check on a real GPU.

``--cuda-sync=launch-blocking`` must take effect although a conftest creates the CUDA
context at import (and in xdist workers); ``cuda_no_sync`` must catch ``.item()``,
``.cpu()`` and ``nonzero()`` with the op and the line; the seam's calls behave in this
process. Runs that need a fresh process use ``runpytest_subprocess``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpumagic import cuda

pytestmark = pytest.mark.cuda

TIMEOUT = 240

# The conftest creates the context while pytest imports it: launch-blocking must
# already be in the environment then.
CONTEXT_AT_IMPORT = """
import torch

WARM = torch.ones(1, device="cuda")
"""

LAUNCH_ORDER = """
import os
import torch


def test_launch_waits_for_the_kernel():
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU time
    # Launch-blocking: the launch returned once the kernel had run, so the stream has
    # nothing left. Otherwise the kernel still runs: the host would have to stall for
    # all of it between these two lines to see the stream idle. No clock is read.
    blocked = torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    print(f"LAUNCH BLOCKED {blocked} ENV {os.environ.get('CUDA_LAUNCH_BLOCKING')}")
    assert blocked == (os.environ.get("EXPECT_BLOCKING") == "1")
"""


def _keep(name: str, result: pytest.RunResult) -> None:
    out = os.environ.get("OUT")
    if out:
        Path(out, "planted").mkdir(exist_ok=True)
        Path(out, "planted", f"sync-{name}.txt").write_text(
            result.stdout.str() + result.stderr.str()
        )


@pytest.mark.parametrize(
    ("args", "blocking"),
    [
        ((), False),
        (("--cuda-sync=launch-blocking",), True),
        (("--cuda-sync=launch-blocking", "-n", "2"), True),
    ],
    ids=["default", "launch-blocking", "launch-blocking-xdist"],
)
def test_launch_blocking_takes_effect_before_a_conftest_context(
    pytester: pytest.Pytester,
    monkeypatch: pytest.MonkeyPatch,
    args: tuple[str, ...],
    blocking: bool,
) -> None:
    monkeypatch.delenv("CUDA_LAUNCH_BLOCKING", raising=False)
    monkeypatch.setenv("EXPECT_BLOCKING", "1" if blocking else "0")
    pytester.makeconftest(CONTEXT_AT_IMPORT)
    pytester.makepyfile(test_launch=LAUNCH_ORDER)
    result = pytester.runpytest_subprocess("-s", *args, timeout=TIMEOUT)
    _keep("launch-" + "-".join(a.strip("-").replace("=", "-") for a in ("default", *args)), result)
    result.assert_outcomes(passed=1)
    if not args or "-n" not in args:
        result.stdout.fnmatch_lines([f"*LAUNCH BLOCKED {blocking} ENV *"])


def test_launch_blocking_refuses_a_context_created_by_a_plugin(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CUDA_LAUNCH_BLOCKING", raising=False)
    pytester.makepyfile(early_cuda_plugin=CONTEXT_AT_IMPORT)
    result = pytester.runpytest_subprocess(
        "-p", "early_cuda_plugin", "--cuda-sync=launch-blocking", timeout=TIMEOUT
    )
    _keep("launch-refused", result)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["ERROR: --cuda-sync=launch-blocking: CUDA was initialised in this process before*"]
    )


NO_SYNC_SUITE = """
import pytest
import torch


@pytest.fixture
def x():
    return torch.randn(1000, device="cuda")


@pytest.mark.cuda_no_sync
def test_item(x):
    y = x * 2
    total = y.sum().item()  # SYNC-ITEM


@pytest.mark.cuda_no_sync
def test_cpu(x):
    host = (x + 1).cpu()  # SYNC-CPU


@pytest.mark.cuda_no_sync
def test_nonzero(x):
    found = (x > 0).nonzero()  # SYNC-NONZERO


@pytest.mark.cuda_no_sync
def test_async_work_passes(x):
    w = torch.ones(1000, 1000, device="cuda")
    y = torch.relu(x @ w).mean()


@pytest.mark.cuda_no_sync
def test_explicit_synchronize_is_not_seen(x):
    y = x * 2
    torch.cuda.synchronize()


def test_the_mode_is_restored(x):
    assert torch.cuda.get_sync_debug_mode() == 0
    assert x.sum().item() != 1e9


def test_fixture_block(x, cuda_no_sync):
    scale = x.abs().max().item()  # outside the block: allowed
    with cuda_no_sync():
        y = x / scale
        peak = y.max().item()  # SYNC-BLOCK
"""


def _line(marker: str) -> int:
    # pytester writes the source stripped of its leading newline
    lines = NO_SYNC_SUITE.strip().splitlines()
    return next(i for i, line in enumerate(lines, 1) if marker in line)


def test_cuda_no_sync_catches_item_cpu_and_nonzero(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_nosync=NO_SYNC_SUITE)
    result = pytester.runpytest_subprocess("-rfE", "-p", "no:randomly", timeout=TIMEOUT)
    _keep("no-sync", result)
    result.assert_outcomes(passed=3, failed=4)
    prefix = "cuda_no_sync: implicit host-device synchronization:"
    result.stdout.fnmatch_lines(
        [
            f"{prefix} Tensor.item() * [[]aten._local_scalar_dense.default[]] at "
            f"test_nosync.py:{_line('SYNC-ITEM')} in test_item: "
            "total = y.sum().item()  # SYNC-ITEM",
        ]
    )
    result.stdout.fnmatch_lines(
        [f"{prefix} * at test_nosync.py:{_line('SYNC-CPU')} in test_cpu: host = (x + 1).cpu()*"]
    )
    result.stdout.fnmatch_lines(
        [
            f"{prefix} nonzero() * [[]aten.nonzero.default[]] at "
            f"test_nosync.py:{_line('SYNC-NONZERO')} in test_nonzero: *",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            f"{prefix} Tensor.item() * at "
            f"test_nosync.py:{_line('SYNC-BLOCK')} in test_fixture_block:*"
        ]
    )
    text = result.stdout.str()
    for passing in ("test_async_work_passes", "test_explicit_synchronize_is_not_seen"):
        assert f"FAILED test_nosync.py::{passing}" not in text
    assert "prototype" not in text
    # One line per failure: torch's own error is not printed above it.
    assert "During handling" not in text
    assert "called a synchronizing CUDA operation" not in text


# ---------------------------------------------------------------------------
# The seam's calls, in this process (nothing here poisons it).


def test_async_error_is_none_on_a_healthy_context() -> None:
    torch = cuda.torch_module()
    (torch.ones(10, device="cuda") * 2).sum()
    assert cuda.async_error() is None


def test_per_op_mode_computes_the_same_on_cuda() -> None:
    torch = cuda.torch_module()
    x = torch.randn(64, 64, device="cuda")
    expected = (x @ x).relu().sum(dim=0)
    with cuda.sync_after_each_op():
        got = (x @ x).relu().sum(dim=0)
    assert torch.equal(got, expected)


def test_per_op_mode_leaves_graph_capture_alone() -> None:
    torch = cuda.torch_module()
    x = torch.ones(8, device="cuda")
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        (x * 2).sum()  # warm up outside the capture
    torch.cuda.synchronize()
    with cuda.sync_after_each_op(), torch.cuda.graph(graph):
        y = x * 3
    graph.replay()
    torch.cuda.synchronize()
    assert y.sum().item() == 24


def test_forbid_implicit_sync_names_the_op_and_restores_the_mode() -> None:
    torch = cuda.torch_module()
    x = torch.randn(16, device="cuda")
    before = torch.cuda.get_sync_debug_mode()
    with pytest.raises(cuda.ImplicitSyncError) as raised, cuda.forbid_implicit_sync():
        x.sum().item()
    assert raised.value.op == "aten._local_scalar_dense.default"
    assert torch.cuda.get_sync_debug_mode() == before
    x.sum().item()  # allowed again
