"""FLOP counts of single ops (forward pass), for coverage and the cost model.

Contractions count a multiply-add as 2 FLOPs; elementwise arithmetic and reductions count
one per element; data movement counts zero.
"""

from __future__ import annotations

import math

from jscaler.ir.rules_elementwise import BINARY, MOVEMENT, TERNARY, UNARY

_ARITH = (set(UNARY) | set(BINARY) | set(TERNARY)) - MOVEMENT
_REDUCE = {
    "reduce_sum",
    "reduce_max",
    "reduce_min",
    "reduce_prod",
    "argmax",
    "argmin",
    "cumsum",
    "cumprod",
    "cummax",
    "cummin",
    "cumlogsumexp",
}


def _size(v) -> int:
    return math.prod(getattr(v.aval, "shape", ()))


def op_flops(eqn) -> float:
    """FLOPs of one primitive equation (call and loop ops sum their bodies instead)."""
    name = eqn.primitive.name
    if name == "dot_general":
        (lc, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval.shape
        return 2.0 * _size(eqn.outvars[0]) * math.prod(lhs[i] for i in lc)
    if name == "conv_general_dilated":
        rhs = eqn.invars[1].aval.shape
        spec = eqn.params["dimension_numbers"].rhs_spec
        window = math.prod(rhs[i] for i in spec[2:])
        return 2.0 * _size(eqn.outvars[0]) * window * rhs[spec[1]]
    if name in _ARITH:
        return float(sum(_size(v) for v in eqn.outvars))
    if name in _REDUCE:
        return float(_size(eqn.invars[0]))
    if name.startswith("reduce_window") or name.startswith("select_and_"):
        window = math.prod(eqn.params.get("window_dimensions", (1,)))
        return float(_size(eqn.outvars[0]) * window)
    if name.startswith("scatter"):
        return float(_size(eqn.invars[-1]))
    return 0.0
