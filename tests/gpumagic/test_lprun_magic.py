"""``%lprun`` through a real IPython shell (CPU; the pretend GPU for the CUDA paths)."""

from __future__ import annotations

import builtins
import linecache
import re
import subprocess
import sys
import textwrap
import warnings
from typing import TYPE_CHECKING, Any

import pytest
from fake_runtime import FakeDevice
from IPython.core.displaypub import CapturingDisplayPublisher
from IPython.core.error import UsageError
from line_profiler import LineStats

from fake_cuda import install
from gpumagic import cuda
from gpumagic.lineprof_magics import LprunMagics

if TYPE_CHECKING:
    from pathlib import Path

    from IPython.core.interactiveshell import ExecutionResult, InteractiveShell


class Run:
    """One ``run_cell``: its result and what it displayed."""

    def __init__(self, shell: InteractiveShell, cell: str) -> None:
        publisher = CapturingDisplayPublisher()
        shell.display_pub = publisher
        self.result: ExecutionResult = shell.run_cell(cell)
        self.outputs = [output["data"] for output in publisher.outputs]

    @property
    def text(self) -> str:
        (data,) = self.outputs
        return str(data["text/plain"])

    @property
    def html(self) -> str:
        (data,) = self.outputs
        return str(data["text/html"])

    def table(self, name: str) -> dict[str, tuple[str, ...]]:
        """``{source line: cells}`` of the rows with hits, for function ``name``."""
        block = self.text.split(f"Function: {name} at line ", 1)[1].split("\n\n")[1]
        header, _, *lines = block.splitlines()
        source_at = header.index("Line Contents")
        rows = {}
        for line in lines:
            cells = tuple(line[:source_at].split())
            if len(cells) > 1:
                rows[line[source_at:].strip()] = cells[1:]
        return rows


def cell(shell: InteractiveShell, source: str) -> None:
    result = shell.run_cell(textwrap.dedent(source))
    assert result.success, result.error_in_exec


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process has no CUDA context, as far as %lprun can tell (on the GPU machine
    earlier tests may have created one)."""
    install(monkeypatch, devices_with_context=lambda: ())


@pytest.fixture
def dev(monkeypatch: pytest.MonkeyPatch, shell: InteractiveShell) -> FakeDevice:
    device = FakeDevice().install(monkeypatch)
    shell.user_ns["dev"] = device
    return device


STEP = """
def step(dev):
    dev.launch(0.05)
    return dev.item()
"""


# -- the magic replaces line_profiler's ----------------------------------------------------


def test_loading_gpumagic_replaces_lprun(shell: InteractiveShell) -> None:
    owner = shell.magics_manager.magics["line"]["lprun"].__self__
    assert isinstance(owner, LprunMagics)
    shell.run_line_magic("load_ext", "line_profiler")  # the documented way back
    owner = shell.magics_manager.magics["line"]["lprun"].__self__
    assert type(owner).__name__ == "LineProfilerMagics"


def test_help_names_every_option(shell: InteractiveShell) -> None:
    doc = LprunMagics.lprun.__doc__ or ""
    for option in ("-f", "-m", "-D", "-T", "-r", "-s", "-z", "-u", "--no-sync", "--gpu"):
        assert option in doc
    assert "--memory" in doc


# -- output -----------------------------------------------------------------------------


@pytest.mark.usefixtures("no_cuda")
def test_table_is_line_profilers_without_cuda(shell: InteractiveShell) -> None:
    cell(
        shell,
        """
        def f(n, s='a'):
            t = 0
            for i in range(n):
                t += i
            return t
        """,
    )
    run = Run(shell, "prof = %lprun -r -f f f(3, 'b')")
    assert run.result.success
    stats = shell.user_ns["prof"].get_stats()
    import io

    expected = io.StringIO()
    stats.print(expected)
    assert run.text == expected.getvalue().rstrip()  # no notes without CUDA
    hits = {source: cells[0] for source, cells in run.table("f").items()}
    assert hits == {"t = 0": "1", "for i in range(n):": "4", "t += i": "3", "return t": "1"}
    assert "File: <ipython-input-" in run.text  # functions defined in cells


@pytest.mark.usefixtures("no_cuda")
def test_layout_matches_line_profilers_own_magic(shell: InteractiveShell) -> None:
    """Same header and columns as line_profiler 5's %lprun (its pager output)."""
    from IPython.core.interactiveshell import InteractiveShell as Shell
    from line_profiler import ipython_extension

    source = "def g(n):\n    x = n * 2\n    return x\n"
    cell(shell, source)
    ours = Run(shell, "%lprun -f g g(2)").text
    Shell.clear_instance()
    other = Shell.instance()
    other.run_line_magic("load_ext", "line_profiler")
    paged: list[str] = []
    original = ipython_extension.page
    ipython_extension.page = paged.append
    try:
        other.run_cell(source)
        other.run_cell("%lprun -f g g(2)")
    finally:
        ipython_extension.page = original
        Shell.clear_instance()

    def shape(text: str) -> list[tuple[str, int]]:
        """Each line with numbers masked, and where the source column starts."""
        return [
            (
                " ".join(re.sub(r"\d+(\.\d+)?(e[-+]\d+)?", "N", line).split()),
                line.find("x = n"),
            )
            for line in text.splitlines()
        ]

    assert shape(ours) == shape(paged[0].rstrip())


