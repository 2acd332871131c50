"""Readable views of a Graph: the op table ``jscaler inspect`` prints, and a JSON form."""

from __future__ import annotations

from jscaler.ir.graph import LOOP_PRIMITIVES, Graph, Literal, Op

__all__ = ["graph_summary", "graph_table", "op_record"]


def _shape(graph: Graph, x) -> str:
    if isinstance(x, Literal):
        return "lit"
    t = graph.tensors[x]
    return f"{t.dtype}[{','.join(map(str, t.shape))}]"


def _flops(x: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if x >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


def op_record(graph: Graph, op: Op) -> dict:
    """One op as a JSON-able dict."""
    return {
        "id": op.id,
        "path": op.path,
        "primitive": op.primitive,
        "kind": op.kind,
        "annotation": None if op.annotation is None else str(op.annotation),
        "inputs": [_shape(graph, x) for x in op.inputs],
        "outputs": [_shape(graph, x) for x in op.outputs],
        "flops": op.flops,
        "runs": op.repeats,  # an exposed scan's body op: once per iteration
    }


def graph_table(graph: Graph, *, width: int = 60) -> str:
    """The graph as a table: id, module path, primitive, annotation, shapes, FLOPs (of one
    run; an op in a scan's body is marked ``xL`` after its primitive, ``L`` runs a step)."""
    rows = [("id", "module path", "primitive", "annotation", "shapes", "flops")]
    for op in graph.ops:
        ann = "UNANNOTATED" if op.annotation is None else str(op.annotation)
        shapes = ", ".join(_shape(graph, x) for x in op.inputs)
        shapes += " -> " + ", ".join(_shape(graph, x) for x in op.outputs)
        rows.append(
            (
                str(op.id),
                op.path or "<root>",
                op.primitive + (f" x{op.repeats}" if op.loop is not None else ""),
                _clip(ann, width),
                shapes,
                _flops(op.flops),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = []
    for k, r in enumerate(rows):
        cells = [r[i].ljust(widths[i]) if i else r[i].rjust(widths[i]) for i in range(5)]
        lines.append("  ".join(cells) + "  " + r[5].rjust(7))
        if k == 0:
            lines.append("-" * len(lines[0]))
    return "\n".join(lines)


def _clip(s: str, n: int) -> str:
    return s if len(s) <= n else s[: n - 3] + "..."


def graph_summary(graph: Graph) -> str:
    """Counts, coverage and repeated layers, one fact a line."""
    cov = graph.coverage()
    params = graph.params()
    n_params = sum(t.size for t in params)
    layers = graph.layers()
    lines = [
        f"ops: {len(graph.ops)}   forward FLOPs: {_flops(graph.flops)}   "
        f"params: {n_params:,} in {len(params)} tensors",
        f"coverage: {cov.ops:.1%} of ops, {cov.flops:.1%} of FLOPs annotated",
    ]
    if layers:
        names = ", ".join(layer.name for layer in layers[:4])
        more = f", ... ({len(layers)} in all)" if len(layers) > 4 else ""
        lines.append(f"repeated layers: {names}{more}")
    loops: dict = {}
    for o in graph.ops:
        if o.loop is not None:
            loops.setdefault(o.loop, []).append(o)
    for loop, ops in loops.items():
        body = [o for o in ops if o.primitive not in LOOP_PRIMITIVES]
        paths = sorted({o.path for o in body if o.path})
        where = f" ({', '.join(paths[:3])}{', ...' if len(paths) > 3 else ''})" if paths else ""
        lines.append(
            f"scan {loop.index}: {loop.length} iterations of {len(body)} body ops{where}, "
            f"planned as one layer"
        )
    missing = graph.unannotated()
    if missing:
        lines.append("unannotated primitives: " + ", ".join(sorted({o.primitive for o in missing})))
    return "\n".join(lines)
