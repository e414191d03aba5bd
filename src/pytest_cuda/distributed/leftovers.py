"""What a test left in a warm rank for the next test: process groups, torch's global
flags, environment variables.

Warm ranks run one test after another in the same process, so a test that creates a
process group and keeps it, turns TF32 on or sets an environment variable changes what
the next test sees. Each rank captures its state (:func:`capture`) before the test
function and after it; :func:`left_behind` says what changed, one line each. The rank
fails the test with those lines, and the pool replaces its ranks, so the next test
starts clean. GPU memory is the leak check's (``--cuda-leak-check``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["RankState", "capture", "left_behind"]


@dataclass(frozen=True)
class RankState:
    """One rank's process-wide state, as the next test would inherit it."""

    environ: dict[str, str]
    flags: dict[str, str]
    #: Live process groups by ``id``: "backend, ranks [...]".
    groups: dict[int, str]


def capture() -> RankState:
    """This rank's state now (torch is imported already: the rank joined its group)."""
    from gpumagic import cuda

    return RankState(dict(os.environ), cuda.torch_flags(), cuda.live_groups())


def left_behind(before: RankState, after: RankState) -> list[str]:
    """What changed from ``before`` to ``after``, one line each, groups first."""
    lines = [
        f"a process group ({described}) that is still alive"
        for key, described in after.groups.items()
        if key not in before.groups
    ]
    lines += [
        f"{name} = {value} (it was {before.flags.get(name, 'unknown')})"
        for name, value in after.flags.items()
        if before.flags.get(name) != value
    ]
    for name in sorted(set(before.environ) | set(after.environ)):
        old, new = before.environ.get(name), after.environ.get(name)
        if old == new or (old is None and _set_by_torch(name, new, after.environ)):
            continue
        if new is None:
            lines.append(f"environment variable {name} unset (it was {old!r})")
        elif old is None:
            lines.append(f"environment variable {name}={new!r} (it was not set)")
        else:
            lines.append(f"environment variable {name}={new!r} (it was {old!r})")
    return lines


def _set_by_torch(name: str, value: str | None, environ: dict[str, str]) -> bool:
    """``name=value`` is what torch puts in the environment where it was unset, the
    default it would use anyway: ``TORCHINDUCTOR_CACHE_DIR`` when ``torch._dynamo`` is
    first imported (DDP's constructor and ``torch.compile`` import it), and
    ``TRITON_CACHE_DIR`` (that directory's ``triton/<device>``) when a compiled kernel
    first runs. The next test sees what it would without them; any other value is the
    test's."""
    if name == "TORCHINDUCTOR_CACHE_DIR":
        from gpumagic import cuda

        return value is not None and value == cuda.torch_default_cache_dir()
    if name == "TRITON_CACHE_DIR" and value is not None:
        head, device = os.path.split(value)
        inductor = environ.get("TORCHINDUCTOR_CACHE_DIR")
        return (
            device.isdigit() and inductor is not None and head == os.path.join(inductor, "triton")
        )
    return False
