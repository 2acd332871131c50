"""Runs a Graph's ops on values, re-binding each op's primitive with its own params.

Ops keep their jaxpr equation, so a ``custom_jvp_call`` keeps its custom derivative and a
``remat2`` its rematerialisation: differentiating the evaluation differentiates the same
primitives the original function bound.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax._src import source_info_util

from jscaler.ir.expose import loop_groups, run_loop
from jscaler.ir.graph import LOOP_PRIMITIVES, Graph, Literal

__all__ = ["evaluate"]


def evaluate(graph: Graph, *flat_inputs) -> list:
    """Runs the ops of ``graph`` on values for its ``inputs`` (in order) and returns the
    values of its ``outputs``."""
    if len(flat_inputs) != len(graph.inputs):
        raise TypeError(f"the graph takes {len(graph.inputs)} inputs, got {len(flat_inputs)}")
    env = dict(graph.consts)
    env.update(zip(graph.inputs, flat_inputs))

    def read(x):
        if isinstance(x, Literal):
            return x.value
        return env[x]

    _run(graph.ops, env, None)
    return [jnp.asarray(read(x)) if isinstance(x, Literal) else read(x) for x in graph.outputs]


def _run(ops, env: dict, inside) -> None:
    for loop, group in loop_groups(ops, inside):
        # an exposed scan runs as a scan; some of its body's ops alone (a constant they
        # compute) run as they are
        if loop is not None and any(o.primitive in LOOP_PRIMITIVES for o in group):
            run_loop(group, env, lambda body, local, loop=loop: _run(body, local, loop))
            continue
        for op in group:
            _bind(op, env)


def _bind(op, env: dict) -> None:
    eqn = op.eqn
    params = eqn.primitive.get_bind_params(eqn.params)
    ins = [x.value if isinstance(x, Literal) else env[x] for x in op.inputs]
    with (
        source_info_util.user_context(eqn.source_info.traceback, name_stack=_stack(op.path)),
        eqn.ctx.manager,
    ):
        outs = eqn.primitive.bind(*ins, **params)
    if not eqn.primitive.multiple_results:
        outs = [outs]
    env.update(zip(op.outputs, outs))


def _stack(path: str):
    stack = source_info_util.new_name_stack()
    for part in path.split("/") if path else ():
        stack = stack.extend(part)
    return stack
