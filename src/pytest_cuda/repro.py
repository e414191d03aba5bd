"""Where a CUDA failure happened, and the command line that reproduces it.

Pure: no pytest, no torch. The plugin passes in tracebacks, node ids and paths.
"""

from __future__ import annotations

import linecache
import os
import shlex
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import TracebackType

__all__ = [
    "FailureSite",
    "describe_sync_op",
    "failure_site",
    "quote_nodeid",
    "repro_command",
]


def quote_nodeid(nodeid: str) -> str:
    """``nodeid`` in single quotes for a POSIX shell (``[``, ``*`` and spaces are safe)."""
    return "'" + nodeid.replace("'", "'\"'\"'") + "'"


def repro_command(
    nodeid: str,
    *,
    visible_devices: str | None,
    rootdir: Path | None = None,
    cwd: Path | None = None,
) -> str:
    """``CUDA_VISIBLE_DEVICES=0 CUDA_LAUNCH_BLOCKING=1 pytest 'tests/x.py::test_y'``.

    ``visible_devices`` is what the failing process saw (``None``: leave the variable
    out). Node ids are relative to the rootdir: when the run started elsewhere the
    command starts with ``cd ROOTDIR &&``.
    """
    parts = []
    if rootdir is not None and cwd is not None and Path(rootdir) != Path(cwd):
        parts.append(f"cd {shlex.quote(str(rootdir))} &&")
    if visible_devices is not None:
        parts.append(f"CUDA_VISIBLE_DEVICES={shlex.quote(visible_devices)}")
    parts += ["CUDA_LAUNCH_BLOCKING=1", "pytest", quote_nodeid(nodeid)]
    return " ".join(parts)


@dataclass(frozen=True)
class FailureSite:
    """The user's line an exception came from: the innermost frame outside the libraries."""

    path: str
    lineno: int
    function: str
    source: str

    def describe(self) -> str:
        where = f"{self.path}:{self.lineno} in {self.function}"
        return f"{where}: {self.source}" if self.source else where

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> FailureSite | None:
        if not isinstance(data, dict):
            return None
        try:
            return cls(
                str(data["path"]), int(data["lineno"]), str(data["function"]), str(data["source"])
            )
        except (KeyError, TypeError, ValueError):
            return None


def _normalized(path: str | Path) -> str:
    return os.path.normcase(os.path.abspath(path))


def failure_site(
    tb: TracebackType | None,
    is_user: Callable[[str], bool] = lambda filename: True,
    *,
    relative_to: Path | None = None,
    in_file: Path | None = None,
) -> FailureSite | None:
    """The innermost frame of ``tb`` in the user's code (``is_user``, usually
    :meth:`gpumagic.stacks.FrameFilter.is_user`).

    Frames that hide themselves from pytest (``__tracebackhide__``) are skipped too;
    with ``in_file``, only frames of that file count (the test's own line). The path is
    made relative to ``relative_to`` (the rootdir) when inside it.
    """
    wanted = _normalized(in_file) if in_file is not None else None
    found = None
    while tb is not None:
        frame = tb.tb_frame
        filename = _normalized(frame.f_code.co_filename)
        hidden = frame.f_locals.get("__tracebackhide__", False) if frame.f_locals else False
        mine = filename == wanted if wanted is not None else is_user(frame.f_code.co_filename)
        if mine and not hidden and "_pytest" + os.sep not in filename:
            found = (frame.f_code.co_filename, tb.tb_lineno, frame.f_code.co_name)
        tb = tb.tb_next
    if found is None:
        return None
    path, lineno, function = found
    source = linecache.getline(path, lineno).strip()
    shown = path
    if relative_to is not None:
        try:
            shown = str(Path(path).resolve().relative_to(Path(relative_to).resolve()))
        except ValueError:
            shown = path
    return FailureSite(shown, lineno, function, source)


# ---------------------------------------------------------------------------
# Implicit synchronizations, in the words a user knows them by.

_SYNC_OPS = {
    "_local_scalar_dense": "Tensor.item() (also int(), float() of a CUDA tensor)",
    "is_nonzero": "bool() of a CUDA tensor (an if or assert on a tensor)",
    "_to_copy": "a copy to the host (.cpu(), .to('cpu'), .numpy(), .tolist())",
    "copy_": "a copy to the host (.cpu(), .copy_() into a CPU tensor)",
    "nonzero": "nonzero() (its output size depends on the data)",
    "nonzero_static": "nonzero_static()",
    "masked_select": "masked_select() (its output size depends on the data)",
    "index": "indexing with a boolean mask (its output size depends on the data)",
    "unique": "unique() (its output size depends on the data)",
    "_unique2": "unique() (its output size depends on the data)",
    "unique_consecutive": "unique_consecutive() (its output size depends on the data)",
    "repeat_interleave": "repeat_interleave() with tensor repeats",
    "equal": "torch.equal()",
    "allclose": "torch.allclose()",
}


def describe_sync_op(op: str | None) -> str:
    """``aten._local_scalar_dense.default`` -> ``Tensor.item() (...)
    [aten._local_scalar_dense.default]``; an unknown op is named as is."""
    if not op:
        return "a synchronizing CUDA operation"
    name = op.removeprefix("aten.").split(".", 1)[0]
    known = _SYNC_OPS.get(name)
    return f"{known} [{op}]" if known else op
