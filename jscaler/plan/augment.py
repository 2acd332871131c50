"""The graph a plan transforms: the traced forward graph plus the ops a training step adds.

Besides the forward ops, a plan places:

* one ``grad`` op per parameter: where its gradient is reduced to and accumulated (ZeRO-2
  splits it, so gradients are reduce-scattered);
* one ``update`` op per parameter: the optimizer update, whose layout is the optimizer
  state's (ZeRO-1 splits it);
* ``identity`` ops the plan inserts to decouple a tensor's layout from its consumers'
  (ZeRO-3 stores parameters split and all-gathers them for use).

Their ids follow the forward ops' in a fixed order, so a plan's JSON names them stably.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

from jscaler.ir.annotation import Annotation
from jscaler.ir.graph import Graph, Literal, Op, Tensor

__all__ = ["PlanGraph", "augment", "elementwise_annotation"]


def elementwise_annotation(rank: int, n_inputs: int) -> Annotation:
    dims = " ".join(chr(ord("a") + i) for i in range(rank)) or "()"
    return Annotation.parse(", ".join([dims] * n_inputs) + " -> " + dims)


@dataclass(frozen=True, eq=False)
class PlanGraph:
    """The forward graph (with identity ops spliced in) and the per-parameter ops."""

    graph: Graph
    grad_ops: tuple[Op, ...]
    update_ops: tuple[Op, ...]
    identity_of: dict[int, int] = field(default_factory=dict)  # tensor id -> identity op id
    _by_id: dict[int, Op] = field(default_factory=dict)

    def __post_init__(self):
        ops = {o.id: o for o in (*self.graph.ops, *self.grad_ops, *self.update_ops)}
        object.__setattr__(self, "_by_id", ops)

    def op(self, op_id: int) -> Op:
        try:
            return self._by_id[op_id]
        except KeyError:
            raise KeyError(f"no op with id {op_id} in this plan's graph") from None

    @property
    def all_ops(self) -> tuple[Op, ...]:
        return (*self.graph.ops, *self.grad_ops, *self.update_ops)

    def has(self, op_id: int) -> bool:
        return op_id in self._by_id


@functools.lru_cache(maxsize=4096)
def _bound(rank_shape: tuple[int, ...], n_inputs: int) -> Annotation:
    """The elementwise annotation bound to one shape (annotations are immutable: the
    same object serves every parameter of that shape, in every plan graph)."""
    ann = elementwise_annotation(len(rank_shape), n_inputs)
    return ann.bind([rank_shape] * n_inputs, [rank_shape])


def augment(base: Graph, identities: tuple[int, ...]) -> PlanGraph:
    """Builds the plan graph: per-parameter grad/update ops, then the identity ops."""
    next_op = max((o.id for o in base.ops), default=-1) + 1
    next_tensor = max(base.tensors, default=-1) + 1
    tensors = dict(base.tensors)
    grad_ops, update_ops = [], []
    for p in base.params():
        g = Tensor(next_tensor, p.shape, p.dtype, "grad", f"grad/{p.name}")
        u = Tensor(next_tensor + 1, p.shape, p.dtype, "value", f"update/{p.name}")
        tensors[g.id], tensors[u.id] = g, u
        next_tensor += 2
        grad_ops.append(
            Op(next_op, "grad", (p.id,), (g.id,), f"grad/{p.name}", _bound(p.shape, 1), 0.0, "grad")
        )
        update_ops.append(
            Op(
                next_op + 1,
                "update",
                (p.id, g.id),
                (u.id,),
                f"update/{p.name}",
                _bound(p.shape, 2),
                2.0 * p.size,
                "update",
            )
        )
        next_op += 2
    ops = list(base.ops)
    outputs = list(base.outputs)
    identity_of = {}
    users: dict[int, list[int]] = {}  # tensor -> positions of the base ops reading it
    for i, o in enumerate(ops):
        for x in dict.fromkeys(o.tensor_inputs):
            users.setdefault(x, []).append(i)
    before: dict[int, list[Op]] = {}  # base position -> identities inserted before it
    tail: list[Op] = []
    for t in identities:
        src = tensors[t]
        new = Tensor(next_tensor, src.shape, src.dtype, "value", src.name)
        tensors[new.id] = new
        next_tensor += 1
        consumers = users.get(t, [])
        producer = next((o for o in ops if t in o.outputs), None) if not consumers else None
        # named after its first consumer: a stored parameter is gathered for that module
        path = ops[consumers[0]].path if consumers else producer.path if producer else ""
        loop = None
        if consumers:
            made = next((o for o in ops if t in o.outputs), None)
            at, loop = _placement(ops, consumers[0], made is not None and made.loop is not None)
        elif producer is not None:
            loop = producer.loop
        ident = Op(
            next_op,
            "identity",
            (t,),
            (new.id,),
            path,
            _bound(src.shape, 1),
            0.0,
            "identity",
            loop=loop,
        )
        identity_of[t] = next_op
        next_op += 1
        for i in consumers:
            ops[i] = _rewire(ops[i], t, new.id)
        if consumers:
            before.setdefault(at, []).append(ident)
        else:
            tail.append(ident)
        outputs = [new.id if (not isinstance(x, Literal) and x == t) else x for x in outputs]
    ops = [x for i, o in enumerate(ops) for x in (*before.get(i, ()), o)] + tail
    graph = Graph(tensors, tuple(ops), base.inputs, tuple(outputs), base.consts, base.signature)
    return PlanGraph(graph, tuple(grad_ops), tuple(update_ops), identity_of)


def _rewire(o: Op, old: int, new: int) -> Op:
    inputs = tuple(new if (not isinstance(x, Literal) and x == old) else x for x in o.inputs)
    return dataclasses.replace(o, inputs=inputs)


def _placement(ops: list[Op], first: int, made_inside: bool) -> tuple[int, object]:
    """(position before which an identity for a tensor first read by ``ops[first]`` goes,
    the Loop it runs in): next to that consumer, unless the consumer runs in an exposed
    scan and the tensor comes from outside it (a stacked parameter): then before the whole
    scan, outside it."""
    loop = ops[first].loop
    if loop is None or made_inside:
        return first, loop
    while first > 0 and ops[first - 1].loop is loop:
        first -= 1
    return first, None
