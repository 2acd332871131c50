"""Where a parallelised step's arguments and results live.

Plan inputs in their storage layouts; optimizer-state-like leaves (a path ending with a
parameter's path, with its shape) in their parameter's update layout; other batch leaves
split on axis 0; everything else replicated. A result at an argument's path keeps that
argument's layout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jscaler.compile.lower import Lowered
from jscaler.ir.trace import key_names
from jscaler.runtime.step.autodiff import Captured

__all__ = ["follow", "followers", "in_shardings", "out_shardings", "place"]


def in_shardings(low: Lowered, cap: Captured, src, micro, paths, owner, bi) -> list:
    """Plan inputs in their storage layouts; optimizer-state-like leaves in their
    parameter's update layout; other batch leaves split on axis 0 as the plan splits batch
    inputs with as many rows (the loss may read them through a computation); everything
    else replicated."""
    stored = low.input_shardings()
    out: list = [None] * len(micro)
    for i, k in enumerate(src):
        if k is not None and out[k] is None:
            out[k] = stored[i]
    g = low.plan.pgraph.graph
    rows = {}
    for t, sh in zip(g.inputs, stored):
        shape = g.tensors[t].shape
        if g.tensors[t].role == "batch" and shape and sh.spec:
            rows.setdefault(shape[0], NamedSharding(low.mesh, PartitionSpec(sh.spec[0])))
    by_param = followers(low, cap)
    rep = NamedSharding(low.mesh, PartitionSpec())
    for k, s in enumerate(micro):
        if out[k] is not None:
            continue
        if owner[k] == bi:
            out[k] = rows.get(s.shape[0], rep) if s.ndim else rep
        else:
            out[k] = follow(by_param, paths[k][1:], s, rep)
    return out


def out_shardings(by_param: dict, rep, out_shape, arg_paths, full, in_sh):
    """A result at an argument's path (after the first step: ``(new_state, metrics)``
    returns the state at ``[0]``, as it came in) with its shape and dtype keeps that
    argument's layout; other results follow a parameter's update layout (``by_param``, see
    :func:`follow`) or replicate. Returns the shardings and the argument leaves returned
    so."""
    by_path = {tuple(key_names(p[1:])): k for k, p in enumerate(arg_paths)}
    pairs, tdef = jax.tree_util.tree_flatten_with_path(out_shape)
    shardings, returned = [], set()
    for path, s in pairs:
        names = key_names(path)
        k = by_path.get(tuple(names[1:]), by_path.get(tuple(names)))
        if k is not None and (full[k].shape, full[k].dtype) == (s.shape, s.dtype):
            shardings.append(in_sh[k])
            returned.add(k)
        else:
            shardings.append(follow(by_param, path, s, rep))
    return jax.tree_util.tree_unflatten(tdef, shardings), returned


def followers(low: Lowered, cap: Captured) -> dict:
    g = low.plan.pgraph.graph
    ids = [t for t in g.inputs if g.tensors[t].role == "param"]
    return {
        tuple(name.split("/")): (tuple(g.tensors[t].shape), low.sharding(low.update[t]))
        for name, t in zip(cap.param_names, ids)
    }


def follow(by_param: dict, path, s, default):
    """The layout of the parameter whose path ends ``path`` with ``s``'s shape (an
    optimizer state leaf's), else ``default``; ``by_param``: parameter path -> (shape,
    sharding)."""
    names = key_names(path)
    for start in range(len(names)):
        hit = by_param.get(tuple(names[start:]))
        if hit is not None and hit[0] == tuple(s.shape):
            return hit[1]
    return default


def place(x, sharding):
    """``x`` on ``sharding``: itself when it is there already (then donated, as
    ``jax.jit(donate_argnums=...)`` would), else a copy (never aliasing the caller's
    buffers, which stay valid)."""
    if not isinstance(x, jax.Array):
        return jax.device_put(x, sharding)
    if x.sharding == sharding:
        return x
    # device_put may alias a shard it need not move (even with may_alias=False)
    return jax.device_put(jnp.array(x, copy=True), sharding)
