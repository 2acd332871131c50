"""A scan over layers is layers: its body's ops become graph ops, planned like any other.

Big models stack their layers' parameters and scan over them (``jax.lax.scan`` over a
stacked params pytree, flax's ``nnx.scan`` and ``nn.scan``). Kept as one ``loop`` op, such a
scan is one op to a plan: its body cannot be split by heads or features, only along dims
its composed annotation lets through. :func:`expose_loops` replaces it by one iteration of
its body, joined to the graph by four kinds of ops (all marked with the same
:class:`~jscaler.ir.graph.Loop`):

* ``scan_carry`` ``a b -> a b``: a carry's initial value -> the body's carry in;
* ``scan_slice`` ``l^ a b -> a b``: a stacked input -> one iteration's slice; the layer axis
  ``l`` is never split, so a stacked parameter is stored as its slice is read, with its
  layer axis whole (plain JAX's extra leading ``None``);
* ``scan_final`` ``a b -> a b``: the body's carry out -> the scan's final carry;
* ``scan_stack`` ``a b -> l^ a b``: one iteration's output -> the stacked output.

A plan decides the body's ops once for every iteration; lowering keeps the ``scan``, with
the plan's layouts inside its body (:func:`run_loop`), so compile time stays flat in depth.
Only scans that read a stacked parameter are exposed (the layers of a model); other scans
(a recurrence over time, a fixed-count ``while_loop``) stay loop ops.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jscaler.ir.annotation import Annotation
from jscaler.ir.control import scan_layout
from jscaler.ir.graph import LOOP_PRIMITIVES, Graph, Literal, Loop, Op, Remat, Tensor

__all__ = ["expose_loops", "loop_groups", "run_loop", "stack_annotation"]

_VIEWS = ("convert_element_type", "copy", "transpose", "reshape")


def expose_loops(graph: Graph) -> Graph:
    """``graph`` with every top-level scan over stacked parameters exposed (see the module
    docstring); the graph itself when there is none. Ops are renumbered in order."""
    chosen = [o for o in graph.ops if _over_layers(graph, o)]
    if not chosen:
        return graph
    tensors = dict(graph.tensors)
    consts = dict(graph.consts)
    counter = [max(tensors) + 1]
    used = {x for o in graph.ops for x in o.tensor_inputs}
    used |= {x for x in graph.outputs if not isinstance(x, Literal)}
    ops: list[Op] = []
    for op in graph.ops:
        if op in chosen:
            ops.extend(_expose(op, chosen.index(op), tensors, consts, counter, used))
        else:
            ops.append(op)
    ops = [dataclasses.replace(o, id=i) for i, o in enumerate(ops)]
    return Graph(tensors, tuple(ops), graph.inputs, graph.outputs, consts, graph.signature)


def _over_layers(graph: Graph, op: Op) -> bool:
    if op.kind != "loop" or op.primitive != "scan" or op.body is None or op.loop is not None:
        return False
    if any(o.annotation is None for o in op.body.ops):
        return False
    if any(isinstance(x, Literal) for x in op.body.outputs):
        return False
    n_c, n_carry = scan_layout(op.eqn)
    xs = op.inputs[n_c + n_carry :]
    return any(graph.param_behind(x, _VIEWS) is not None for x in xs)


def _expose(op: Op, index: int, tensors: dict, consts: dict, counter: list, used: set) -> list[Op]:
    """The exposed ops of scan ``op`` (``used``: the tensors the graph reads or returns;
    a stacked output outside it is dropped)."""
    body = op.body
    p = op.eqn.params
    n_c, n_carry = scan_layout(op.eqn)
    length = int(p["length"])

    def fresh(bt: int, role: str = "value") -> int:
        src = known[bt]
        tid = counter[0]
        counter[0] += 1
        tensors[tid] = Tensor(tid, src.shape, src.dtype, role, src.name)
        return tid

    ops, extra, extra_consts, aliases = _inlined(body)
    known = {**body.tensors, **extra}
    rename: dict[int, int | Literal] = {}
    for k, t in enumerate(body.inputs[:n_c]):
        rename[t] = op.inputs[k]
    carry_in = [fresh(t) for t in body.inputs[n_c : n_c + n_carry]]
    rename.update(zip(body.inputs[n_c : n_c + n_carry], carry_in))
    x_in = [fresh(t) for t in body.inputs[n_c + n_carry :]]
    rename.update(zip(body.inputs[n_c + n_carry :], x_in))
    for t, v in (*body.consts.items(), *extra_consts.items()):
        rename[t] = fresh(t, "const")
        consts[rename[t]] = v

    def outer(t):
        if isinstance(t, Literal):
            return t
        if t not in rename:
            rename[t] = outer(aliases[t]) if t in aliases else fresh(t)
        return rename[t]

    carry_out = [outer(t) for t in body.outputs[:n_carry]]
    loop = Loop(
        index,
        length,
        bool(p.get("reverse", False)),
        int(p.get("unroll", 1)),
        tuple(zip(carry_in, carry_out)),
    )

    def boundary(prim, x, y, ann) -> Op:
        shapes_in = [tensors[x].shape] if not isinstance(x, Literal) else [()]
        bound = Annotation.parse(ann).bind(shapes_in, [tensors[y].shape])
        return Op(-1, prim, (x,), (y,), op.path, bound, 0.0, "op", loop=loop)

    out: list[Op] = []
    for k, c in enumerate(carry_in):
        rank = len(tensors[c].shape)
        out.append(boundary("scan_carry", op.inputs[n_c + k], c, _same(rank)))
    for j, x in enumerate(x_in):
        rank = len(tensors[x].shape)
        out.append(
            boundary(
                "scan_slice", op.inputs[n_c + n_carry + j], x, stack_annotation(rank, slicing=True)
            )
        )
    for o, remat in ops:
        ins = tuple(outer(x) for x in o.inputs)
        outs = tuple(outer(x) for x in o.outputs)
        out.append(dataclasses.replace(o, inputs=ins, outputs=outs, loop=loop, remat=remat))
    for k in range(n_carry):
        rank = len(tensors[op.outputs[k]].shape)
        out.append(boundary("scan_final", carry_out[k], op.outputs[k], _same(rank)))
    for j in range(len(op.outputs) - n_carry):
        stacked = op.outputs[n_carry + j]
        if stacked not in used:  # nnx.scan's stacked module state, which nothing reads
            continue
        y = outer(body.outputs[n_carry + j])
        rank = len(tensors[stacked].shape) - 1
        out.append(boundary("scan_stack", y, stacked, stack_annotation(rank, slicing=False)))
    return _live(out)


def _live(ops: list[Op]) -> list[Op]:
    """``ops`` less the body ops whose every output nothing reads (what only a dropped
    stacked output needed). Boundary ops stay: a carry's ops are one value each way."""
    keep = list(ops)
    while True:
        read = {x for o in keep for x in o.tensor_inputs}
        dead = [
            o
            for o in keep
            if o.primitive not in LOOP_PRIMITIVES and not any(t in read for t in o.outputs)
        ]
        if not dead:
            return keep
        gone = {id(o) for o in dead}  # ids are the body's own here, not yet unique
        keep = [o for o in keep if id(o) not in gone]


