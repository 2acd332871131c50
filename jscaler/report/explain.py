"""``explain(plan)``: a readable table of what a plan does to each module's ops."""

from __future__ import annotations

from jscaler.plan.plan import Node, Plan

__all__ = ["describe_tree", "explain"]


def describe_tree(op, tree: Node) -> str:
    """``split b/2 > split c/4`` style summary of one op's tree (first branch per level);
    a split whose pieces all stay on one device reads ``coshard``."""
    parts = []
    node = tree
    while node.algo != "leaf":
        n = len(node.children)
        if node.algo == "split":
            kind = op.annotation.kinds.get(node.dim, "") if op.annotation else ""
            label = "partial" if kind == "+" else "split"
            devices = {leaf.device for _, leaf in node.leaves()}
            if len(devices) == 1 and None not in devices:
                label = "coshard"  # colocated pieces, one after another on one device
            size = op.annotation.sizes.get(node.dim, "?") if op.annotation else "?"
            parts.append(f"{label} {node.dim}({size})/{n}")
        else:
            parts.append(f"replicate x{n}")
        node = node.children[0]
    return " > ".join(parts) or "whole"


def _devices(devs) -> str:
    devs = sorted(set(d for d in devs if d is not None))
    if not devs:
        return "-"
    if devs == list(range(devs[0], devs[-1] + 1)) and len(devs) > 2:
        return f"{devs[0]}-{devs[-1]}"
    return ",".join(map(str, devs))


def explain(plan: Plan, *, per_op: bool = False) -> str:
    """A readable table of ``plan``: module path, op, algorithm, pieces, devices,
    recompute; one row per (module path, primitive, transformation), or with ``per_op`` one
    per op."""
    pg = plan.pgraph
    rows = []
    for op in pg.all_ops:
        if op.kind in ("grad", "update") and op.id not in plan.trees:
            continue
        tree = plan.tree(op.id)
        what = describe_tree(op, tree)
        region = plan.region_of(op.id)
        notes = [region.kind if region else "", "recompute" if plan.is_recomputed(op.id) else ""]
        recompute = " ".join(n for n in notes if n)
        n = sum(1 for _ in tree.leaves())
        key = (op.path or "<root>", op.primitive, what, recompute)
        if per_op or not rows or rows[-1][0] != key:
            rows.append([key, 1, n, set(plan.devices_of(op.id)), op.id])
        else:
            rows[-1][1] += 1
            rows[-1][3] |= set(plan.devices_of(op.id))
    header = ("module path", "op", "ops", "algorithm", "pieces", "devices", "")
    table = [header]
    for (path, prim, what, rc), count, n, devs, op_id in rows:
        name = f"{prim}#{op_id}" if per_op else prim
        table.append((path, name, str(count), what, str(n), _devices(devs), rc))
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines = [f"plan {plan.name or '(unnamed)'} on mesh {plan.mesh}: {len(pg.all_ops)} ops"]
    for k, r in enumerate(table):
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if k == 0:
            lines.append("-" * len(lines[-1]))
    return "\n".join(lines)
