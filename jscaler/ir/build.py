"""Converts a jaxpr into Graph ops: inlines nested jits, keeps custom-derivative and remat
calls whole, keeps scans as loop ops, and annotates and counts every op."""

from __future__ import annotations

import dataclasses
import re
import warnings

import jax
import jax.extend.core as jcore

from jscaler.errors import AnnotationError, UnsupportedOpError
from jscaler.ir.control import COMPOSITES, INLINE, composite, numeric_jvp
from jscaler.ir.flops import op_flops
from jscaler.ir.graph import Graph, Literal, Op, Tensor
from jscaler.ir.loops import static_trip_count, while_as_scan
from jscaler.ir.refusals import REFUSED
from jscaler.ir.registry import annotate_eqn
from jscaler.ir.rules_elementwise import PLACEMENT

__all__ = ["Builder", "graph_of", "join_path"]


_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")
# a qualified class name (equinox's ``eqx.nn.Linear`` scopes): the module, not its path
_CLASS = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*\.[A-Z][A-Za-z0-9_]*$")


def join_path(prefix: str, inner: str) -> str:
    """Joins a call site's module path with a path recorded inside its body.

    nnx paths are recorded whole (``blocks/0/mlp``), linen paths relative to the call.
    Scope names that are not module names (``jnp.einsum`` records its subscripts, Haiku
    its ``~`` separators, equinox the class ``eqx.nn.Linear``) are dropped.
    """
    inner = "/".join(p for p in inner.split("/") if _NAME.match(p) and not _CLASS.match(p))
    if not inner:
        return prefix
    if not prefix or inner == prefix or inner.startswith(prefix + "/"):
        return inner
    return prefix + "/" + inner


def _dtype(aval) -> str:
    return str(getattr(aval, "dtype", "token"))


class Builder:
    """Accumulates tensors and ops while walking jaxprs."""

    def __init__(self, *, strict: bool, first_id: int = 0):
        self.strict = strict
        self.tensors: dict[int, Tensor] = {}
        self.ops: list[Op] = []
        self.consts: dict[int, object] = {}
        self._next = first_id

    def new_tensor(self, aval, role: str = "value", name: str = "") -> int:
        tid = self._next
        self._next += 1
        self.tensors[tid] = Tensor(tid, tuple(getattr(aval, "shape", ())), _dtype(aval), role, name)
        return tid

    def _new_op_id(self) -> int:
        return len(self.ops) and self.ops[-1].id + 1

    def graph(self, inputs, outputs, signature=None) -> Graph:
        return Graph(
            dict(self.tensors),
            tuple(self.ops),
            tuple(inputs),
            tuple(outputs),
            self.consts,
            signature,
        )

    def splice(self, graph: Graph, replace: dict[int, list[Op]], dropped: set[int]) -> Graph:
        """``graph`` rewritten: op ``k`` of ``replace`` becomes the ops built here for it
        (which write its outputs, or those of other ``dropped`` ops), the other ``dropped``
        ops go with the tensors only they wrote; ops are renumbered in order."""
        written = {t for rs in replace.values() for r in rs for t in r.outputs}
        gone = {
            t
            for o in graph.ops
            if o.id in dropped and o.id not in replace
            for t in o.outputs
            if t not in written
        }
        ops = []
        for op in graph.ops:
            if op.id in replace:  # the replacements run where the op ran (in its scan)
                ops.extend(
                    dataclasses.replace(r, loop=op.loop, remat=op.remat) for r in replace[op.id]
                )
            elif op.id not in dropped:
                ops.append(op)
        ops = [dataclasses.replace(o, id=i) for i, o in enumerate(ops)]
        tensors = {t: v for t, v in graph.tensors.items() if t not in gone}
        used = {t for o in ops for t in (*o.tensor_inputs, *o.outputs)}
        tensors.update({t: v for t, v in self.tensors.items() if t in used})
        g = graph
        return Graph(tensors, tuple(ops), g.inputs, g.outputs, g.consts, g.signature)

    def emit(self, fn, ins: list, path: str, graph: Graph | None = None) -> list:
        """Traces ``fn`` on tensors ``ins`` (built here, else ``graph``'s) and adds its ops,
        under ``path``: a rewrite's replacement for ops of ``graph``."""

        def aval(t):
            x = self.tensors.get(t) or graph.tensors[t]
            return jax.ShapeDtypeStruct(x.shape, x.dtype)

        closed = jax.make_jaxpr(fn)(*(aval(t) for t in ins))
        return self.convert(closed.jaxpr, closed.consts, list(ins), path)

    def rename_outputs(self, start: int, rename: dict[int, int]) -> None:
        """Ops from ``start`` on write ``rename[t]`` where they wrote ``t``."""
        for k in range(start, len(self.ops)):
            o = self.ops[k]
            self.ops[k] = dataclasses.replace(o, outputs=tuple(rename.get(x, x) for x in o.outputs))

    def convert(self, jaxpr, consts, in_ids, prefix: str = "", stop_max: bool = False) -> list:
        """Adds the ops of ``jaxpr`` fed by ``in_ids``; returns its output ids/literals.
        ``stop_max``: every ``reduce_max`` is followed by a ``stop_gradient``."""
        env: dict = {}

        def read(v):
            if isinstance(v, jcore.Literal):
                return Literal(v.val, _dtype(v.aval))
            return env[v]

        for v, c in zip(jaxpr.constvars, consts):
            env[v] = tid = self.new_tensor(v.aval, "const")
            self.consts[tid] = c
        for v, i in zip(jaxpr.invars, in_ids, strict=True):
            env[v] = i
        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            path = join_path(prefix, str(eqn.source_info.name_stack))
            name = eqn.primitive.name
            trips = self._trips(eqn, ins) if name == "while" else None
            if name in INLINE:
                closed = eqn.params["jaxpr"]
                outs = self.convert(closed.jaxpr, closed.consts, ins, path)
            elif (numeric := numeric_jvp(eqn)) is not None:  # jax's softmax, logsumexp
                closed, stop = numeric
                outs = self.convert(closed.jaxpr, closed.consts, ins, path, stop)
            elif trips is not None:  # a fixed trip count: a scan JAX can differentiate
                closed = while_as_scan(eqn, trips)
                outs = self.convert(closed.jaxpr, closed.consts, ins, path)
            else:
                outs = [self.new_tensor(v.aval) for v in eqn.outvars]
                self.ops.append(self._op(eqn, ins, outs, path))
                if stop_max and name == "reduce_max":
                    outs = self.emit(jax.lax.stop_gradient, outs, path)
            for v, o in zip(eqn.outvars, outs):
                if not isinstance(v, jcore.DropVar):
                    env[v] = o
        return [read(v) for v in jaxpr.outvars]

    def _trips(self, eqn, ins) -> int | None:
        def known(k):
            x = ins[k]
            if isinstance(x, Literal):
                return x.value
            return self.consts.get(x)

        return static_trip_count(eqn, known)

    def _op(self, eqn, ins, outs, path) -> Op:
        name = eqn.primitive.name
        oid = self._new_op_id()
        if name in COMPOSITES:

            def make_body(inner):
                jaxpr, consts = (
                    (inner.jaxpr, inner.consts) if hasattr(inner, "jaxpr") else (inner, ())
                )
                return graph_of(jaxpr, consts, path, strict=self.strict)

            ann, flops, kind, body = composite(eqn, make_body)
            if ann is not None:
                ann = ann.bind(_shapes(eqn.invars), _shapes(eqn.outvars))
            op = Op(oid, name, tuple(ins), tuple(outs), path, ann, flops, kind, eqn, body)
        else:
            try:
                ann = annotate_eqn(eqn)
            except AnnotationError as e:
                raise AnnotationError(f"annotating {name!r} at module path {path!r}: {e}") from e
            op = Op(oid, name, tuple(ins), tuple(outs), path, ann, op_flops(eqn), "op", eqn)
        if op.annotation is None and self.strict:
            raise UnsupportedOpError(_unsupported_message(op, eqn))
        if name in PLACEMENT:
            warnings.warn(
                f"{_PLACED.get(name, name)} at module path {path or '<root>'!r}: jscaler's plan "
                f"lays out every tensor, so the constraint is kept as the identity it is "
                f"numerically and its sharding is replaced by the plan's "
                f"(see jscaler.report.explain(plan))",
                stacklevel=2,
            )
        return op


