"""pytest_cuda's command-line surface: every ``--cuda-*`` option, the ini values and the
marker lines, declared once for the entry point (:mod:`pytest_cuda.plugin`), and the
options each opt-in mode serves (:data:`MODE_OPTIONS`).

The modes the entry point loads (:mod:`pytest_cuda.leaks.plugin`,
:mod:`pytest_cuda.sync.plugin`, :mod:`pytest_cuda.distributed.plugin`) read these
options through :func:`pytest_cuda.settings.settings_of`. Declaring them here keeps
``pytest --help`` and ``--markers`` whole, and the markers known, even where one mode
is switched off with ``-p no:``. Values are checked as argparse reads them (the
``type=`` functions below), so a bad one is a usage error before any test runs. Nearly
a leaf module: it imports :mod:`pytest_cuda.selection` only to check a device list.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from _pytest.config.argparsing import Parser

__all__ = [
    "DISTRIBUTED_MODE",
    "ENV_DEVICES",
    "LEAK_MODE",
    "MARKER_LINES",
    "MODE_OPTIONS",
    "OOM_ACTIONS",
    "POISON_ACTIONS",
    "SYNC_MODE",
    "SYNC_MODES",
    "add_options",
]

ENV_DEVICES = "PYTEST_CUDA_DEVICES"
SYNC_MODES = ("launch-blocking", "per-op")
POISON_ACTIONS = ("continue", "stop", "skip")
OOM_ACTIONS = ("fail", "skip")

#: The plugin names of the opt-in modes, fixed: ``-p no:<name>`` switches one off
#: (:data:`pytest_cuda.plugin.MODE_PLUGINS` registers each module under its name).
LEAK_MODE = "pytest_cuda.leak_plugin"
SYNC_MODE = "pytest_cuda.sync_plugin"
DISTRIBUTED_MODE = "pytest_cuda.distributed_plugin"

#: The command-line options each mode serves, as ``(dest, flag)``. One given while its
#: mode is switched off would do nothing: :mod:`pytest_cuda.settings` refuses it. The
#: other options (devices, ``--cuda-require``) serve every mode.
MODE_OPTIONS: dict[str, tuple[tuple[str, str], ...]] = {
    LEAK_MODE: (
        ("cuda_leak_check", "--cuda-leak-check"),
        ("cuda_leak_trace", "--cuda-leak-trace"),
        ("cuda_leak_report", "--cuda-leak-report"),
        ("cuda_leak_reset_caches", "--cuda-leak-reset-caches"),
        ("cuda_leak_reruns", "--cuda-leak-reruns"),
        ("cuda_memory_report", "--cuda-memory-report"),
        ("cuda_limit_memory", "--cuda-limit-memory"),
        ("cuda_oom", "--cuda-oom"),
        ("cuda_memory_snapshot", "--cuda-memory-snapshot"),
    ),
    SYNC_MODE: (
        ("cuda_sync", "--cuda-sync"),
        ("cuda_on_poison", "--cuda-on-poison"),
        ("cuda_rerun_blocking", "--cuda-rerun-blocking"),
    ),
    DISTRIBUTED_MODE: (
        ("cuda_ranks", "--cuda-ranks"),
        ("cuda_rank_logs", "--cuda-rank-logs"),
    ),
}

CUDA_MARKER_DOC = (
    "cuda(min_devices=1, min_memory=None, min_capability=None): the test needs CUDA: "
    "at least min_devices usable CUDA devices, min_memory free on each device it is "
    'given (bytes or "40GiB"), and a compute capability of at least min_capability '
    '((8, 0) or "8.0"). Without them the test is skipped with the reason (an error '
    "under --cuda-require). With markers on the test, its class and its module, the "
    "strictest value of each keyword wins."
)

CUDA_LEAK_CHECK_MARKER_DOC = (
    "cuda_leak_check(tolerance=None, mode='fail'): fail the test when it leaves more than "
    "tolerance bytes per device (an int or a size like '4KiB'; default: the "
    "cuda_leak_tolerance ini value, 0 unless set) allocated in this "
    "process's CUDA caching allocator, after garbage collection and after releasing "
    "what libraries keep by design. mode='warn' reports without failing; mode='off' "
    "skips the check (also under --cuda-leak-check)."
)

CUDA_LIMIT_MEMORY_MARKER_DOC = (
    'cuda_limit_memory(size): fail the test when its peak CUDA memory (bytes or "512MiB", '
    "this process's caching allocator, per device, what it held before the test "
    "included) goes over size; the failure shows the peak, the limit and the largest "
    "blocks alive at the peak with the lines that allocated them. Overrides "
    "--cuda-limit-memory and the cuda_limit_memory ini value for the test."
)

CUDA_SYNC_MARKER_DOC = (
    "cuda_sync: synchronize after every torch operation of this test (as "
    "--cuda-sync=per-op does for every test), so an asynchronous CUDA error is raised "
    "at the op and line that caused it."
)

CUDA_NO_SYNC_MARKER_DOC = (
    "cuda_no_sync: fail the test if its body makes the host wait for the GPU "
    "implicitly (.item(), .cpu(), nonzero(), bool(tensor)...), naming the op and the "
    'line. Uses torch.cuda.set_sync_debug_mode("error") and restores the previous '
    "mode; explicit torch.cuda.synchronize() and syncs outside torch are not seen. "
    "The cuda_no_sync fixture does the same for a with-block."
)

CUDA_DISTRIBUTED_MARKER_DOC = (
    'cuda_distributed(world_size=2, backend="nccl", timeout=60, fresh_group=False, '
    "isolate=False): run the test function in world_size rank processes with the "
    "default torch.distributed process group "
    "initialised; the ranks are kept warm and reused by the next test of the same "
    "world_size, backend and devices (fresh_group=True: a process group of its own; "
    "isolate=True: fresh processes of its own). On a GPU backend each rank gets its own "
    "device of the selected ones, and the test is skipped with the reason (fails under "
    "--cuda-require) when there are fewer. backend='gloo' runs on the CPU. Fixture "
    "values are pickled and sent to the ranks; the cuda_rank fixture gives each its "
    "rank, world_size, device and group. The test fails if any rank fails, naming it, "
    "or leaves state behind (a process group, a torch flag, an environment variable); "
    "after timeout seconds every rank's Python stack is reported and all are stopped."
)

#: The ``pytest --markers`` lines, in the order they are shown.
MARKER_LINES = (
    CUDA_MARKER_DOC,
    CUDA_LEAK_CHECK_MARKER_DOC,
    CUDA_LIMIT_MEMORY_MARKER_DOC,
    CUDA_SYNC_MARKER_DOC,
    CUDA_NO_SYNC_MARKER_DOC,
    CUDA_DISTRIBUTED_MARKER_DOC,
)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"takes a number of devices, 1 or more; got {text!r}")
    return value


def _test_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"takes a number of tests, 0 or more; got {text!r}")
    return value


def _memory_size(text: str) -> int:
    from gpumagic.units import parse_size

    try:
        value = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"takes a size above 0 bytes; got {text!r}")
    return value


def _device_list(text: str) -> str:
    """``--cuda-devices`` as written, once its grammar is checked (which devices exist
    is known only after discovery, in ``pytest_configure``)."""
    from pytest_cuda.selection import SelectionError, parse_device_request

    source = f"--cuda-devices={text}"
    try:
        parse_device_request(text, source)
    except SelectionError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{source}: ")) from None
    return text


def add_options(parser: Parser) -> None:
    """Add every pytest_cuda option to one ``pytest --help`` section."""
    title = f"CUDA (pytest_cuda): devices, leak checks, sync modes; env ${ENV_DEVICES}"
    group = parser.getgroup("cuda", title)
    # Each dest is given: pytest then does not compare it with every option so far.
    group.addoption(
        "--cuda-devices",
        dest="cuda_devices",
        metavar="INDICES",
        type=_device_list,
        default=None,
        help="the CUDA devices this run may use: indices into the visible devices "
        "(an outer CUDA_VISIBLE_DEVICES is respected), e.g. 0,1, or 'all'. Tests "
        "taking cuda_device run once per device; under pytest-xdist each worker is "
        f"pinned to its own device(s). Also ini cuda_devices and env {ENV_DEVICES}.",
    )
    group.addoption(
        "--cuda-devices-per-worker",
        dest="cuda_devices_per_worker",
        metavar="K",
        type=_positive_int,
        default=None,
        help="under pytest-xdist, give each worker K of the selected devices "
        "(default 1); -n auto then starts one worker per group.",
    )
    group.addoption(
        "--cuda-require",
        dest="cuda_require",
        action="store_true",
        default=False,
        help="strict mode for GPU CI: a test that would be skipped for lack of a GPU, "
        "devices, memory or compute capability is an error at its setup instead, with the "
        "same reason; with no usable CUDA device at all the run stops at once (a usage "
        "error), whatever its tests are.",
    )
    parser.addini(
        "cuda_devices",
        type="string",
        default="",
        help="default for --cuda-devices (indices such as 0,1, or 'all').",
    )
    group.addoption(
        "--cuda-leak-check",
        dest="cuda_leak_check",
        action="store_true",
        default=False,
        help="fail every test that leaves CUDA memory allocated (this process's caching "
        "allocator, per device, after garbage collection and after releasing what "
        "cuBLAS and cuFFT keep by design and re-create on demand). A leak's report names "
        "the line that allocated it and who holds it (the Python stack of each live "
        "block is recorded while checks run). Tests that never use CUDA cost a few "
        "microseconds. Also ini cuda_leak_check.",
    )
    parser.addini(
        "cuda_leak_check",
        type="bool",
        default=False,
        help="default for --cuda-leak-check (true or false; -o cuda_leak_check=false "
        "overrides it for one run).",
    )
    group.addoption(
        "--cuda-leak-trace",
        dest="cuda_leak_trace",
        action="store_true",
        default=False,
        help="the thorough holder search: without it, the search for who holds a leak "
        "stops after cuda_leak_holder_search seconds per test (0.3 by default; a large "
        "heap may need more) and says so; with it, it goes to the end. Applies to the "
        "tests checked by --cuda-leak-check or the cuda_leak_check marker.",
    )
    group.addoption(
        "--cuda-leak-report",
        dest="cuda_leak_report",
        metavar="FILE",
        default=None,
        help="write every checked test's leak verdict to FILE as JSON (bytes per device, "
        "tolerance, the allocating line, the holder), for CI artifacts and dashboards; "
        "under pytest-xdist the controller writes one file for all workers.",
    )
    parser.addini(
        "cuda_leak_holder_search",
        type="string",
        default="0.3",
        help="how long the search for who holds a leak may take per leaking test, in "
        "seconds (default 0.3; each step up the references scans the heap once). A "
        "search that runs out says so; --cuda-leak-trace lifts the limit.",
    )
    parser.addini(
        "cuda_leak_tolerance",
        type="string",
        default="0",
        help="the leak check's default tolerance in bytes per device (an int or a size "
        "like '4KiB'); a cuda_leak_check(tolerance=...) marker overrides it per test.",
    )
    group.addoption(
        "--cuda-leak-reset-caches",
        dest="cuda_leak_reset_caches",
        action="store_true",
        default=False,
        help="before judging a test leaking, also call torch._dynamo.reset(), which "
        "throws away the compiled code of torch.compile (later calls compile again, so "
        "the suite runs differently than without the check). Off by default: compiled "
        "graphs' memory is then reported with its holder.",
    )
    group.addoption(
        "--cuda-leak-reruns",
        dest="cuda_leak_reruns",
        metavar="N",
        type=_test_count,
        default=0,
        help="also re-run each of the first N leaking tests alone in a fresh pytest "
        "process, and say whether it leaks there too (a leak that appears only after "
        "other tests depends on them). Default 0: never (each re-run costs a process "
        "that imports torch and the suite again).",
    )
    group.addoption(
        "--cuda-memory-report",
        dest="cuda_memory_report",
        type=_test_count,
        default=0,
        metavar="N",
        help="after the run, list the N tests with the largest peak CUDA memory "
        "(resets the allocator's peak counters at the start of each test).",
    )
    group.addoption(
        "--cuda-limit-memory",
        dest="cuda_limit_memory",
        type=_memory_size,
        default=None,
        metavar="SIZE",
        help="fail every test whose peak CUDA memory on any of its devices goes over SIZE "
        "(bytes or a size such as 8GiB; this process's caching allocator, what it held "
        "before the test included; per rank in cuda_distributed tests). The failure shows "
        "the peak and the largest blocks alive at it with their allocating lines "
        "(allocation stacks are recorded). A cuda_limit_memory(size) marker overrides it "
        "per test. Also ini cuda_limit_memory.",
    )
    parser.addini(
        "cuda_limit_memory",
        type="string",
        default="",
        help="default for --cuda-limit-memory (a size such as 8GiB; empty: no limit).",
    )
    group.addoption(
        "--cuda-oom",
        dest="cuda_oom",
        choices=OOM_ACTIONS,
        default=None,
        help="what a test that runs out of CUDA memory (torch.OutOfMemoryError or a CUDA "
        "allocation error) becomes. fail (default): a failure whose report adds what was "
        "alive then (the largest blocks with their holders and lines), what other "
        "processes held and the memory torch's allocator kept reserved but free; skip: a "
        "skip that says so, for suites run on smaller GPUs. Either way the failure's "
        "frames are cleared once it is reported, so the next test starts with the memory "
        "back.",
    )
    group.addoption(
        "--cuda-memory-snapshot",
        dest="cuda_memory_snapshot",
        metavar="DIR",
        default=None,
        help="write torch's memory snapshot (the pickle memory_viz opens, "
        "https://pytorch.org/memory_viz) of each test that leaked, went over its memory "
        "limit or ran out of memory to DIR, each live block's holder added to its stack, "
        "with a JSON file beside it for tools.",
    )
    group.addoption(
        "--cuda-sync",
        dest="cuda_sync",
        choices=SYNC_MODES,
        default=None,
        help="debug asynchronous CUDA errors. launch-blocking: set CUDA_LAUNCH_BLOCKING=1 "
        "before any conftest can create a CUDA context (xdist workers too; restored "
        "afterwards), so every kernel launch waits for its kernel. per-op: synchronize "
        "after every torch operation in each test, so the error is raised at the op and "
        "line that caused it, without a restart.",
    )
    group.addoption(
        "--cuda-on-poison",
        dest="cuda_on_poison",
        choices=POISON_ACTIONS,
        default=None,
        help="after a test leaves a sticky CUDA error (a device-side assert, an illegal "
        "address), every later CUDA call in the process fails. continue (default): run "
        "the remaining tests in a fresh process and merge their results into this report "
        "(under xdist the worker is replaced); stop: end the run; skip: skip the "
        "remaining tests of the process.",
    )
    group.addoption(
        "--cuda-rerun-blocking",
        dest="cuda_rerun_blocking",
        action="store_true",
        default=False,
        help="re-run each test that failed with a CUDA error once, alone, in a fresh "
        "process with CUDA_LAUNCH_BLOCKING=1, and add the line where it really failed "
        "to its report.",
    )
    group.addoption(
        "--cuda-ranks",
        dest="cuda_ranks",
        choices=("env",),
        default=None,
        help="env: this pytest process is one rank of a run that torchrun, srun or mpirun "
        "started (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, or the Slurm and "
        "Open MPI equivalents). Every rank collects the same tests; a "
        "cuda_distributed(world_size=N) test runs on the first N ranks (each on its local "
        "rank's device), an ordinary test on rank 0, which prints the one report.",
    )
    group.addoption(
        "--cuda-rank-logs",
        dest="cuda_rank_logs",
        metavar="DIR",
        default=None,
        help="with --cuda-ranks=env, each rank but rank 0 writes its terminal output to "
        "DIR/rank<N>.log (default: it prints nothing).",
    )
    group.addoption(
        "--cuda-internal-resume", dest="cuda_internal_resume", default=None, help=argparse.SUPPRESS
    )
    group.addoption(
        "--cuda-internal-rerun",
        dest="cuda_internal_rerun",
        action="store_true",
        default=False,
        help=argparse.SUPPRESS,
    )
