"""A fresh, real IPython shell per test, with gpumagic loaded."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from collections.abc import Iterator

    from IPython.core.interactiveshell import InteractiveShell


@pytest.fixture
def shell() -> Iterator[InteractiveShell]:
    """A new ``InteractiveShell`` (not the singleton of an earlier test) after
    ``%load_ext gpumagic``; cleared afterwards."""
    from IPython.core.interactiveshell import InteractiveShell

    InteractiveShell.clear_instance()
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "gpumagic")
    try:
        yield ip
    finally:
        InteractiveShell.clear_instance()
