"""The one package that talks to torch's CUDA API and to NVML, one module per facility.

Everything else in gpumagic and pytest_cuda goes through these functions (as
``from gpumagic import cuda; cuda.synchronize(...)``), so readers know where CUDA is
touched and tests can swap it in one place:

* :mod:`~gpumagic.cuda.discovery`: status, devices, NVML and ``CUDA_VISIBLE_DEVICES``;
  never a context, never torch;
* :mod:`~gpumagic.cuda.clocks`: the SM clock and NVML's reasons for it (power cap,
  thermal slowdown...), read around each ``%cudatime`` run; never a context, never torch;
* :mod:`~gpumagic.cuda.runtime`: synchronize, events, streams, spin, L2 flush, graphs,
  device properties;
* :mod:`~gpumagic.cuda.allocator`: the caching allocator's counters, history, snapshots
  and library caches;
* :mod:`~gpumagic.cuda.objects`: what a torch object is (a tensor's facts, its autograd
  graph, a module, a compiled callable) and ``torch.device`` objects;
* :mod:`~gpumagic.cuda.debug`: sync-debug modes, hidden syncs, the CUPTI kernel profile,
  asynchronous CUDA errors;
* :mod:`~gpumagic.cuda.kernel_trace`: torch.profiler's record of the kernels, copies
  and memsets a stretch of code ran and the runtime calls that launched them (torch ops
  only while autograd's backward runs), as plain records (``%lprun --gpu``);
* :mod:`~gpumagic.cuda.op_counts`: the FLOPs (torch's ``FlopCounterMode``) and bytes
  of one call, for ``%cudatime``'s roofline; torch, but no CUDA API;
* :mod:`~gpumagic.cuda.process_group`: ``torch.distributed``'s rendezvous and process
  group for tests run in several rank processes;
* :mod:`~gpumagic.cuda.run_store`: the launcher's store, shared by the pytest processes
  of a run that torchrun, ``srun`` or ``mpirun`` started.

Rules kept here:

* Nothing is imported at module import: torch on first CUDA use, pynvml on first
  discovery.
* Discovery never creates a CUDA context nor imports torch: it asks NVML (the CUDA
  driver API where NVML is missing), maps the boards through ``CUDA_VISIBLE_DEVICES``
  and reads torch's version file instead of importing torch.
* One function per question (one NVML memory reader, one process reader, one device
  count), and no policy: what counts as the user's code, or a tool's wording, is
  passed in by the caller.
* Without CUDA (torch missing, a CPU-only build, no driver, every device hidden) the
  functions answer with a reason (:class:`CudaUnavailable`) instead of raising deep
  inside torch.
"""

from __future__ import annotations

