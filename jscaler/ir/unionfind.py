"""A small union-find over hashable, ordered keys; the smaller key stays the root, so
class keys are stable whatever order the unions come in."""

from __future__ import annotations

__all__ = ["UnionFind"]


class UnionFind:
    def __init__(self):
        self.parent: dict = {}

    def find(self, x):
        self.parent.setdefault(x, x)
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a, b):
        """Joins the classes of a and b; returns (kept root, absorbed root)."""
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return ra, rb
        keep, gone = min(ra, rb), max(ra, rb)
        self.parent[gone] = keep
        return keep, gone