def _shapes(vs):
    return [tuple(getattr(v.aval, "shape", ())) for v in vs]


def graph_of(jaxpr, consts, path: str = "", *, strict: bool) -> Graph:
    """The Graph of a jaxpr on its own (a call's or loop's body, a function's ops)."""
    b = Builder(strict=strict)
    ins = [b.new_tensor(v.aval) for v in jaxpr.invars]
    outs = b.convert(jaxpr, consts, ins, path)
    return b.graph(ins, outs)


_PLACED = {
    "sharding_constraint": "with_sharding_constraint",
    "reshard": "jax.sharding.reshard",
    "device_put": "jax.device_put",
}


def _unsupported_message(op: Op, eqn) -> str:
    def fmt(vs):
        return ", ".join(f"{_dtype(v.aval)}{list(getattr(v.aval, 'shape', ()))}" for v in vs)

    rank_names = [
        "a b c d e f g h"[: 2 * len(getattr(v.aval, "shape", ())) - 1] for v in eqn.invars
    ]
    example = ", ".join(r or "()" for r in rank_names) + " -> ..."
    refused = REFUSED.get(op.primitive)
    if refused is not None:
        return (
            f"jscaler cannot plan primitive {op.primitive!r} at module path "
            f"{op.path or '<root>'!r} ({fmt(eqn.invars)} -> {fmt(eqn.outvars)}): "
            f"{refused.reason}. Fix: {refused.fix}. (If you know which of its dims may be "
            f"split, jscaler.register_op({op.primitive!r}, ...) declares them and overrides "
            f"this refusal.)"
        )
    return (
        f"no dim annotation for primitive {op.primitive!r} at module path "
        f"{op.path or '<root>'!r} ({fmt(eqn.invars)} -> {fmt(eqn.outvars)}). jscaler must "
        f"know which dims of every op can be split. Register one before tracing, e.g. "
        f"jscaler.register_op({op.primitive!r}, lambda eqn: '{example}'), naming each axis of "
        f"each input and output, with '+' on dims that give partial sums and '^' on dims "
        f"that cannot be split; or trace with strict=False to inspect the graph."
    )
