"""The ``--cuda-leak-report`` file: checked before any test runs, written atomically.

At configure :func:`check_report_file` creates (and removes) a file beside the report,
which is exactly what writing it takes; a path where that fails (a folder, a folder that
does not exist, ``/proc``) is refused with one line. At the end :func:`write_report_file`
writes a temporary file in the same folder and moves it over the report, so a reader
never sees half a report, and a failure leaves the previous file as it was.

Pure: no pytest, no CUDA.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path

__all__ = ["ReportFileError", "check_report_file", "write_report_file"]


class ReportFileError(ValueError):
    """The report cannot be written there; the message says why, in one line."""


def check_report_file(path: Path, given: str) -> None:
    """Raise :class:`ReportFileError` unless a report can be written at ``path``
    (``given``: the path as the user wrote it, for the message)."""
    where = f"--cuda-leak-report={given}"
    if path.is_dir():
        raise ReportFileError(f"{where}: {path} is a folder; name a file in it")
    folder = path.parent
    if not folder.is_dir():
        raise ReportFileError(f"{where}: the folder {folder} does not exist; create it first")
    try:
        _create_beside(path).unlink()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ReportFileError(f"{where}: cannot create a file in {folder} ({reason})") from None


def write_report_file(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (a file beside it, then ``os.replace``).

    Raises :class:`OSError`; the report then is what it was before.
    """
    temporary = _create_beside(path)
    try:
        temporary.write_text(text, encoding="utf-8")
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise


def _create_beside(path: Path) -> Path:
    """A new empty file in ``path``'s folder, with the permissions a plain open gives
    (``tempfile.mkstemp`` would give the report mode 0600)."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    os.close(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    return temporary