def test_output_is_displayed_as_html_and_text_never_paged(
    shell: InteractiveShell, monkeypatch: pytest.MonkeyPatch
) -> None:
    import IPython.core.page

    monkeypatch.setattr(IPython.core.page, "page", lambda *a, **k: pytest.fail("paged"))
    # One line that takes measurable time: where %lprun's own per-line cost is taken
    # off (a process that uses CUDA), a bare `return 1` can come out at 0 ns.
    cell(shell, "def h():\n    return sum(range(100_000))\n")
    run = Run(shell, "%lprun -f h h()")
    assert run.result.success
    assert "Line Contents" in run.text
    assert "<table>" in run.html
    assert "return sum(range(100_000))" in run.html
    # The time bars: in cells of their own, never drawn under a number.
    assert '<td class="pct">100.0</td><td class="bar"><span style="width:60.0px' in run.html
    assert "linear-gradient" not in run.html


def test_unit_and_strip_zeros(shell: InteractiveShell) -> None:
    cell(shell, "def used():\n    return 1\ndef unused():\n    return 2\n")
    run = Run(shell, "%lprun -f used -f unused -u 1e-3 used()")
    assert run.text.startswith("Timer unit: 0.001 s")
    assert "Function: unused" in run.text
    for flag in ("-z", "-s"):
        run = Run(shell, f"%lprun -f used -f unused {flag} used()")
        assert "Function: used" in run.text
        assert "Function: unused" not in run.text


