"""Counting the work of one call: floating-point operations with torch's
``FlopCounterMode``, and the bytes each op reads and writes with a dispatch mode.

Both see the ops that reach torch's dispatcher (``aten::mm``, ``aten::add.Tensor``, ...);
kernels launched around it (a Triton kernel called directly, a CUDA graph replayed by
the body) are not seen. Lives in the package that imports torch, though it touches no
CUDA API.

**FLOPs** are ``FlopCounterMode``'s: matrix products, convolutions and attention (its
registry of formulas, plus the CPU kernel of ``scaled_dot_product_attention``). An op
that does arithmetic without a formula there (pointwise ops, reductions, norms,
softmax, a custom op) is listed in :attr:`OpCounts.not_counted` rather than silently
making the figure low. Ops that move or make data without arithmetic (views, copies,
fills, indexing, random numbers, comparisons, metadata) are not listed.

**Bytes** are a lower bound on memory traffic: for each op, the tensors it reads plus
the tensors it writes, each ``numel * element_size`` as the op sees it (a broadcast,
stride-0 dimension counted once; the same tensor passed twice counted once). A view op
(``t``, ``view``, ``expand``...) moves nothing and counts nothing; an in-place op
(``add_``) reads and writes its tensor; a tensor that is only overwritten (``copy_``'s
destination, ``fill_``, an ``out=`` argument) counts as written, not read. Caches are
not modelled: a tensor read by two ops counts twice, and traffic inside a kernel
(attention's tiles, a matmul's re-reads) is not seen.
"""

from __future__ import annotations

import functools
import math
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gpumagic.cuda.discovery import torch_module

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

__all__ = ["OpCounts", "can_count", "count_ops", "load_counters"]


@dataclass(frozen=True)
class OpCounts:
    """What one call of the body did: ``flops`` and ``bytes`` in total, the FLOPs per
    precision (``"bf16"``, ``"tf32"``...: see :mod:`gpumagic.peaks`), how many ops ran,
    and the ops that did arithmetic torch's flop counter has no formula for."""

    flops: int
    bytes: int
    ops: int
    flops_by_dtype: dict[str, int] = field(default_factory=dict)
    not_counted: tuple[str, ...] = ()
    #: The bytes moved per precision of the floating-point data (fp32 stays fp32).
    bytes_by_dtype: dict[str, int] = field(default_factory=dict)

    @property
    def dtype(self) -> str:
        """The precision that did most of the FLOPs; when none were counted, that of
        most of the floating-point bytes moved (``""`` when there were neither)."""
        by = self.flops_by_dtype or self.bytes_by_dtype
        if not by:
            return ""
        return max(by.items(), key=lambda kv: kv[1])[0]


# Ops (by their name without namespace or overload) that move, make or look at data
# without floating-point arithmetic: never listed as "not counted".
NO_ARITHMETIC = frozenset(
    {
        # making and filling
        *("empty", "empty_like", "empty_strided", "empty_permuted", "new_empty"),
        *("new_empty_strided", "zeros", "zeros_like", "new_zeros", "ones", "ones_like"),
        *("new_ones", "full", "full_like", "new_full", "scalar_tensor", "arange", "eye"),
        *("fill", "fill_", "zero", "zero_", "lift_fresh", "lift_fresh_copy", "linspace"),
        # random numbers
        *("rand", "rand_like", "randn", "randn_like", "randint", "randint_like"),
        *("randperm", "normal", "normal_", "uniform_", "bernoulli", "bernoulli_"),
        *("random_", "exponential_", "multinomial"),
        # copying and moving
        *("copy", "copy_", "_to_copy", "clone", "contiguous", "_copy_from"),
        *("_copy_from_and_resize", "cat", "stack", "flip", "roll", "repeat"),
        *("repeat_interleave", "tril", "triu", "constant_pad_nd", "_unsafe_view"),
        *("slice_scatter", "select_scatter", "diagonal_scatter", "as_strided_scatter"),
        *("_pin_memory", "detach", "alias", "set_", "resize_", "resize_as_"),
        # indexing and selecting
        *("index", "index_select", "index_put", "index_put_", "_index_put_impl_"),
        *("gather", "scatter", "scatter_", "masked_fill", "masked_fill_"),
        *("masked_select", "masked_scatter", "masked_scatter_", "where", "embedding"),
        *("nonzero", "sort", "argsort", "topk", "unique", "_unique2", "argmax", "argmin"),
        # comparing
        *("eq", "ne", "lt", "le", "gt", "ge", "isnan", "isinf", "isfinite", "equal"),
        *("logical_not", "logical_and", "logical_or", "is_nonzero", "is_same_size"),
        # talking to the host and the runtime
        *("_local_scalar_dense", "record_stream", "_assert_async", "_to_dense"),
    }
)

