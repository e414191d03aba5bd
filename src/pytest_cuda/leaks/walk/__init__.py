"""Who holds a leaked CUDA tensor: the walk up the references from a leaked storage to
a root (a module global, a fixture's value, a library cache), young objects first,
within a time budget. :mod:`~pytest_cuda.leaks.walk.holders` is its entry point."""

__all__ = ()