def test_text_file_and_lprof_round_trip(shell: InteractiveShell, tmp_path: Path) -> None:
    cell(shell, "def k(n):\n    total = sum(range(n))\n    return total\n")
    lprof, text = tmp_path / "k.lprof", tmp_path / "k.txt"
    run = Run(shell, f"prof = %lprun -r -D {lprof} -T {text} -f k k(10)")
    assert run.result.success
    assert text.read_text() == run.text + "\n"
    stats = LineStats.from_files(lprof)
    assert stats == shell.user_ns["prof"].get_stats()
    shown = subprocess.run(
        [sys.executable, "-m", "line_profiler", str(lprof)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "Function: k at line 1" in shown
    assert "Line #      Hits         Time  Per Hit   % Time  Line Contents" in shown


def test_return_value_only_with_r(shell: InteractiveShell, dev: FakeDevice) -> None:
    cell(shell, "def m():\n    return 1\n")
    assert Run(shell, "%lprun -f m m()").result.result is None
    prof = Run(shell, "%lprun -r -f m m()").result.result
    from line_profiler import LineProfiler

    assert isinstance(prof, LineProfiler)
    assert prof.result().hook in ("sys.settrace", "sys.monitoring")


def test_quotes_in_the_statement_behave_as_in_line_profiler(shell: InteractiveShell) -> None:
    cell(shell, "def q(s):\n    return s.upper()\n")
    run = Run(shell, "%lprun -f q out = q('a b')")
    assert run.result.success
    assert shell.user_ns["out"] == "A B"


def test_module_option(
    shell: InteractiveShell, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "lprun_target_mod.py").write_text("def work(n):\n    return n + 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cell(shell, "import lprun_target_mod")
    run = Run(shell, "%lprun -m lprun_target_mod lprun_target_mod.work(1)")
    assert run.result.success
    assert "Function: work at line 1" in run.text
    assert run.table("work")["return n + 1"][0] == "1"


def test_cell_form_profiles_the_named_functions_while_the_cell_runs(
    shell: InteractiveShell,
) -> None:
    cell(shell, "def work(n):\n    return sum(range(n))\n")
    run = Run(shell, "%%lprun -f work\na = work(10)\nb = work(20)\n")
    assert run.result.success
    assert run.table("work")["return sum(range(n))"][0] == "2"
    assert (shell.user_ns["a"], shell.user_ns["b"]) == (45, 190)
    bad = shell.run_cell("%%lprun -f work work(1)\nwork(2)\n")
    assert isinstance(bad.error_in_exec, UsageError)
    assert "%%lprun takes only options on its first line" in str(bad.error_in_exec)


def test_cell_functions_are_named_by_their_cell(shell: InteractiveShell) -> None:
    """In the HTML (what Jupyter shows), not /tmp/ipykernel_28850/3230289714.py:4; the
    text keeps line_profiler's File: line."""
    shell.run_cell("pass", store_history=True)
    shell.run_cell("def w(n):\n    return n + 1\n", store_history=True)
    run = Run(shell, "%lprun -f w w(1)")
    assert "File: <ipython-input-2-" in run.text
    assert "<b>w</b> — In[2], line 1 — total" in run.html


def test_profiling_a_file_keeps_every_cells_source(
    shell: InteractiveShell, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """line_profiler's table clears linecache before reading a real file; the cells'
    sources (which no file holds) must survive it."""
    (tmp_path / "lprun_file_mod.py").write_text("def f(n):\n    return n * 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cell(shell, "import inspect, lprun_file_mod")
    cell(
        shell,
        """
        def work(n):
            total = 0
            for i in range(n):
                total += i
            return total
        """,
    )
    assert Run(shell, "%lprun -m lprun_file_mod lprun_file_mod.f(10)").result.success
    run = Run(shell, "%lprun -f work work(10)")
    assert run.table("work")["total += i"][0] == "10"
    cell(shell, "source = inspect.getsource(work)")
    assert "total += i" in shell.user_ns["source"]


def test_a_file_function_and_a_cell_function_in_one_run_both_show_their_lines(
    shell: InteractiveShell, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """line_profiler clears linecache before each real file's table: a cell function's
    table printed after it must still have its lines, and linecache.clearcache is the
    standard library's again afterwards."""
    (tmp_path / "lprun_mixed_mod.py").write_text("def f(n):\n    return n * 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cell(shell, "import linecache, lprun_mixed_mod")
    cell(
        shell,
        """
        def g(n):
            doubled = lprun_mixed_mod.f(n)
            return doubled + 1
        """,
    )
    clearcache = linecache.clearcache
    run = Run(shell, "%lprun -f lprun_mixed_mod.f -f g g(10)")
    assert run.table("f")["return n * 2"][0] == "1"
    assert run.table("g")["return doubled + 1"][0] == "1"
    assert linecache.clearcache is clearcache


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("%lprun -f nope nope()", "Could not find function nope"),
        ("%lprun -m no_such_module_xyz 1", "Could not find module no_such_module_xyz"),
        ("%lprun -u abc 1", "-u takes the time unit in seconds"),
        ("%lprun -u -1 1", "positive time unit"),
        ("%lprun -u nan 1", "positive time unit in seconds, e.g. -u 1e-3; got 'nan'"),
        ("%lprun -u inf 1", "positive time unit in seconds, e.g. -u 1e-3; got 'inf'"),
        ("%lprun -f len", "needs a statement to run"),
        ("%lprun --colour 1", "option --colour not recognized"),
        ("%lprun -f 42 len([])", "-f 42: 'int' objects are not code to profile"),
        ("%lprun -D -f len len([])", "-D takes a file name, got '-f'"),
        ("%lprun -D /nonexistent/x.lprof -f len len([])", "there is no directory '/nonexistent'"),
        ("%lprun -T /nonexistent/x.txt -f len len([])", "there is no directory '/nonexistent'"),
        ("%lprun -f len await asyncio.sleep(0)", "top-level await is not allowed"),
    ],
)
def test_bad_input_is_a_usage_error(
    shell: InteractiveShell,
    line: str,
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    result = shell.run_cell(line)
    assert isinstance(result.error_in_exec, UsageError)
    assert message in str(result.error_in_exec)
    assert not list(tmp_path.iterdir())  # no file written (-D -f wrote one named "-f")


# -- coverage of what can be profiled --------------------------------------------------


def test_methods_properties_and_closures(shell: InteractiveShell) -> None:
    cell(
        shell,
        """
        class Box:
            def __init__(self, n):
                self.n = n

            def double(self):
                return self.n * 2

            @property
            def half(self):
                return self.n / 2

        def make_counter():
            count = [0]

            def bump():
                count[0] += 1
                return count[0]

            return bump

        box = Box(4)
        bump = make_counter()
        """,
    )
    run = Run(shell, "%lprun -f box.double -f Box.half -f bump box.double(), box.half, bump()")
    assert run.result.success
    assert run.table("Box.double")
    assert run.table("Box.half")
    assert run.table("make_counter.<locals>.bump")


def test_nn_module_profiles_forward(shell: InteractiveShell) -> None:
    torch = pytest.importorskip("torch")
    cell(
        shell,
        """
        import torch

        class Net(torch.nn.Module):
            def forward(self, x):
                y = x * 2
                return y + 1

        net = Net()
        """,
    )
    initialized = torch.cuda.is_initialized()
    run = Run(shell, "%lprun -f net net(torch.ones(3))")
    assert run.result.success
    assert run.table("Net.forward")["y = x * 2"][0] == "1"
    assert "net is an nn.Module: profiling its forward()." in run.text
    assert torch.cuda.is_initialized() is initialized  # CPU work creates no context


def test_torch_compiled_function_is_one_opaque_line(shell: InteractiveShell) -> None:
    pytest.importorskip("torch")
    cell(
        shell,
        """
        import torch

        def body(x):
            return x * 2

        cbody = torch.compile(body, backend="eager")

        def caller(x):
            y = cbody(x)
            return y
        """,
    )
    run = Run(shell, "%lprun -f caller -f cbody caller(torch.ones(2))")
    assert run.result.success
    assert "cbody is torch.compile'd" in run.text
    assert "caller line 9 calls torch.compile'd cbody" in run.text
    assert run.table("caller")["y = cbody(x)"][0] == "1"


def test_generator_and_coroutine_suspended_time_not_billed(shell: InteractiveShell) -> None:
    cell(
        shell,
        """
        import asyncio, time

        def gen():
            for i in range(3):
                yield i

        async def coro():
            await asyncio.sleep(0.05)
            return 1

        def consume():
            for _ in gen():
                time.sleep(0.02)
        """,
    )
    run = Run(shell, "prof = %lprun -r -f gen -f coro -f consume consume(); asyncio.run(coro())")
    assert run.result.success
    stats = shell.user_ns["prof"].get_stats()
    billed = {
        name: [t * stats.unit for _, _, t in timings]
        for (_, _, name), timings in stats.timings.items()
    }
    # Billed, the 60 ms the generator waited at its yield and the 50 ms the coroutine
    # waited at its await would each outweigh half the consumer's sleeps (60 ms): a
    # share of those, not a number of seconds a loaded host could exceed (issue 39).
    slept = max(billed["consume"])
    assert sum(billed["gen"]) < slept / 2
    assert sum(billed["coro"]) < slept / 2
    assert run.table("gen")["yield i"][0] == "3"


def test_recursion(shell: InteractiveShell) -> None:
    cell(
        shell, "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n"
    )
    run = Run(shell, "%lprun -f fib fib(5)")
    assert run.table("fib")["if n < 2:"][0] == "15"


def test_multiline_statement_counted_once(shell: InteractiveShell, dev: FakeDevice) -> None:
    cell(shell, "def ml(a):\n    b = max(\n        a,\n        2)\n    return b\n")
    run = Run(shell, "%lprun -f ml ml(1)")
    rows = run.table("ml")
    assert rows["b = max("][0] == "1"
    assert list(rows) == ["b = max(", "return b"]
    assert "counted once, on its first line" in run.text


def test_exception_shows_the_profile_then_raises(shell: InteractiveShell) -> None:
    cell(shell, "import time\ndef bad():\n    time.sleep(0.02)\n    raise ValueError('boom')\n")
    run = Run(shell, "%lprun -f bad bad()")
    assert isinstance(run.result.error_in_exec, ValueError)
    rows = run.table("bad")
    assert rows["raise ValueError('boom')"][0] == "1"
    assert float(rows["time.sleep(0.02)"][1]) * 1e-9 >= 0.02


@pytest.mark.parametrize(
    ("source", "line"),
    [
        ("%lprun -f bad bad()", "----> 1 %lprun -f bad bad()"),
        ("%%lprun -f bad\nx = 1\nbad()", "----> 3 bad()"),  # the cell's own line number
    ],
)
def test_a_raising_statement_shows_the_users_frames_only(
    shell: InteractiveShell, source: str, line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """From the statement on: not our frames, nor "Could not get source" (issue 29)."""
    cell(shell, "def bad():\n    return 1 / 0\n")
    capsys.readouterr()
    run = Run(shell, source)
    assert isinstance(run.result.error_in_exec, ZeroDivisionError)
    text = re.sub(r"\x1b\[[0-9;]*m", "", "".join(capsys.readouterr()))
    assert line in text
    assert "----> 2     return 1 / 0" in text
    assert "gpumagic" not in text
    assert "Could not get source" not in text
    assert "lineprof" not in text  # none of the magic's own frames


@pytest.mark.parametrize("exc", ["KeyboardInterrupt", "SystemExit"])
def test_interrupt_and_exit_are_reported(
    shell: InteractiveShell, exc: str, capsys: pytest.CaptureFixture[str]
) -> None:
    cell(shell, f"def stop():\n    x = 1\n    raise {exc}\n")
    run = Run(shell, "%lprun -f stop stop()")
    assert run.result.success
    assert f"*** {exc} exception caught in code being profiled." in capsys.readouterr().out
    assert run.table("stop")["x = 1"][0] == "1"


# -- the pretend GPU through the magic --------------------------------------------------


def test_synchronized_by_default(shell: InteractiveShell, dev: FakeDevice) -> None:
    """Where the pretend GPU's 50 ms go: on the launching line by default, on the line
    that waits with --no-sync; the other line holds none of it (its own time is the
    host's, which a loaded machine stretches: 8.1 ms for a launch under two concurrent
    CI runs on two cores)."""
    cell(shell, STEP)
    rows = Run(shell, "%lprun -f step -u 1e-3 step(dev)").table("step")
    assert float(rows["dev.launch(0.05)"][1]) >= 49
    assert float(rows["return dev.item()"][1]) < 49
    rows = Run(shell, "%lprun -f step -u 1e-3 --no-sync step(dev)").table("step")
    assert float(rows["dev.launch(0.05)"][1]) < 49
    assert float(rows["return dev.item()"][1]) >= 49


def test_gpu_and_memory_columns(shell: InteractiveShell, dev: FakeDevice) -> None:
    cell(
        shell,
        """
        def work(dev):
            dev.gpu.alloc(2 ** 20)
            dev.launch(0.05)
            return dev.item()
        """,
    )
    run = Run(shell, "%lprun -f work -u 1e-3 --gpu --memory --no-sync work(dev)")
    header = next(line for line in run.text.splitlines() if line.startswith("Line #"))
    columns = "Line #|Hits|Time|Per Hit|% Time|GPU Time|% GPU|Syncs|Mem Δ|Peak|Line Contents"
    assert re.split(r"\s{2,}|(?<=\d) ", header.strip()) == columns.split("|")
    assert "Total GPU time:" in run.text
    rows = run.table("work")
    alloc, launch, wait = (
        rows["dev.gpu.alloc(2 ** 20)"],
        rows["dev.launch(0.05)"],
        rows["return dev.item()"],
    )
    assert alloc[-4:] == ("+1.0", "MiB", "1.0", "MiB")  # Mem Δ and Peak
    assert launch[4:6] == ("50.0", "100.0")  # GPU Time of the launching line: CUPTI's
    # The host waited where .item() ran (no sync): until 50 ms after the launch, less
    # what the launching line itself took on a loaded host.
    assert float(wait[1]) + float(launch[1]) >= 49
    assert float(wait[1]) > float(launch[1])
    assert wait[4] == "1"  # no GPU work of its own; one synchronizing call
    assert "⚠ 1" in run.html
    assert 'class="sync"' in run.html
    assert "GPU Time: the device time CUPTI recorded" in run.text
    assert dev.debug_mode == 0


def test_gpu_no_sync_inserts_no_synchronize_and_says_what_ran(
    shell: InteractiveShell, dev: FakeDevice
) -> None:
    cell(shell, STEP)
    before = dev.syncs
    run = Run(shell, "%lprun -f step -u 1e-3 --gpu --no-sync step(dev); step(dev)")
    assert run.result.success
    # Only torch.profiler's record needs the GPU done, once, after the run; the one
    # .item() per call is the user's own.
    assert dev.syncs - before == 1
    assert "--no-sync: no synchronize at line boundaries" in run.text
    assert "--gpu: 2 kernels, copies and memsets, 100 ms on the GPU; recording cost" in run.text
    assert (
        "one synchronize after the run, so that the record is complete, and not one at "
        "a line boundary." in run.text
    )
    assert run.table("step")["dev.launch(0.05)"][4:6] == ("100.0", "100.0")
    # The default synchronizes at each boundary as before, --gpu or not.
    before = dev.syncs
    run = Run(shell, "%lprun -f step --gpu step(dev)")
    assert "Synchronized cuda:0 at every profiled line boundary" in run.text
    assert dev.syncs - before > 3


def test_gpu_self_and_backward_columns(shell: InteractiveShell, dev: FakeDevice) -> None:
    cell(
        shell,
        """
        def layer(dev):
            dev.launch(0.002, grad=True)
            return 1

        def train(dev):
            h = layer(dev)
            dev.launch(0.001, grad=True)
            dev.backward()
        """,
    )
    run = Run(shell, "%lprun -f train -f layer -u 1e-3 --gpu --no-sync train(dev)")
    header = next(line for line in run.text.splitlines() if line.startswith("Line #"))
    columns = "Line #|Hits|Time|Per Hit|% Time|GPU Time|% GPU|Self|Bwd|Syncs|Line Contents"
    assert re.split(r"\s{2,}", header.strip()) == columns.split("|")
    rows = run.table("train")
    # GPU Time, % GPU, Self, Bwd: the forward kernel plus the backward one it built.
    assert rows["h = layer(dev)"][4:8] == ("4.0", "66.7", "0.0", "2.0")
    assert rows["dev.launch(0.001, grad=True)"][4:8] == ("2.0", "33.3", "2.0", "1.0")
    assert len(rows["dev.backward()"]) == 4  # no GPU work of its own left
    assert run.table("layer")["dev.launch(0.002, grad=True)"][4:8] == ("4.0", "100.0", "4.0", "2.0")
    assert "Bwd: backward kernels charged to the forward line" in run.text
    assert "<th>Self</th><th>Bwd</th>" in run.html


@pytest.mark.usefixtures("no_cuda")
def test_gpu_without_cuda_says_so(shell: InteractiveShell) -> None:
    cell(shell, "def plain():\n    return 1\n")
    run = Run(shell, "%lprun -f plain --gpu --memory plain()")
    assert "The statement used no CUDA: there are no GPU or memory columns." in run.text
    assert "GPU Time" not in run.text


# -- nothing stays behind ------------------------------------------------------------------


def snapshot() -> dict[str, Any]:
    state: dict[str, Any] = {
        "trace": sys.gettrace(),
        "profile": builtins.__dict__.get("profile", "absent"),
        "filters": list(warnings.filters),
        "showwarning": warnings.showwarning,
    }
    monitoring = getattr(sys, "monitoring", None)
    if monitoring is not None:
        state["tools"] = [monitoring.get_tool(i) for i in range(6)]
    return state


@pytest.mark.parametrize(
    "body",
    ["return dev.item()", "raise ValueError('x')", "raise KeyboardInterrupt"],
)
def test_everything_restored(shell: InteractiveShell, dev: FakeDevice, body: str) -> None:
    cell(shell, f"seen = []\ndef r(dev):\n    seen.append(profile)\n    {body}\n")
    original = shell.user_ns["r"].__code__
    before = snapshot()
    Run(shell, "%lprun -f r --gpu --memory r(dev)")
    assert snapshot() == before
    assert shell.user_ns["r"].__code__ is original
    assert type(shell.user_ns["seen"][0]).__name__ == "GpuLineProfiler"  # @profile works
    assert dev.debug_mode == 0


def test_builtins_profile_of_the_user_is_kept(shell: InteractiveShell) -> None:
    marker = object()
    builtins.profile = marker  # type: ignore[attr-defined]
    try:
        cell(shell, "def p():\n    return 1\n")
        Run(shell, "%lprun -f p p()")
        assert builtins.profile is marker  # type: ignore[attr-defined]
    finally:
        del builtins.profile  # type: ignore[attr-defined]


@pytest.mark.usefixtures("no_cuda")
def test_a_slow_statement_is_not_slowed_by_syncs_without_cuda(
    shell: InteractiveShell, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No synchronize at all without CUDA (it was a bound on the call's wall time, which a
    # loaded host can break: issue 39).
    synced: list[object] = []
    monkeypatch.setattr(cuda, "synchronize", lambda *args, **kwargs: synced.append(args))
    cell(shell, "import time\ndef slow():\n    time.sleep(0.03)\n")
    run = Run(shell, "%lprun -f slow slow()")
    assert synced == []
    assert float(run.table("slow")["time.sleep(0.03)"][1]) * 1e-9 >= 0.03
