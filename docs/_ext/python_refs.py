"""Cross-references to Python objects that the docs do not document themselves.

The docs build runs nitpicky (``-n -W``): every ``:class:``, ``:func:``, ``:mod:``...
reference and every type in a signature must resolve. Sphinx resolves one that names
an object documented on these pages. This extension handles the rest, on Sphinx's
``missing-reference`` event:

* a name that is really the same object as a documented one (``Readings`` in
  ``pytest_cuda.leaks.engine``, imported from ``pytest_cuda.leaks.settle``; a name
  imported under ``TYPE_CHECKING`` only) becomes a link to it;
* a name of an object that exists but is not on these pages (an internal module such
  as ``gpumagic.cuda.runtime``, the standard library's ``collections.abc.Mapping``,
  ``pytest.Item``, ``torch.device``) is shown as code, without a link: the build has no
  network, so no other project's inventory (intersphinx) is read;
* a name that resolves to nothing stays a warning, an error under ``-W``: a typo, or an
  object that was renamed or removed.

Whether a name exists is decided by importing it, as written and relative to the
module and class it appears in, and by reading the ``from ... import`` statements of
that module (for names imported for type checking only).
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from docutils import nodes
    from sphinx.addnodes import pending_xref
    from sphinx.application import Sphinx
    from sphinx.environment import BuildEnvironment

#: Names that exist where the code runs but not in every Python the docs build on:
#: ``sys.monitoring`` (Python 3.12+; the docs build may run on 3.11).
ELSEWHERE = frozenset({"sys.monitoring"})
_MISSING = object()


def find(dotted: str) -> object:
    """The object ``dotted`` names (a module, or an attribute of one), else ``_MISSING``."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        except Exception:  # a module that fails to import for another reason
            return _MISSING
        for name in parts[cut:]:
            found = getattr(obj, name, _MISSING)
            if found is _MISSING and inspect.isclass(obj) and _declared(obj, name):
                return Field(obj, name)
            if found is _MISSING:
                return _MISSING
            obj = found
        return obj
    return _MISSING


@dataclass(frozen=True)
class Field:
    """A field a class declares without a class-level value (a dataclass field with no
    default): it exists, though ``getattr`` on the class does not find it."""

    owner: type
    name: str


def _declared(cls: type, name: str) -> bool:
    return any(name in vars(base).get("__annotations__", {}) for base in cls.__mro__)


@functools.cache
def imported_names(module: str) -> dict[str, str]:
    """Each name ``module``'s ``from X import Y [as Z]`` statements bind (those under
    ``if TYPE_CHECKING:`` too), with the dotted name it stands for."""
    mod = find(module)
    try:
        source = inspect.getsource(mod)  # type: ignore[arg-type]
    except (TypeError, OSError):
        return {}
    names: dict[str, str] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


@functools.cache
def defining_modules(module: str) -> tuple[str, ...]:
    """The modules that define the names ``module`` exports (``__all__``): a signature
    documented under a package's name was written in one of them."""
    mod = find(module)
    names = getattr(mod, "__all__", ())
    where = {getattr(getattr(mod, name, None), "__module__", None) for name in names}
    return tuple(sorted(m for m in where if isinstance(m, str) and m != module))


def candidates(target: str, module: str | None, cls: str | None) -> list[str]:
    """The dotted names ``target`` may stand for where it was written, nearest first."""
    target = target.lstrip(".~")
    found: list[str] = []
    if module:
        if cls:
            found.append(f"{module}.{cls}.{target}")
        found.append(f"{module}.{target}")
        head, _, rest = target.partition(".")
        for source in (module, *defining_modules(module)):
            if head in imported_names(source):
                found.append(imported_names(source)[head] + (f".{rest}" if rest else ""))
    found.append(target)
    return found


def canonical(obj: object) -> str | None:
    """The dotted name under which ``obj`` is defined (and documented, if it is)."""
    if inspect.ismodule(obj):
        return obj.__name__
    if isinstance(obj, Field):
        owner = canonical(obj.owner)
        return f"{owner}.{obj.name}" if owner else None
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    return f"{module}.{qualname}" if isinstance(module, str) and qualname else None


def resolve(
    app: Sphinx, env: BuildEnvironment, node: pending_xref, contnode: nodes.TextElement
) -> Any:
    """``missing-reference``: a link to the documented object ``node`` names, or
    ``contnode`` unlinked where it names an object not on these pages, or ``None``."""
    if node.get("refdomain") != "py":
        return None
    target = node["reftarget"]
    domain = env.get_domain("py")
    for name in candidates(target, node.get("py:module"), node.get("py:class")):
        if name in ELSEWHERE:
            return contnode
        obj = find(name)
        if obj is _MISSING:
            continue
        for documented in (name, canonical(obj)):
            if documented and documented in domain.objects:  # type: ignore[attr-defined]
                return domain.resolve_xref(
                    env, node["refdoc"], app.builder, "obj", documented, node, contnode
                )
        return contnode
    return None


def setup(app: Sphinx) -> dict[str, Any]:
    app.connect("missing-reference", resolve)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
