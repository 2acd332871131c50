"""``unroll(graph, op)``: a scan becomes one copy of its body per iteration.

The scan is re-traced as a Python loop over its body (each iteration under the name
``<i>``), so unrolled ops carry paths like ``layers/3/attn/...`` and ``Graph.layers()``
sees one layer per iteration.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
from jax._src import source_info_util

from jscaler.errors import TraceError
from jscaler.ir.build import Builder
from jscaler.ir.control import scan_layout
from jscaler.ir.graph import Graph, Literal, Op

__all__ = ["unroll"]


def unroll(graph: Graph, op: Op | int) -> Graph:
    """Expands the ``loop`` op ``op`` (an Op of ``graph`` or its id; a scan) into one copy of
    its body per iteration, returning the new graph."""
    op = op if isinstance(op, Op) else graph.op(op)
    if op.kind != "loop":
        raise TraceError(f"unroll() expands loop ops (scans); {op.where} is a {op.kind!r} op")
    p = op.eqn.params
    body = jcore.jaxpr_as_fun(p["jaxpr"])
    n_c, n_carry = scan_layout(op.eqn)
    length = p["length"]

    def unrolled(*args):
        consts, carry, xs = args[:n_c], args[n_c : n_c + n_carry], args[n_c + n_carry :]
        ys = []
        steps = range(length - 1, -1, -1) if p["reverse"] else range(length)
        for i in steps:
            with source_info_util.extend_name_stack(f"{_MARK}{i}"):
                out = body(*consts, *carry, *(x[i] for x in xs))
            carry, y = out[:n_carry], out[n_carry:]
            ys.append(y)
        if p["reverse"]:
            ys.reverse()
        stacked = [jnp.stack([y[k] for y in ys]) for k in range(len(op.outputs) - n_carry)]
        return (*carry, *stacked)

    avals = [
        jax.ShapeDtypeStruct(graph.tensors[i].shape, graph.tensors[i].dtype)
        if not isinstance(i, Literal)
        else jnp.asarray(i.value)
        for i in op.inputs
    ]
    closed = jax.make_jaxpr(unrolled)(*avals)
    strict = all(o.annotation is not None for o in graph.ops)
    b = Builder(strict=strict, first_id=max(graph.tensors) + 1)
    b.tensors.update(graph.tensors)
    b.consts.update(graph.consts)
    before = [o for o in graph.ops if o.id < op.id]
    after = [o for o in graph.ops if o.id > op.id]
    b.ops = list(before)
    outs = b.convert(closed.jaxpr, closed.consts, list(op.inputs), op.path)
    base = _common_path([o.path for o in op.body.ops], op.path)
    b.ops = [o if o.id < op.id else _with_path(o, _iteration_path(o.path, base)) for o in b.ops]
    rename = {}
    for old, new in zip(op.outputs, outs):
        rename[old] = new
    del_ids = set(op.outputs)
    for t in del_ids:
        b.tensors.pop(t, None)
    next_id = (b.ops[-1].id + 1) if b.ops else 0
    for o in after:
        new_inputs = tuple(rename.get(i, i) if not isinstance(i, Literal) else i for i in o.inputs)
        b.ops.append(_renumber(o, next_id, new_inputs))
        next_id += 1
    outputs = tuple(rename.get(i, i) if not isinstance(i, Literal) else i for i in graph.outputs)
    return Graph(b.tensors, tuple(b.ops), graph.inputs, outputs, b.consts, graph.signature)


_MARK = "__iteration"


def _common_path(paths, outer: str) -> str:
    """The longest module path shared by every body op, if it lies within ``outer``."""
    split = [p.split("/") for p in paths if p]
    if not split:
        return outer
    common = []
    for parts in zip(*split):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    path = "/".join(common)
    return path if path == outer or path.startswith(outer + "/") or not outer else outer


def _iteration_path(path: str, base: str) -> str:
    """``M/__iteration2/layers/Dense_0`` -> ``M/layers/2/Dense_0`` when base is M/layers."""
    parts = path.split("/")
    mark = next((p for p in parts if p.startswith(_MARK)), None)
    if mark is None:
        return path
    i = mark[len(_MARK) :]
    rest = "/".join(p for p in parts if p != mark)
    if rest == base or rest.startswith(base + "/"):
        return "/".join(filter(None, [base, i, rest[len(base) + 1 :]]))
    return "/".join(filter(None, [base, i]))


def _with_path(o: Op, path: str) -> Op:
    return dataclasses.replace(o, path=path)


def _renumber(o: Op, new_id: int, inputs) -> Op:
    return dataclasses.replace(o, id=new_id, inputs=inputs)
