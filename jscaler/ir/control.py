"""Ops that hold sub-programs: custom-derivative and remat calls, scan, cond, while.

They stay whole in the graph (their custom gradients, rematerialisation and loop
structure survive ``as_fn``); their annotation is composed from their bodies.
"""

from __future__ import annotations

from collections.abc import Callable

from jscaler.ir.annotation import Annotation
from jscaler.ir.compose import compose
from jscaler.ir.graph import Graph

__all__ = ["COMPOSITES", "INLINE", "composite", "numeric_jvp", "scan_layout"]

# nested jits: traced through, their ops joining the caller's graph
INLINE = {"jit", "pjit", "closed_call", "core_call"}

# primitive -> the param holding the sub-program it calls
CALLS = {
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "remat2": "jaxpr",
    "composite": "call_jaxpr",  # lax.composite: a named decomposition
    "custom_vmap_call": "call",
    "linear_call": "callee",
    "xla_metadata_call": "jaxpr",  # jax.experimental.xla_metadata around a function
}
# hijax primitives (jnp.frexp, jnp.searchsorted, lax.custom_root) carry a HiPrim whose
# ``expand`` is their definition in ordinary primitives
HIJAX = "call_hi_primitive"
COMPOSITES = set(CALLS) | {"scan", "cond", "while", HIJAX}

MakeBody = Callable[[object], Graph]  # a (closed) jaxpr -> its Graph

# jax's own custom derivatives that exist for numerics alone and whose bodies jax traced
# inline up to 0.12.0 (0.12.1 made jax.nn.softmax and logsumexp custom_jvp calls): name in
# jax/_src/ops/special.py -> whether the body's max takes no gradient (softmax's rule is
# shift-invariant; its body lacks the stop_gradient that logsumexp's has). Traced inline,
# the max over a vocabulary is a graph op of its own again (jscaler.ir.extrema keeps it
# split) and attention's softmax is ops a region can split.
_NUMERIC_JVPS = {"_softmax": True, "_logsumexp_impl": False}
_SPECIAL = "jax/_src/ops/special.py"


def numeric_jvp(eqn) -> tuple[object, bool] | None:
    """(its body, whether the body's max takes no gradient) for a ``custom_jvp_call`` of
    one of jax's :data:`_NUMERIC_JVPS`; None for any other equation."""
    if eqn.primitive.name != "custom_jvp_call":
        return None
    closed = eqn.params["call_jaxpr"]
    info = getattr(getattr(closed, "jaxpr", closed), "debug_info", None)
    src = getattr(info, "func_src_info", None) or ""
    name, _, where = src.partition(" at ")
    if name not in _NUMERIC_JVPS or _SPECIAL not in where.replace("\\", "/"):
        return None
    return closed, _NUMERIC_JVPS[name]


def composite(eqn, make_body: MakeBody) -> tuple[Annotation | None, float, str, Graph]:
    """(annotation before binding, FLOPs, kind, body graph) of a composite equation."""
    name, p = eqn.primitive.name, eqn.params
    if name in CALLS or name == HIJAX:
        body = make_body(expand_hijax(eqn) if name == HIJAX else p[CALLS[name]])
        if len(body.inputs) != len(eqn.invars) or len(body.outputs) != len(eqn.outvars):
            return None, body.flops, "call", body  # a calling convention we do not know
        return compose(body), body.flops, "call", body
    if name == "scan":
        body = make_body(p["jaxpr"])
        n_c, n_carry = scan_layout(eqn)
        n_x = len(eqn.invars) - n_c - n_carry
        ann = compose(
            body,
            leading_in=[False] * (n_c + n_carry) + [True] * n_x,
            leading_out=[False] * n_carry + [True] * (len(eqn.outvars) - n_carry),
            carries=[(n_c + k, k) for k in range(n_carry)],
        )
        return ann, body.flops * p["length"], "loop", body
    if name == "cond":
        return _cond(eqn, make_body)
    return _while(eqn, make_body)


def expand_hijax(eqn):
    """The closed jaxpr of a hijax primitive's ``expand`` at the equation's operands."""
    import jax

    prim = eqn.params["_prim"]

    def expanded(*flat):
        args = jax.tree_util.tree_unflatten(prim.in_tree, flat)
        return jax.tree_util.tree_leaves(prim.expand(*args))

    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars]
    return jax.make_jaxpr(expanded)(*avals)


def scan_layout(eqn) -> tuple[int, int]:
    """(number of consts, number of carries) of a scan equation, across jax versions."""
    p = eqn.params
    if "num_consts" in p:
        return p["num_consts"], p["num_carry"]
    consts, carry, xs = p["ft_in"].update(list(range(len(eqn.invars)))).unpack()
    order = [*consts, *carry, *xs]
    if order != list(range(len(eqn.invars))):
        raise NotImplementedError(f"scan operands in an unexpected order: {order}")
    return len(consts), len(carry)


def _cond(eqn, make_body):
    """Branches must agree on an annotation; otherwise nothing of the cond splits."""
    bodies = [make_body(b) for b in eqn.params["branches"]]
    anns = [compose(b) for b in bodies]
    flops = max(b.flops for b in bodies)
    if any(a is None for a in anns):
        return None, flops, "call", bodies[0]
    ann = anns[0] if len({a.canonical() for a in anns}) == 1 else _all_blocked(anns[0])
    with_index = Annotation(((),) + ann.inputs, ann.outputs, dict(ann.kinds), ann.sizes)
    return with_index.canonical(), flops, "call", bodies[0]


def _while(eqn, make_body):
    """The body composes like a scan's; a carry the loop condition reads does not split."""
    p = eqn.params
    n_cc, n_bc = p["cond_nconsts"], p["body_nconsts"]
    body, cond = make_body(p["body_jaxpr"]), make_body(p["cond_jaxpr"])
    n_carry = len(eqn.outvars)
    ann = compose(body, carries=[(n_bc + k, k) for k in range(n_carry)])
    if ann is None or compose(cond) is None:
        return None, body.flops, "loop", body
    read = {k for k in range(n_carry) if cond.inputs[n_cc + k] in _read_tensors(cond)}
    kinds = dict(ann.kinds)
    for k in read:
        for ax in ann.inputs[n_bc + k]:
            for d in ax:
                kinds[d] = "^"
    cond_consts = tuple(
        tuple((f"_w{i}_{a}",) for a in range(len(cond.tensors[t].shape)))
        for i, t in enumerate(cond.inputs[:n_cc])
    )
    for t in cond_consts:
        for (d,) in t:
            kinds[d] = "^"
    out = Annotation(cond_consts + ann.inputs, ann.outputs, kinds, ann.sizes)
    return out.canonical(), body.flops, "loop", body


def _read_tensors(g: Graph) -> set:
    return {t for o in g.ops for t in o.tensor_inputs} | {
        t for t in g.outputs if isinstance(t, int)
    }


def _all_blocked(ann: Annotation) -> Annotation:
    return Annotation(ann.inputs, ann.outputs, {d: "^" for d in ann.kinds}, ann.sizes)