def _inlined(body: Graph) -> tuple[list[tuple[Op, Remat | None]], dict, dict, dict]:
    """The body's ops with each user checkpoint (``remat2``) replaced by its own ops, each
    marked with a :class:`Remat` carrying its policy: the plan sees inside it (a layer's
    heads split under ``nnx.remat``), the lowering checkpoints them again. Returns the ops
    and the tensors and constant values they add (a checkpoint's own values, renumbered
    past the body's), and the call outputs that are one of its inputs passed through (->
    that operand); a checkpoint's inputs and outputs become the call's."""
    out: list[tuple[Op, Remat | None]] = []
    tensors: dict[int, Tensor] = {}
    consts: dict = {}
    aliases: dict = {}  # a checkpoint's output that is one of its inputs -> that input
    top = max(body.tensors, default=0) + 1
    count = 0
    for o in body.ops:
        inner = o.body
        if (
            o.primitive != "remat2"
            or inner is None
            or any(p.primitive == "remat2" or p.annotation is None for p in inner.ops)
            or any(isinstance(t, Literal) for t in inner.outputs)
        ):
            out.append((o, None))
            continue
        p = o.eqn.params
        remat = Remat(count, p.get("policy"), bool(p.get("prevent_cse", True)))
        count += 1
        rename = dict(zip(inner.inputs, o.inputs))
        made = {t for q in inner.ops for t in q.outputs}
        for t, y in zip(inner.outputs, o.outputs):
            if t in made and t not in rename:
                rename[t] = y
            else:  # an input passed through (nnx.remat returns the module's state)
                aliases[y] = rename[t]
        for t, tensor in inner.tensors.items():
            if t not in rename:
                rename[t] = top
                tensors[top] = dataclasses.replace(tensor, id=top)
                if t in inner.consts:
                    consts[top] = inner.consts[t]
                top += 1

        def moved(x, rename=rename):
            return x if isinstance(x, Literal) else rename[x]

        for q in inner.ops:
            ins = tuple(moved(x) for x in q.inputs)
            outs = tuple(moved(x) for x in q.outputs)
            out.append((dataclasses.replace(q, inputs=ins, outputs=outs), remat))
    return out, tensors, consts, aliases