# Ops that overwrite an argument without reading it first.
OVERWRITES = frozenset(
    {
        *("copy_", "fill_", "zero_", "normal_", "uniform_", "random_", "bernoulli_"),
        *("exponential_", "set_", "resize_", "resize_as_"),
    }
)


def count_ops(call: Callable[[], object]) -> OpCounts | None:
    """Run ``call()`` once under the counters and return what it did.

    ``None`` when torch was never imported: the call cannot have run torch ops (and
    importing torch to find that out would cost a second).
    """
    if not can_count():
        return None
    torch = torch_module()
    from torch.utils.flop_counter import FlopCounterMode

    flop_counter = FlopCounterMode(display=False, custom_mapping=_extra_formulas())
    counter = _byte_counter_class()(flop_counter)
    with flop_counter, counter:
        call()
    totals = counter.totals
    del torch
    return OpCounts(
        flops=int(flop_counter.get_total_flops()),
        bytes=totals.bytes,
        ops=totals.ops,
        flops_by_dtype=dict(totals.flops_by_dtype),
        not_counted=tuple(totals.not_counted),
        bytes_by_dtype=dict(totals.bytes_by_dtype),
    )


def can_count() -> bool:
    """Whether :func:`count_ops` can count anything here: torch was imported (a body
    that never imported it ran no torch op)."""
    return "torch" in sys.modules


def load_counters() -> bool:
    """Load what :func:`count_ops` needs, once a process, so a caller can time it on its
    own: torch's first op under a dispatch mode imports several hundred modules (sympy
    among them), which is slow once. Returns whether they were loaded now (``False``: they
    already were). One op on a one-element CPU tensor: no CUDA context."""
    if _load_counters.cache_info().currsize:
        return False
    _load_counters()
    return True


@functools.cache
def _load_counters() -> None:
    torch = torch_module()
    count_ops(lambda: torch.zeros(1) + 1)


@functools.cache
def _extra_formulas() -> dict[Any, Any]:
    """Formulas FlopCounterMode lacks: the CPU kernel of scaled_dot_product_attention
    (the same count as the CUDA kernels': two matrix products over the sequence)."""
    torch = torch_module()
    from torch.utils import flop_counter

    count = getattr(flop_counter, "sdpa_flop_count", None)
    cpu = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if count is None or cpu is None:
        return {}

    # FlopCounterMode passes the tensors' shapes (and the output's, as out_shape).
    def cpu_attention(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
        return int(count(query, key, value))

    return {cpu: cpu_attention}


@dataclass
class _Totals:
    bytes: int = 0
    ops: int = 0
    flops_by_dtype: dict[str, int] = field(default_factory=dict)
    not_counted: dict[str, None] = field(default_factory=dict)  # ordered set
    bytes_by_dtype: dict[str, int] = field(default_factory=dict)


@functools.cache
def _byte_counter_class() -> type:
    """The dispatch mode, defined on first use so that importing gpumagic imports no
    torch. It is entered after the flop counter, so it sees each op first and reads
    the flop counter's total before and after passing the op down to it."""
    torch = torch_module()
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    def tensors(value: object) -> list[Any]:
        return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]

    class ByteCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]
        def __init__(self, flop_counter: Any) -> None:
            super().__init__()  # type: ignore[no-untyped-call]
            self.flop_counter = flop_counter
            self.totals = _Totals()

        def __torch_dispatch__(
            self,
            func: Any,
            types: Iterable[type],
            args: tuple[Any, ...] = (),
            kwargs: dict[str, Any] | None = None,
        ) -> Any:
            kwargs = kwargs or {}
            before = self.flop_counter.get_total_flops()
            out = func(*args, **kwargs)
            flops = self.flop_counter.get_total_flops() - before
            totals = self.totals
            totals.ops += 1
            inputs = tensors((args, kwargs))
            outputs = tensors(out)
            if flops:
                dtype = _precision(torch, func, inputs)
                totals.flops_by_dtype[dtype] = totals.flops_by_dtype.get(dtype, 0) + flops
            elif _does_arithmetic(torch, func, inputs, outputs):
                totals.not_counted[str(func.name())] = None
            if not getattr(func, "is_view", False):
                moved = _moved(func, args, kwargs, inputs, outputs)
                totals.bytes += moved
                data = next((t for t in (*inputs, *outputs) if t.is_floating_point()), None)
                if moved and data is not None:
                    key = _dtype_name(torch, data.dtype)
                    totals.bytes_by_dtype[key] = totals.bytes_by_dtype.get(key, 0) + moved
            return out

    return ByteCounter


