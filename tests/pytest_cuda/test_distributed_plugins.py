"""``cuda_distributed`` tests beside other plugins and torch's import warnings, on the CPU
with gloo (issue 39).

pytest-memray wraps each test function in a local function of its own (to track the
pytest process's memory while it runs); the ranks must still get the test function,
which pickles. A warning every rank raises when it imports a module (torch's "Failed
to initialize NumPy" without numpy) is one warning for the session, not one per rank
start.
"""

from __future__ import annotations

import pickle
from functools import wraps
from typing import TYPE_CHECKING, Any

import pytest

from pytest_cuda.distributed.plugin import _rank_function

if TYPE_CHECKING:
    from collections.abc import Callable

GLOO_SUITE = """
import pytest
import torch
import torch.distributed as dist


@pytest.fixture
def scale():
    return 3


@pytest.mark.cuda_distributed(world_size=2, backend="gloo", timeout=30)
def test_all_reduce(cuda_rank, scale):
    t = torch.tensor([cuda_rank.rank + 1.0]) * scale
    dist.all_reduce(t, group=cuda_rank.group)
    assert t.item() == 9.0


class TestInAClass:
    @pytest.mark.cuda_distributed(world_size=2, backend="gloo", timeout=30)
    def test_all_reduce(self, cuda_rank):
        t = torch.tensor([1.0])
        dist.all_reduce(t, group=cuda_rank.group)
        assert t.item() == 2.0


def test_on_the_host():
    assert [0] * 1024
"""


def test_a_distributed_test_runs_under_pytest_memray(pytester: pytest.Pytester) -> None:
    """``--memray`` wraps the test function; the ranks run the function itself. It
    failed with "Can't pickle <function test_all_reduce>" before."""
    pytest.importorskip("pytest_memray", reason="pytest-memray is not installed")
    pytester.makepyfile(test_gloo=GLOO_SUITE)
    result = pytester.runpytest_subprocess("--memray", "-p", "no:cacheprovider", "-q")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(["*MEMRAY REPORT*"])
    assert "pickle" not in result.stdout.str()


WARNS_ON_IMPORT = """
import warnings

warnings.warn("planted: failed to initialize a planted module", UserWarning)
"""

WARNING_SUITE = """
import warnings

import pytest


@pytest.mark.cuda_distributed(world_size=2, backend="gloo", timeout=30)
def test_warm(cuda_rank):
    import warns_on_import
    warnings.warn(f"planted: in test_warm", UserWarning)


@pytest.mark.cuda_distributed(world_size=2, backend="gloo", timeout=30, isolate=True)
def test_fresh(cuda_rank):
    import warns_on_import
    warnings.warn(f"planted: in test_fresh", UserWarning)

"""


def test_an_import_warning_of_every_rank_is_relayed_once_a_session(
    pytester: pytest.Pytester,
) -> None:
    """Four rank processes, of two rank starts, import a module that warns: the summary
    shows it once, naming both ranks of the first test. It showed it once per rank
    start before; a warning a test body raises is still shown for that test."""
    pytester.makepyfile(test_warnings=WARNING_SUITE, warns_on_import=WARNS_ON_IMPORT)
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    out = result.stdout.str()
    relayed = [line for line in out.splitlines() if "UserWarning: rank" in line]
    assert sum("failed to initialize a planted module" in line for line in relayed) == 1, out
    result.stdout.fnmatch_lines(
        [
            "*warnings summary*",
            "test_warnings.py::test_warm",
            "*warns_on_import.py:*: UserWarning: ranks 0, 1: planted: failed to initialize*",
        ]
    )
    for name in ("test_warm", "test_fresh"):
        assert sum(f"ranks 0, 1: planted: in {name}" in line for line in relayed) == 1, out


def _local_wrapper(function: Callable[..., Any]) -> Callable[..., Any]:
    @wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return function(*args, **kwargs)

    return wrapper


def module_level_test() -> None:
    """A test function as a module defines it."""


def test_a_wrapper_that_does_not_pickle_is_unwrapped() -> None:
    twice = _local_wrapper(_local_wrapper(module_level_test))
    assert _rank_function(twice) == (module_level_test, None)
    assert _rank_function(module_level_test) == (module_level_test, None)


def test_a_test_function_that_does_not_pickle_is_the_error() -> None:
    def nested() -> None:
        pass

    found, error = _rank_function(_local_wrapper(nested))
    assert found is nested
    assert isinstance(error, (pickle.PicklingError, AttributeError))
    assert "nested" in str(error)


def test_a_wrapper_chain_that_loops_ends() -> None:
    def nested() -> None:
        pass

    nested.__wrapped__ = nested  # type: ignore[attr-defined]
    found, error = _rank_function(nested)
    assert found is nested
    assert error is not None
