"""torch's process-wide flags that a test can change and the next test would inherit,
and the cache directory torch itself puts in the environment.

Read without creating a CUDA context (the cuBLAS and cuDNN flags are plain settings of
torch's global context), so a warm rank can compare them before and after each test.
"""

from __future__ import annotations

import os
import warnings

from gpumagic.cuda.discovery import torch_module

__all__ = ["torch_default_cache_dir", "torch_flags"]


def torch_flags() -> dict[str, str]:
    """Each flag's name, as a user sets it, and its value, as ``repr`` writes it."""
    torch = torch_module()
    backends = torch.backends
    with warnings.catch_warnings():
        # Newer torch deprecates allow_tf32 for fp32_precision; reading it is still right.
        warnings.simplefilter("ignore")
        flags = {
            "torch.are_deterministic_algorithms_enabled()": (
                torch.are_deterministic_algorithms_enabled()
            ),
            "torch.is_deterministic_algorithms_warn_only_enabled()": (
                torch.is_deterministic_algorithms_warn_only_enabled()
            ),
            "torch.backends.cuda.matmul.allow_tf32": backends.cuda.matmul.allow_tf32,
            "torch.backends.cudnn.allow_tf32": backends.cudnn.allow_tf32,
            "torch.backends.cudnn.benchmark": backends.cudnn.benchmark,
            "torch.backends.cudnn.deterministic": backends.cudnn.deterministic,
            "torch.get_float32_matmul_precision()": torch.get_float32_matmul_precision(),
            "torch.get_default_dtype()": torch.get_default_dtype(),
            "torch.is_grad_enabled()": torch.is_grad_enabled(),
        }
    return {name: repr(value) for name, value in flags.items()}


def torch_default_cache_dir() -> str | None:
    """The directory torch's compiler caches use when ``TORCHINDUCTOR_CACHE_DIR`` is
    unset: what torch writes into that variable the first time it needs it (importing
    ``torch._dynamo`` does). ``None`` when this torch does not say."""
    torch_module()
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:
        return None
    return os.path.abspath(default_cache_dir())