def _name(func: Any) -> str:
    return str(getattr(func, "_overloadpacket", func).__name__)


def _precision(torch: Any, func: Any, inputs: list[Any]) -> str:
    """The precision an op with FLOPs ran in: its first floating-point input's dtype,
    fp32 as tf32 where torch lets matmuls (or cuDNN convolutions) use TF32."""
    first = next((t for t in inputs if t.is_floating_point()), None)
    if first is None:
        return str(inputs[0].dtype).removeprefix("torch.") if inputs else "unknown"
    dtype = first.dtype
    if dtype == torch.float32:
        if not first.is_cuda:
            return "fp32"
        convolution = "conv" in _name(func)
        backends = torch.backends
        allowed = backends.cudnn.allow_tf32 if convolution else backends.cuda.matmul.allow_tf32
        return "tf32" if allowed else "fp32"
    return _dtype_name(torch, dtype)


def _dtype_name(torch: Any, dtype: Any) -> str:
    """``"fp32"``, ``"bf16"``, ``"fp16"``, ``"fp64"``, ``"fp8"``, else torch's name."""
    names = {
        torch.float32: "fp32",
        torch.bfloat16: "bf16",
        torch.float16: "fp16",
        torch.float64: "fp64",
    }
    if dtype in names:
        return names[dtype]
    if "float8" in str(dtype):
        return "fp8"
    return str(dtype).removeprefix("torch.")


def _does_arithmetic(torch: Any, func: Any, inputs: list[Any], outputs: list[Any]) -> bool:
    """Whether an op without FLOPs from the counter does floating-point arithmetic."""
    if getattr(func, "is_view", False) or _name(func) in NO_ARITHMETIC:
        return False
    tags = set(getattr(func, "tags", ()))
    if torch.Tag.view_copy in tags or torch.Tag.inplace_view in tags:
        return False
    if not outputs and not _mutated(func, (), {}, check_only=True):
        return False  # metadata
    return any(t.is_floating_point() or t.is_complex() for t in (*inputs, *outputs))


def _nbytes(tensor: Any) -> int:
    """Bytes of ``tensor`` as an op sees it, a broadcast (stride-0) dimension once."""
    try:
        sizes = [s for s, st in zip(tensor.shape, tensor.stride(), strict=True) if st != 0]
        if tensor.numel() == 0:
            return 0
        return int(math.prod(sizes)) * int(tensor.element_size())
    except (RuntimeError, NotImplementedError):  # sparse and other layouts have no strides
        return int(tensor.numel()) * int(tensor.element_size())


def _mutated(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], *, check_only: bool = False
) -> list[tuple[object, bool]]:
    """The values of the arguments the op writes, each with whether it is only
    written (``out=``, or an op that overwrites); with ``check_only`` just whether the
    schema has any (a one-element list)."""
    found: list[tuple[object, bool]] = []
    overwrites = _name(func) in OVERWRITES
    schema = getattr(func, "_schema", None)
    for i, arg in enumerate(schema.arguments if schema is not None else ()):
        info = arg.alias_info
        if info is None or not info.is_write:
            continue
        if check_only:
            return [(None, False)]
        value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
        found.append((value, arg.kwarg_only or overwrites))
    return found


def _moved(
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    inputs: list[Any],
    outputs: list[Any],
) -> int:
    """Bytes the op read plus bytes it wrote (see the module's docstring)."""
    from torch.utils._pytree import tree_flatten

    written: dict[int, Any] = {id(t): t for t in outputs}
    write_only: set[int] = set()
    for value, only_written in _mutated(func, args, kwargs):
        for t in tree_flatten(value)[0]:
            if hasattr(t, "element_size"):
                written[id(t)] = t
                if only_written:
                    write_only.add(id(t))
    read = {id(t): t for t in inputs if id(t) not in write_only}
    return sum(map(_nbytes, read.values())) + sum(map(_nbytes, written.values()))