from gpumagic.cuda.allocator import (
    AllocatorStats,
    allocated_bytes,
    allocation_marks,
    allocator_backend,
    allocator_stats,
    clear_fft_plan_caches,
    device_total_memory,
    empty_cache,
    memory_history_enabled,
    memory_snapshot,
    on_cuda_init,
    release_blas_workspaces,
    release_cached_blocks,
    reset_compile_caches,
    reset_peak_memory_stats,
    start_memory_history,
    stop_memory_history,
)
from gpumagic.cuda.clocks import SmClock, sm_clock
from gpumagic.cuda.debug import (
    SYNC_WARNING_MESSAGE,
    AsyncCudaError,
    ImplicitSyncError,
    KernelProfile,
    SyncEvent,
    async_error,
    catch_syncs,
    forbid_implicit_sync,
    get_sync_debug_mode,
    profile_kernels,
    set_sync_debug_mode,
    sync_after_each_op,
)
from gpumagic.cuda.discovery import (
    CudaUnavailable,
    NvmlMemory,
    devices,
    is_initialized,
    nvml_memory_info,
    nvml_processes,
    require,
    reset_status_cache,
    status,
    torch_module,
    visible_devices,
)
from gpumagic.cuda.flags import torch_default_cache_dir, torch_flags
from gpumagic.cuda.kernel_trace import (
    DeviceWork,
    HostOp,
    KernelRecorder,
    KernelTrace,
    RuntimeCall,
    profiler_running,
    sequence_counter,
    start_kernel_trace,
)
from gpumagic.cuda.objects import (
    TensorFacts,
    graph_owners,
    is_compiled,
    is_module,
    start_torch,
    tensor_facts,
    tensors_among,
    torch_device,
)
from gpumagic.cuda.op_counts import OpCounts, can_count, count_ops, load_counters
from gpumagic.cuda.process_group import (
    UnexpectedStoreValue,
    connect_store,
    host_store,
    join_group,
    known_backends,
    leave_group,
    live_groups,
    mark_rank_done,
    preload_distributed,
    rank_device,
    rank_environment,
    unknown_backends,
    wait_for_ranks,
)
from gpumagic.cuda.run_store import RunStore, StoreGone, open_run_store
from gpumagic.cuda.runtime import (
    DevicePeaks,
    GraphCaptureError,
    capture_graph,
    current_device,
    current_streams,
    device_peaks,
    devices_with_context,
    elapsed_ms,
    event_completed,
    flush_l2,
    l2_flush_buffer,
    record_event,
    restore_streams,
    spin,
    stream_is_capturing,
    synchronize,
    use_device,
    visible_device_total,
)

__all__ = [
    "SYNC_WARNING_MESSAGE",
    "AllocatorStats",
    "AsyncCudaError",
    "CudaUnavailable",
    "DevicePeaks",
    "DeviceWork",
    "GraphCaptureError",
    "HostOp",
    "ImplicitSyncError",
    "KernelProfile",
    "KernelRecorder",
    "KernelTrace",
    "NvmlMemory",
    "OpCounts",
    "RunStore",
    "RuntimeCall",
    "SmClock",
    "StoreGone",
    "SyncEvent",
    "TensorFacts",
    "UnexpectedStoreValue",
    "allocated_bytes",
    "allocation_marks",
    "allocator_backend",
    "allocator_stats",
    "async_error",
    "can_count",
    "capture_graph",
    "catch_syncs",
    "clear_fft_plan_caches",
    "connect_store",
    "count_ops",
    "current_device",
    "current_streams",
    "device_peaks",
    "device_total_memory",
    "devices",
    "devices_with_context",
    "elapsed_ms",
    "empty_cache",
    "event_completed",
    "flush_l2",
    "forbid_implicit_sync",
    "get_sync_debug_mode",
    "graph_owners",
    "host_store",
    "is_compiled",
    "is_initialized",
    "is_module",
    "join_group",
    "known_backends",
    "l2_flush_buffer",
    "leave_group",
    "live_groups",
    "load_counters",
    "mark_rank_done",
    "memory_history_enabled",
    "memory_snapshot",
    "nvml_memory_info",
    "nvml_processes",
    "on_cuda_init",
    "open_run_store",
    "preload_distributed",
    "profile_kernels",
    "profiler_running",
    "rank_device",
    "rank_environment",
    "record_event",
    "release_blas_workspaces",
    "release_cached_blocks",
    "require",
    "reset_compile_caches",
    "reset_peak_memory_stats",
    "reset_status_cache",
    "restore_streams",
    "sequence_counter",
    "set_sync_debug_mode",
    "sm_clock",
    "spin",
    "start_kernel_trace",
    "start_memory_history",
    "start_torch",
    "status",
    "stop_memory_history",
    "stream_is_capturing",
    "sync_after_each_op",
    "synchronize",
    "tensor_facts",
    "tensors_among",
    "torch_default_cache_dir",
    "torch_device",
    "torch_flags",
    "torch_module",
    "unknown_backends",
    "use_device",
    "visible_device_total",
    "visible_devices",
    "wait_for_ranks",
]
