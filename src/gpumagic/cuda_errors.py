"""What a CUDA error message says: which error, whether it is sticky, and what to do.

Shared by pytest_cuda (which error poisoned the process, :mod:`pytest_cuda.sync.poison`) and
``%cudatime`` (a hint under an error from the timed body). Pure: it reads messages.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["STICKY_ERRORS", "CudaErrorInfo", "classify", "error_hint", "out_of_memory"]

#: The CUDA runtime errors that leave the context unusable ("sticky" errors), by the
#: text ``cudaGetErrorString`` gives them (CUDA Runtime API, "Error Handling").
STICKY_ERRORS: dict[str, str] = {
    "device-side assert triggered": "cudaErrorAssert",
    "an illegal memory access was encountered": "cudaErrorIllegalAddress",
    "unspecified launch failure": "cudaErrorLaunchFailure",
    "the launch timed out and was terminated": "cudaErrorLaunchTimeout",
    "an illegal instruction was encountered": "cudaErrorIllegalInstruction",
    "misaligned address": "cudaErrorMisalignedAddress",
    "operation not supported on global/shared address space": "cudaErrorInvalidAddressSpace",
    "invalid program counter": "cudaErrorInvalidPc",
    "hardware stack error": "cudaErrorHardwareStackError",
    "uncorrectable ECC error encountered": "cudaErrorECCUncorrectable",
}
_STICKY_NAMES = frozenset(STICKY_ERRORS.values()) | {
    "CUDA_ERROR_ASSERT",
    "CUDA_ERROR_ILLEGAL_ADDRESS",
    "CUDA_ERROR_LAUNCH_FAILED",
    "CUDA_ERROR_LAUNCH_TIMEOUT",
    "CUDA_ERROR_ILLEGAL_INSTRUCTION",
    "CUDA_ERROR_MISALIGNED_ADDRESS",
    "CUDA_ERROR_INVALID_ADDRESS_SPACE",
    "CUDA_ERROR_INVALID_PC",
    "CUDA_ERROR_HARDWARE_STACK_ERROR",
    "CUDA_ERROR_ECC_UNCORRECTABLE",
}

# torch (C10_CUDA_CHECK): "CUDA error: device-side assert triggered", then "Search for
# `cudaErrorAssert' in ..."; CuPy and cuda-python: "cudaErrorIllegalAddress: an
# illegal memory access was encountered"; the driver API (numba, cuda-python):
# "CUDA_ERROR_ILLEGAL_ADDRESS".
_TORCH_TEXT = re.compile(r"CUDA error: (?P<text>[^\n]+)")
_RUNTIME_NAME = re.compile(r"\b(?P<name>cudaError[A-Z]\w*)\b(?::\s*(?P<text>[^\n]+))?")
_DRIVER_NAME = re.compile(r"\b(?P<name>CUDA_ERROR_[A-Z_]+)\b")
_ASYNC_HINT = "CUDA kernel errors might be asynchronously reported"


@dataclass(frozen=True)
class CudaErrorInfo:
    """What kind of CUDA error an exception message reports."""

    #: The error's own words: ``device-side assert triggered``.
    text: str
    #: The CUDA name when the message gives it or it is known: ``cudaErrorAssert``.
    name: str | None
    #: CUDA documents it as leaving the context unusable.
    sticky: bool

    def describe(self) -> str:
        return f"{self.text} ({self.name})" if self.name else self.text


def classify(message: str) -> CudaErrorInfo | None:
    """The CUDA error reported by an exception message, ``None`` for anything else.

    ``CUDA out of memory`` (torch's allocator) is not a CUDA error here: it is
    synchronous, leaves the context usable, and CUDA_LAUNCH_BLOCKING does not help.
    """
    text = name = None
    if match := _TORCH_TEXT.search(message):
        text = match.group("text").strip()
    if match := _RUNTIME_NAME.search(message):
        name = match.group("name")
        text = text or (match.group("text") or name).strip()
    elif match := _DRIVER_NAME.search(message):
        name = match.group("name")
        text = text or name
    if text is None:
        if _ASYNC_HINT not in message:
            return None
        text = message.strip().splitlines()[0]
    name = name or STICKY_ERRORS.get(text)
    sticky = text in STICKY_ERRORS or name in _STICKY_NAMES
    return CudaErrorInfo(text=text, name=name, sticky=sticky)


def error_hint(exc: BaseException) -> str | None:
    """What to do about a CUDA error raised by a timed body (``None`` if it is not one)."""
    text = str(exc)
    if "out of memory" in text and "CUDA" in text:
        return (
            "The body ran out of GPU memory: free tensors you no longer need (del them, "
            "then torch.cuda.empty_cache()) or time a smaller problem."
        )
    info = classify(text)
    if info is None:
        return None
    hint = (
        "This CUDA error came from the timed body. Kernel errors surface at a later call, "
        "so the line shown may not be the culprit: set CUDA_LAUNCH_BLOCKING=1 before CUDA "
        "starts (restart the kernel) to see the launching line."
    )
    if info.sticky:
        hint += (
            " This kind of error is sticky: the CUDA context cannot be used any more in "
            "this process; restart the kernel."
        )
    return hint


#: How an allocation that found no GPU memory is worded: torch's caching allocator
#: (``torch.OutOfMemoryError``: "CUDA out of memory. Tried to allocate ..."), the CUDA
#: runtime and driver (a library's own ``cudaMalloc``), cuBLAS and cuDNN.
_OOM_TEXTS = (
    "CUDA out of memory",
    "CUDA error: out of memory",
    "cudaErrorMemoryAllocation",
    "CUDA_ERROR_OUT_OF_MEMORY",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
)


def out_of_memory(exc: BaseException) -> BaseException | None:
    """The exception of ``exc``'s chain (itself, its causes and contexts) that says a
    CUDA allocation failed, or ``None``: an ``OutOfMemoryError`` (torch's, CuPy's), or
    a ``RuntimeError`` reporting a CUDA allocation error (an assertion that quotes such
    a message is none). By the class's name and the message: torch is never imported
    here."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        found = pending.pop()
        if found is None or id(found) in seen:
            continue
        seen.add(id(found))
        if type(found).__name__ == "OutOfMemoryError" or (
            isinstance(found, RuntimeError) and any(t in _message(found) for t in _OOM_TEXTS)
        ):
            return found
        pending += [found.__cause__, found.__context__]
    return None


def _message(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:  # an exception whose __str__ raises says nothing
        return ""
