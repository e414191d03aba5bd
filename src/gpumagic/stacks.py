"""Allocation stacks: torch's allocator snapshot → live blocks → the user's line.

``torch.cuda.memory._snapshot()`` lists every block the caching allocator holds, with
the stack that allocated it when allocation history was recorded. Both ``%%gpumem
--trace`` (what a cell left allocated, by line) and pytest_cuda's leak check (what a
test left allocated, by stack) read it the same way, through this module:

* :func:`blocks_from_segments` turns the snapshot's ``segments`` into :class:`Block` s;
  :func:`blocks_allocated_since` keeps those allocated after a moment, from the
  allocator's event ring;
* :class:`FrameFilter` is the one answer to "is this code the user's or a library's",
  by file (a frame) and by module name (the leak walk's roots): torch, the standard
  library, pytest, IPython, gpumagic, generated and C++ code are a library's; an
  installed package (site-packages) is the user's to look at, and its caches are kept
  by design like a library's;
* :func:`group_by_stack` groups blocks by their user frames (the leak report) and
  :func:`group_by_line` by the innermost user line (the ``%%gpumem`` trace).

Pure: no torch, no IPython, no pytest; the snapshot is passed in.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gpumagic.units import format_bytes

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator, Mapping

__all__ = [
    "MAX_FRAMES",
    "Block",
    "Frame",
    "FrameFilter",
    "StackGroup",
    "TraceLine",
    "blocks_allocated_since",
    "blocks_from_segments",
    "frames_from_snapshot",
    "group_by_line",
    "group_by_stack",
    "is_python_file",
    "short_path",
]

#: Frames kept per stack in a leak report.
MAX_FRAMES = 8
#: Packages whose code is never the user's, when imported.
LIBRARY_PACKAGES = (
    "torch",
    "functorch",
    "triton",
    "numpy",
    "pytest",
    "_pytest",
    "pluggy",
    "xdist",
    "IPython",
    "ipykernel",
    "pytest_cuda",
    "gpumagic",
)
#: What :meth:`FrameFilter.kind_of_file` and :meth:`FrameFilter.kind_of_module` answer:
#: the user's code, an installed package's (site-packages or dist-packages, outside
#: :data:`LIBRARY_PACKAGES`), or a library's.
USER, INSTALLED, LIBRARY = "user", "installed", "library"


@dataclass(frozen=True)
class Frame:
    """One frame of an allocating stack."""

    filename: str
    line: int
    name: str

    def describe(self, root: str | None = None) -> str:
        return f"{short_path(self.filename, root)}:{self.line} in {self.name}"


def short_path(filename: str, root: str | None) -> str:
    """``filename`` relative to ``root`` when it lies inside it."""
    if root and not filename.startswith("<"):
        try:
            relative = os.path.relpath(filename, root)
        except ValueError:  # another drive on Windows
            return filename
        if not relative.startswith(os.pardir):
            return relative
    return filename


def is_python_file(filename: str) -> bool:
    """A Python frame (a file, a cell ``<ipython-input-…>``, ``<string>``), not C++."""
    return filename.endswith((".py", ".pyw", ".ipy")) or (
        filename.startswith("<") and filename.endswith(">")
    )


@dataclass(frozen=True)
class Block:
    """A live allocator block: where, how big (``requested``: what the tensor asked for,
    before rounding), and its allocating stack, innermost frame first."""

    device: int
    address: int
    size: int
    requested: int
    frames: tuple[Frame, ...] = ()
    #: In a private memory pool (a CUDA graph's, a ``torch.cuda.MemPool``), not the
    #: allocator's default one.
    private_pool: bool = False


def frames_from_snapshot(
    frames: Iterable[Mapping[str, Any]], known: dict[tuple[Any, Any, Any], Frame] | None = None
) -> tuple[Frame, ...]:
    """The frames of one stack as ``torch.cuda.memory._snapshot()`` gives them (a block's
    or an allocator event's ``frames``), innermost first. ``known``: the frames made so
    far from the same snapshot, reused (the blocks of one test share most of their
    frames: a snapshot's thousands of stacks cost one :class:`Frame` per distinct one)."""
    if known is None:
        known = {}
    found = []
    for f in frames:
        key = (f.get("filename", "?"), f.get("line", 0), f.get("name", "?"))
        frame = known.get(key)
        if frame is None:
            frame = known[key] = Frame(str(key[0]), int(key[1]), str(key[2]))
        found.append(frame)
    return tuple(found)


def blocks_from_segments(
    segments: Iterable[Mapping[str, Any]], devices: set[int] | None = None
) -> list[Block]:
    """The allocated blocks of a ``torch.cuda.memory._snapshot()``'s ``segments``
    (on ``devices`` only, when given)."""
    known: dict[tuple[Any, Any, Any], Frame] = {}
    return [
        _block(device, block, private, known)
        for device, block, private in _allocated(segments)
        if devices is None or device in devices
    ]


def _allocated(
    segments: Iterable[Mapping[str, Any]],
) -> Iterator[tuple[int, Mapping[str, Any], bool]]:
    """``(device, block, private pool)`` for each allocated block of ``segments``, as
    the snapshot gives it (its frames not read yet)."""
    for segment in segments:
        device = int(segment.get("device", 0))
        pool = segment.get("segment_pool_id") or (0, 0)
        private = tuple(pool) != (0, 0)
        for block in segment.get("blocks", ()):
            if block.get("state") == "active_allocated":
                yield device, block, private


def _block(
    device: int,
    block: Mapping[str, Any],
    private: bool,
    known: dict[tuple[Any, Any, Any], Frame] | None = None,
) -> Block:
    size = int(block.get("size", 0))
    return Block(
        device,
        int(block.get("address", 0)),
        size,
        int(block.get("requested_size", size)),
        frames_from_snapshot(block.get("frames") or (), known),
        private,
    )


def blocks_allocated_since(
    snapshot: Mapping[str, Any], start_us: int, outermost: tuple[str, str] | None = None
) -> list[Block]:
    """The live blocks of a ``torch.cuda.memory._snapshot()`` allocated at or after
    ``start_us`` (microseconds since the epoch, the clock of the snapshot's events).

    Each device's ring of allocator events (oldest first) says which live blocks are
    new: those with an ``alloc`` event at their address since ``start_us``; the ring is
    read from its newest event back to the start. A block without one is older, unless
    the ring lost events after ``start_us`` (it wrapped, or the recording keeps no
    events): then its stack decides, and it counts as new when the stack passes
    through ``outermost`` (``(filename, function)`` of the test function).
    """
    allocated: dict[int, set[int]] = {}
    complete: dict[int, bool] = {}
    for device, events in enumerate(snapshot.get("device_traces") or ()):
        complete[device], allocated[device] = _allocated_since(events, start_us)
    found = []
    known: dict[tuple[Any, Any, Any], Frame] = {}
    through = _Outermost(outermost)
    for device, block, private in _allocated(snapshot.get("segments") or ()):
        if int(block.get("address", 0)) in allocated.get(device, ()) or (
            # No event since the start, and the ring lost events since then: the
            # stack decides.
            not complete.get(device, False) and through.in_snapshot(block.get("frames") or ())
        ):
            found.append(_block(device, block, private, known))
    return found


def _allocated_since(events: list[Mapping[str, Any]], start_us: int) -> tuple[bool, set[int]]:
    """Whether the ring ``events`` (oldest first) reaches back to ``start_us``, and the
    addresses it saw allocated since then. Read from the newest back to the first one
    before the start (the whole ring took about 60 ms of a leaking test's teardown);
    one test's tens of thousands of events are a loop of a few lines per event."""
    complete = False
    addresses: set[int] = set()
    add = addresses.add
    for event in reversed(events):
        time_us = event.get("time_us", 0)
        if time_us <= start_us:
            complete = True
            if time_us < start_us:
                break
        if event.get("action") == "alloc":
            add(int(event.get("addr", -1)))
    return complete, addresses


class _Outermost:
    """The frame a stack is cut at, ``(filename, function)`` (the test function): the
    function's name is compared first, a file's path (normalised once) only on a match."""

    def __init__(self, where: tuple[str, str] | None) -> None:
        self.where = where
        self._same: dict[str, bool] = {}

    def is_it(self, filename: str, name: str) -> bool:
        if self.where is None or name != self.where[1]:
            return False
        same = self._same.get(filename)
        if same is None:
            same = self._same[filename] = _as_dir(filename) == _as_dir(self.where[0])
        return same

    def in_snapshot(self, frames: Iterable[Mapping[str, Any]]) -> bool:
        """A stack as the snapshot gives it passes through it."""
        return any(self.is_it(str(f.get("filename", "?")), str(f.get("name", "?"))) for f in frames)

    def cut(self, frames: tuple[Frame, ...]) -> tuple[Frame, ...]:
        """``frames`` up to it (all of them when it is not among them)."""
        for i, frame in enumerate(frames):
            if self.is_it(frame.filename, frame.name):
                return frames[: i + 1]
        return frames


def _as_dir(path: str) -> str:
    if path.startswith("<"):
        return path
    return os.path.normcase(os.path.abspath(path)).rstrip(os.sep) + os.sep


def _generated_code_dirs() -> list[str]:
    """Where torch.compile writes the code it generates (inductor's cache, triton's):
    library code, though it lies outside the library's package."""
    import getpass
    import re
    import tempfile

    found = [os.environ.get("TORCHINDUCTOR_CACHE_DIR", ""), os.environ.get("TRITON_CACHE_DIR", "")]
    try:
        user = re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())
    except Exception:  # no user name in this environment (getpass raises OSError, KeyError)
        return found
    found.append(os.path.join(tempfile.gettempdir(), f"torchinductor_{user}"))
    return found


class FrameFilter:
    """The one rule for "is this code the user's?", by file and by module name.

    A library's: the packages of :data:`LIBRARY_PACKAGES` (torch, pytest, IPython,
    gpumagic…), the standard library, the code torch.compile generates, C++ frames.
    An installed package's (site-packages outside those): the user's to look at in a
    stack (:meth:`is_user`: their model library is theirs), and, holding memory, a
    library's cache kept by design (:meth:`is_library_module`). Everything else, and a
    module without a file that is not the standard library's, is the user's."""

    def __init__(self, library_dirs: Iterable[str], stdlib_dirs: Iterable[str] = ()) -> None:
        self._library = tuple(_as_dir(d) for d in library_dirs if d)
        self._stdlib = tuple(_as_dir(d) for d in stdlib_dirs if d)
        # A report asks about the same few files for thousands of frames.
        self._file_kinds: dict[str, str] = {}

    @classmethod
    def default(cls, extra_dirs: Iterable[str] = ()) -> FrameFilter:
        """The library packages imported now, the standard library, and ``extra_dirs``."""
        library = list(extra_dirs)
        for name in LIBRARY_PACKAGES:
            module = sys.modules.get(name)
            path = getattr(module, "__file__", None)
            if path:
                library.append(os.path.dirname(path))
        library += _generated_code_dirs()
        paths = sysconfig.get_paths()
        return cls(library, {paths["stdlib"], paths["platstdlib"]})

    def kind_of_file(self, filename: str) -> str:
        """:data:`USER`, :data:`INSTALLED` or :data:`LIBRARY`, for a frame's file."""
        kind = self._file_kinds.get(filename)
        if kind is None:
            kind = self._file_kinds[filename] = self._kind_of_file(filename)
        return kind

    def _kind_of_file(self, filename: str) -> str:
        if filename.startswith(("<frozen", "<eval_with_key")):
            return LIBRARY
        if not filename.startswith("<") and not filename.endswith((".py", ".pyw", ".ipy")):
            return LIBRARY  # a C++ frame (recording with stacks="all"): torch's or a library's
        return self._kind_of_path(filename)

    def kind_of_module(self, name: str) -> str:
        """:data:`USER`, :data:`INSTALLED` or :data:`LIBRARY`, for a module by its name
        (its top-level package decides)."""
        top = name.split(".", 1)[0]
        if top in LIBRARY_PACKAGES or top in sys.stdlib_module_names:
            return LIBRARY
        path = str(getattr(sys.modules.get(top), "__file__", "") or "")
        return self._kind_of_path(path) if path else USER

    def is_user(self, filename: str) -> bool:
        """A frame the user's line is looked for in (an installed package's included)."""
        return self.kind_of_file(filename) != LIBRARY

    def is_library_module(self, name: str) -> bool:
        """A module whose globals are a library's cache (an installed package's included)."""
        return self.kind_of_module(name) != USER

    def _kind_of_path(self, filename: str) -> str:
        if filename.startswith("<"):
            return USER
        path = _as_dir(filename)
        if path.startswith(self._library):
            return LIBRARY
        parts = path.split(os.sep)
        if "site-packages" in parts or "dist-packages" in parts:
            return INSTALLED
        return LIBRARY if path.startswith(self._stdlib) else USER


# ---------------------------------------------------------------------------
# By stack: the leak report.


@dataclass(frozen=True)
class StackGroup:
    """Live blocks that share an allocating stack (user frames, innermost first)."""

    frames: tuple[Frame, ...]
    size: int
    requested: int
    blocks: int
    devices: tuple[int, ...]

    def describe(self) -> str:
        where = ", ".join(f"cuda:{d}" for d in self.devices)
        count = f"{self.blocks} block" + ("s" if self.blocks != 1 else "")
        text = f"{format_bytes(self.size)} in {count} on {where}"
        if self.requested != self.size:
            text += f" ({format_bytes(self.requested)} requested)"
        return text


def group_by_stack(
    blocks: Iterable[Block],
    is_user: Callable[[str], bool],
    max_frames: int = MAX_FRAMES,
    outermost: tuple[str, str] | None = None,
) -> tuple[StackGroup, ...]:
    """Group ``blocks`` by the user frames of their stacks, largest total first.

    ``outermost``: ``(filename, function)`` of the frame where a stack stops being
    interesting (the test function): the frames that called it are dropped. A stack with
    no user frame (allocated inside a library's own thread) keeps its three innermost
    frames, so the report still says something.
    """
    groups: dict[tuple[Frame, ...], list[Block]] = {}
    cut = _Outermost(outermost).cut
    for block in blocks:
        stack = cut(block.frames)
        user = tuple(f for f in stack if is_user(f.filename)) or stack[:3]
        groups.setdefault(user[:max_frames], []).append(block)
    result = [
        StackGroup(
            frames=frames,
            size=sum(b.size for b in members),
            requested=sum(b.requested for b in members),
            blocks=len(members),
            devices=tuple(sorted({b.device for b in members})),
        )
        for frames, members in groups.items()
    ]
    result.sort(key=lambda g: (-g.size, -g.blocks))
    return tuple(result)


# ---------------------------------------------------------------------------
# By line: the ``%%gpumem --trace`` table.


@dataclass(frozen=True)
class TraceLine:
    """Memory still allocated after the cell, charged to the line that allocated it."""

    where: str
    filename: str
    line: int
    function: str
    source: str
    nbytes: int
    blocks: int
    devices: tuple[int, ...]
    via: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The line as plain JSON types."""
        return {
            "where": self.where,
            "filename": self.filename,
            "line": self.line,
            "function": self.function,
            "source": self.source,
            "nbytes": self.nbytes,
            "blocks": self.blocks,
            "devices": list(self.devices),
            "via": self.via,
        }


@dataclass
class _LineTotal:
    function: str
    nbytes: int = 0
    blocks: int = 0
    devices: set[int] = field(default_factory=set)
    via: str = ""


def group_by_line(
    blocks: Iterable[Block],
    *,
    cell_files: frozenset[str] = frozenset(),
    only_cell: bool = False,
    is_user: Callable[[str], bool] = lambda filename: True,
    where: Callable[[str, int], str] = lambda filename, line: f"{filename}:{line}",
    source: Callable[[str, int], str] = lambda filename, line: "",
) -> tuple[TraceLine, ...]:
    """Group live blocks by the line that allocated them, largest first.

    A block's stack (innermost frame first) is charged to its innermost user frame
    (``is_user``): the user's line that called into torch. Blocks without a Python
    stack were allocated before recording started and are left out; with ``only_cell``
    so are blocks whose stack does not pass through ``cell_files``. ``via`` names the
    cell line that led there when the allocating line is elsewhere (a function defined
    in another cell or a module).
    """
    totals: dict[tuple[str, int], _LineTotal] = {}
    for block in blocks:
        # C++ frames are there when the user records with stacks="all"; the line to
        # charge is a Python one.
        frames = [f for f in block.frames if is_python_file(f.filename)]
        if not frames or (only_cell and not cell_files.intersection(f.filename for f in frames)):
            continue
        chosen = next((f for f in frames if is_user(f.filename)), None)
        via_frame = None
        if chosen is None:
            key = ("<library>", 0)
        else:
            key = (chosen.filename, chosen.line)
            via_frame = next((f for f in frames if f.filename in cell_files), None)
        total = totals.setdefault(key, _LineTotal(chosen.name if chosen else ""))
        total.nbytes += block.size
        total.blocks += 1
        total.devices.add(block.device)
        if via_frame is not None and via_frame is not chosen and not total.via:
            total.via = where(via_frame.filename, via_frame.line)
    lines = []
    for (filename, line), total in totals.items():
        library = filename == "<library>"
        lines.append(
            TraceLine(
                where="library code only" if library else where(filename, line),
                filename="" if library else filename,
                line=line,
                function=total.function,
                source="" if library else source(filename, line),
                nbytes=total.nbytes,
                blocks=total.blocks,
                devices=tuple(sorted(total.devices)),
                via=total.via,
            )
        )
    lines.sort(key=lambda t: (-t.nbytes, t.where))
    return tuple(lines)
