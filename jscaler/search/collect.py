"""Fewer garbage collections while a search runs.

A search builds and drops millions of small objects (plans, layouts, masks) beside the
traced graphs, which live throughout. CPython's cyclic collector scans every tracked
object on each full collection, so with the graphs alive most of those scans find
nothing: Swin's search at 16 GPUs spent about a fifth of its time in them. Inside
:func:`fewer_collections` the collector runs about a hundred times less often; it still
runs, so memory held by reference cycles stays bounded.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["fewer_collections"]

# young-generation allocations between collections (CPython's default 2000), and how many
# young and middle collections pass before the next older one (its 10 and 10)
THRESHOLDS = (50_000, 20, 10)


@contextmanager
def fewer_collections() -> Iterator[None]:
    """Within it, the collector's thresholds are :data:`THRESHOLDS` (when higher than
    the process's own); the process's own are restored after."""
    old = gc.get_threshold()
    gc.set_threshold(*(max(a, b) for a, b in zip(old, THRESHOLDS)))
    try:
        yield
    finally:
        gc.set_threshold(*old)
