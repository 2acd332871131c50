"""Finding a cycle in a dependency graph, for errors that name it.

Used by :func:`jscaler.validate` (sub-ops: data edges and op_order constraints) and by
:func:`jscaler.order_schedule` (blocks: data dependencies and order constraints).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

__all__ = ["find_cycle"]


def find_cycle(succ: dict, key: Callable[[Hashable], object]) -> list | None:
    """A cycle of ``succ`` (node -> successors; every node a key) in edge order, first
    node repeated at the end, or None when the graph is acyclic. Kahn's algorithm peels
    off what can run; every stuck node has a stuck predecessor, so walking predecessors
    (lowest ``key`` first, for a deterministic answer) closes a cycle."""
    indeg = {s: 0 for s in succ}
    for s in succ:
        for t in succ[s]:
            indeg[t] += 1
    ready = [s for s, d in indeg.items() if d == 0]
    seen = 0
    while ready:
        s = ready.pop()
        seen += 1
        for t in succ[s]:
            indeg[t] -= 1
            if indeg[t] == 0:
                ready.append(t)
    if seen == len(succ):
        return None
    stuck = {s for s, d in indeg.items() if d > 0}
    pred: dict = {s: [] for s in stuck}
    for s in stuck:
        for t in succ[s]:
            if t in stuck:
                pred[t].append(s)
    node = min(stuck, key=key)
    path, index = [node], {node: 0}
    while True:
        node = min(pred[node], key=key)
        if node in index:
            return (path[index[node] :] + [node])[::-1]
        index[node] = len(path)
        path.append(node)
