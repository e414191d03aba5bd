"""The plugin's registered objects behave as pytest expects of plugins."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pytest


def test_a_suite_with_nested_conftests_runs(pytester: pytest.Pytester) -> None:
    # pytest keeps plugins in sets when some conftests do not apply to a test: an
    # unhashable plugin object (a dataclass with eq=True) stopped such runs with an
    # INTERNALERROR.
    pytester.makeconftest("")
    pytester.mkpydir("sub")
    pytester.path.joinpath("sub", "conftest.py").write_text("")
    pytester.path.joinpath("sub", "test_inner.py").write_text("def test_inner():\n    pass\n")
    pytester.makepyfile(test_outer="def test_outer():\n    pass\n")
    result = pytester.runpytest()
    result.assert_outcomes(passed=2)
    assert "INTERNALERROR" not in result.stdout.str()
