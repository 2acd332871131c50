"""Cutting an exposed scan into consecutive scans, the chunks a pipeline's stages hold.

A pipeline cuts a model's layers into stages; layers stacked under one scan are cut along
the layer axis: :func:`chunk_loops` rewrites each exposed scan (:mod:`jscaler.ir.expose`)
of length L into ``parts`` scans of about L / parts iterations each. Chunk i reads rows
``[a_i, b_i)`` of every stacked input (a ``slice`` of the stack), starts from the carry
chunk i - 1 ends with, and writes its rows of every stacked output (``concatenate``d
after the last chunk). Each chunk's ops take the path ``<scan path>/<i>/...``, so the
chunks are the graph's repeated layers (:meth:`Graph.layers`) that stage slicing deals out;
each still runs as one ``jax.lax.scan`` over its share, so compile time stays flat in
depth. The rewritten graph computes the same function (the chunks run the same body in
the same order).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jscaler.ir.annotation import Annotation
from jscaler.ir.build import Builder
from jscaler.ir.expose import stack_annotation
from jscaler.ir.graph import LOOP_PRIMITIVES, Graph, Literal, Loop, Op

__all__ = ["chunk_loops"]


def chunk_loops(graph: Graph, pp: int) -> Graph:
    """``graph`` with every exposed scan cut for a ``pp``-group pipeline (see the module
    doc): into ``2 pp`` consecutive scans where every scan has that many iterations (an
    interleaved schedule's two stages per group; one-stage-per-group schedules run both
    chunks of a group in one stage), else into ``pp`` where every scan has ``pp``; the
    graph itself otherwise or when ``pp < 2``. A reversed scan is left whole."""
    lengths = [o.loop.length for o in graph.ops if o.loop is not None]
    if pp < 2 or not lengths or min(lengths) < pp:
        return graph
    parts = 2 * pp if min(lengths) >= 2 * pp else pp
    regions: dict[Loop, list[Op]] = {}
    for o in graph.ops:
        if o.loop is not None:
            regions.setdefault(o.loop, []).append(o)
    todo = {loop: ops for loop, ops in regions.items() if not loop.reverse}
    if not todo:
        return graph
    b = Builder(strict=False, first_id=max(graph.tensors) + 1)
    tensors = dict(graph.tensors)
    next_index = [max(loop.index for loop in regions) + 1]
    out: list[Op] = []
    done: set[Loop] = set()
    for o in graph.ops:
        if o.loop is None or o.loop not in todo:
            out.append(o)
        elif o.loop not in done:
            done.add(o.loop)
            out.extend(_chunked(graph, todo[o.loop], parts, b, tensors, next_index))
    tensors.update(b.tensors)
    ops = tuple(dataclasses.replace(o, id=i) for i, o in enumerate(out))
    return Graph(tensors, ops, graph.inputs, graph.outputs, graph.consts, graph.signature)


def _chunked(graph: Graph, region: list[Op], parts: int, b: Builder, tensors, counter) -> list:
    loop = region[0].loop
    carries = [o for o in region if o.primitive == "scan_carry"]
    slices = [o for o in region if o.primitive == "scan_slice"]
    finals = [o for o in region if o.primitive == "scan_final"]
    stacks = [o for o in region if o.primitive == "scan_stack"]
    body = [o for o in region if o.primitive not in LOOP_PRIMITIVES]
    base = region[0].path or "scan"
    inner = {t for o in region for t in o.outputs} - {
        t for o in (*finals, *stacks) for t in o.outputs
    }
    sizes = [loop.length // parts + (1 if i < loop.length % parts else 0) for i in range(parts)]
    out: list[Op] = []
    carried = [c.inputs[0] for c in carries]  # what chunk i's carries start from
    pieces: list[list[int]] = [[] for _ in stacks]
    start = 0
    for i, n in enumerate(sizes):
        path = f"{base}/{i}"
        rename: dict[int, int] = {}

        def fresh(t: int, rename=rename) -> int:
            if t not in rename:
                src = tensors[t]
                tid = b.new_tensor(jax.ShapeDtypeStruct(src.shape, src.dtype), src.role, src.name)
                rename[t] = tid
            return rename[t]

        def moved(x, rename=rename):
            return rename.get(x, x) if not isinstance(x, Literal) else x

        for t in inner:
            fresh(t)
        made = len(b.ops)
        rows = [
            b.emit(lambda x, a=start, z=start + n: jax.lax.slice_in_dim(x, a, z, axis=0),
                   [s.inputs[0]], path, graph)[0]
            for s in slices
        ]  # fmt: skip
        # the rows of a stack a chunk reads: a slice, named as the view it is (a stacked
        # parameter's chunk is still that parameter to the spaces, Graph.param_behind)
        out.extend(
            dataclasses.replace(o, path=path, primitive="scan_chunk") if o.primitive == "slice"
            else dataclasses.replace(o, path=path)
            for o in b.ops[made:]
        )  # fmt: skip
        chunk = Loop(
            counter[0],
            n,
            loop.reverse,
            loop.unroll,
            tuple((rename.get(a, a), moved(z)) for a, z in loop.carries),
        )
        counter[0] += 1
        last = i == len(sizes) - 1
        ends = []
        for c, init in zip(carries, carried):
            out.append(_moved(c, (init,), (rename[c.outputs[0]],), path, base, chunk))
        for s, x in zip(slices, rows):
            one = tensors[s.outputs[0]].shape
            ann = Annotation.parse(stack_annotation(len(one), slicing=True))
            moved_slice = _moved(s, (x,), (rename[s.outputs[0]],), path, base, chunk)
            out.append(dataclasses.replace(moved_slice, annotation=ann.bind([(n, *one)], [one])))
        for o in body:
            ins = tuple(moved(x) for x in o.inputs)
            out.append(_moved(o, ins, tuple(rename[t] for t in o.outputs), path, base, chunk))
        for f in finals:
            end = f.outputs[0]
            if not last:
                src = tensors[end]
                end = b.new_tensor(jax.ShapeDtypeStruct(src.shape, src.dtype))
            ends.append(end)
            out.append(_moved(f, (moved(f.inputs[0]),), (end,), path, base, chunk))
        for k, s in enumerate(stacks):
            whole = tensors[s.outputs[0]]
            y = b.new_tensor(jax.ShapeDtypeStruct((n, *whole.shape[1:]), whole.dtype))
            pieces[k].append(y)
            rank = len(whole.shape) - 1
            ann = Annotation.parse(stack_annotation(rank, slicing=False)).bind(
                [whole.shape[1:]], [(n, *whole.shape[1:])]
            )
            out.append(
                dataclasses.replace(
                    _moved(s, (moved(s.inputs[0]),), (y,), path, base, chunk), annotation=ann
                )
            )
        carried = ends
        start += n
    for s, ys in zip(stacks, pieces):
        made = len(b.ops)
        (joined,) = b.emit(lambda *xs: jnp.concatenate(xs, axis=0), ys, base, graph)
        b.rename_outputs(made, {joined: s.outputs[0]})
        out.extend(b.ops[made:])
    return out


def _moved(o: Op, ins, outs, path: str, base: str, loop: Loop) -> Op:
    """``o`` reading ``ins`` and writing ``outs`` in chunk ``loop``, under ``path`` (its
    own path below the scan's ``base`` kept after it)."""
    rest = o.path[len(base) :].lstrip("/") if o.path.startswith(base) else o.path
    return dataclasses.replace(
        o, inputs=ins, outputs=outs, path=f"{path}/{rest}" if rest else path, loop=loop
    )
