"""A fresh IPython shell for one test, closed at its end.

``InteractiveShell.instance()`` hands the shell's exit work (clear its namespaces,
close its history database) to :mod:`atexit`, which keeps every shell a session made
alive until the process exits, then does that work for each in turn. Hundreds of
shells left that way made every later walk of the heap slower (the leak holders'
tests: ten times) and a pytest process's exit take a minute; each also kept the one
before it alive through ``sys.modules["__main__"]``. :func:`fresh_shell`
keeps the history in memory (never in the user's ``~/.ipython``) and closes the
shell when its test is done with it.
"""

from __future__ import annotations

import atexit
import contextlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterator

    from IPython.core.interactiveshell import InteractiveShell


@contextlib.contextmanager
def fresh_shell() -> Iterator[InteractiveShell]:
    """A new ``InteractiveShell`` singleton (not an earlier test's), closed after."""
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    config = Config()
    config.HistoryManager.hist_file = ":memory:"
    InteractiveShell.clear_instance()
    shell = InteractiveShell.instance(config=config)
    try:
        yield shell
    finally:
        InteractiveShell.clear_instance()
        atexit.unregister(shell.atexit_operations)
        shell.atexit_operations()
        # It put its namespace in sys.modules["__main__"], and kept the one it found
        # there to restore: the earlier shell's namespace, which holds that shell.
        shell.cleanup()
