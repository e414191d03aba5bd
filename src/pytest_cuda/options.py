"""The ``pytest --help`` section of pytest_cuda, which every pytest_cuda module adds to.

A leaf module: the entry point (:mod:`pytest_cuda.plugin`) and the modules it loads
(:mod:`pytest_cuda.leak_plugin`, :mod:`pytest_cuda.sync_plugin`) import it, never each
other for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from _pytest.config.argparsing import OptionGroup, Parser

__all__ = ["option_group"]


def option_group(parser: Parser) -> OptionGroup:
    """The one ``pytest --help`` section that every pytest_cuda module adds its options to."""
    return parser.getgroup("cuda", "CUDA devices (pytest_cuda)")
