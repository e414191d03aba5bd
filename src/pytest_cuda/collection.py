"""What a collection holds, worked out once for every pytest_cuda module: the names of
the markers its tests carry anywhere (on the test, its class, its module).

A leaf module: the entry point and the modules it loads import it, never each other
for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from _pytest.nodes import Node

__all__ = ["marker_names"]

_MARKER_NAMES = pytest.StashKey[tuple[list[pytest.Item], int, frozenset[str]]]()


def marker_names(config: pytest.Config, items: list[pytest.Item]) -> frozenset[str]:
    """The names of the markers on ``items`` and on their parents (module, class...).

    The same markers ``item.get_closest_marker`` finds, with one look at each node
    instead of a walk up the tree per test and name: collection hooks use it to do
    nothing per test when no test carries their marker. Worked out once per list of
    items: the other pytest_cuda modules' collection hooks run right after this
    module's, on the same list.
    """
    cached = config.stash.get(_MARKER_NAMES, None)
    if cached is not None and cached[0] is items and cached[1] == len(items):
        return cached[2]
    names: set[str] = set()
    seen: set[int] = set()
    for item in items:
        node: Node | None = item
        while node is not None and id(node) not in seen:
            seen.add(id(node))
            for mark in node.own_markers:
                name = getattr(mark, "name", None)
                if isinstance(name, str):
                    names.add(name)
            node = node.parent
    found = frozenset(names)
    config.stash[_MARKER_NAMES] = (items, len(items), found)
    return found