def _names(rank: int) -> str:
    return " ".join(chr(ord("a") + i) for i in range(rank))


def _same(rank: int) -> str:
    dims = _names(rank) or "()"
    return f"{dims} -> {dims}"


def stack_annotation(rank: int, slicing: bool) -> str:
    """The annotation text of a ``scan_slice`` (``slicing``: stack -> one iteration's
    slice) or a ``scan_stack`` (one iteration's output -> the stack) of a rank-``rank``
    slice; the layer axis ``z`` is not split."""
    one = _names(rank) or "()"
    stack = f"z^ {_names(rank)}".strip()
    return f"{stack} -> {one}" if slicing else f"{one} -> {stack}"


# ---- running an exposed scan ------------------------------------------------------------


def loop_groups(ops, inside: Loop | None = None) -> list[tuple[Loop | None, list[Op]]]:
    """``ops`` cut into runs: ``(None, ops)`` for ops outside every exposed scan (or in
    ``inside``, the scan being run), ``(loop, ops)`` for the ops of one exposed scan."""
    out: list[tuple[Loop | None, list[Op]]] = []
    for o in ops:
        loop = None if o.loop is inside else o.loop
        if out and out[-1][0] is loop:
            out[-1][1].append(o)
        else:
            out.append((loop, [o]))
    return out


Relay = Callable[[Op, object], object]


def run_loop(
    ops: list[Op],
    env: dict,
    run_body: Callable[[list[Op], dict], None],
    enter: Relay | None = None,
    carry: Relay | None = None,
    leave: Relay | None = None,
    saved: Callable | None = None,
) -> None:
    """Runs the ops of one exposed scan as a ``jax.lax.scan`` on ``env`` (tensor -> value),
    adding its results. ``run_body(body_ops, local_env)`` runs one iteration's body ops.
    The lowering's layouts come in through three hooks (identity when None):
    ``enter(op, value)`` re-lays a ``scan_carry``'s or ``scan_slice``'s input before the
    loop, ``carry(op, value)`` the carry a ``scan_carry`` starts as each iteration leaves
    it, ``leave(op, value)`` a ``scan_final``'s or ``scan_stack``'s result after the loop.
    ``saved``: a ``jax.checkpoint`` policy for the body (None: the backward keeps every
    residual of every iteration)."""
    loop = ops[0].loop
    by = {prim: [o for o in ops if o.primitive == prim] for prim in LOOP_PRIMITIVES}
    body = [o for o in ops if o.primitive not in LOOP_PRIMITIVES]
    same = lambda o, v: v  # noqa: E731
    enter, carry, leave = enter or same, carry or same, leave or same

    def read(local, x):
        if isinstance(x, Literal):
            return jnp.asarray(x.value, dtype=x.dtype or None)
        return local[x]

    init = [enter(o, read(env, o.inputs[0])) for o in by["scan_carry"]]
    xs = [enter(o, env[o.inputs[0]]) for o in by["scan_slice"]]

    def step(values, x):
        local = dict(env)
        local.update((o.outputs[0], v) for o, v in zip(by["scan_carry"], values))
        local.update((o.outputs[0], v) for o, v in zip(by["scan_slice"], x))
        run_body(body, local)
        new = [
            carry(c, read(local, f.inputs[0])) for c, f in zip(by["scan_carry"], by["scan_final"])
        ]
        return new, [read(local, o.inputs[0]) for o in by["scan_stack"]]

    if saved is not None:
        step = jax.checkpoint(step, policy=saved, prevent_cse=False)
    final, ys = jax.lax.scan(
        step, init, xs, length=loop.length, reverse=loop.reverse, unroll=loop.unroll
    )
    for o, v in zip(by["scan_final"], final):
        env[o.outputs[0]] = leave(o, v)
    for o, v in zip(by["scan_stack"], ys):
        env[o.outputs[0]] = leave(o, v)
