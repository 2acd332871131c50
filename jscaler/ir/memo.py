"""Memoized: derived values kept with the immutable object they were derived from.

Graphs, plans and lowerings are frozen; what a module derives from one alone (a graph's
fingerprint, a plan's pieces, a lowering's collectives) is computed once and kept with
it, so it is dropped with it. ``memo(key, make)`` is the one way to do so: keys start
with the function deriving the value, so modules never collide or read each other's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["Memoized"]


class Memoized:
    """Mixin for frozen dataclasses: :meth:`memo`."""

    def memo(self, key, make: Callable[[], Any]) -> Any:
        """``make()``, once per object and hashable ``key``; callers share the value and
        must not change it."""
        cache = self.__dict__.get("_memo")
        if cache is None:
            cache = {}
            object.__setattr__(self, "_memo", cache)
        if key not in cache:
            cache[key] = make()
        return cache[key]
