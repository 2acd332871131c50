"""The SPMD pipeline fast path: a homogeneous layer stack as one jitted program.

:func:`spmd_pipeline` runs ``L`` identical layers (one ``layer_fn``, parameters stacked
along a leading axis) as a pipeline over the ``p`` devices of one mesh axis, inside a
single ``jax.shard_map``. Each device (stage) holds ``L / p`` layers' parameters, its
slice of the stacked leading axis. The batch is cut into ``m`` micro-batches (micro-batch
``k`` holds rows ``k, k + m, k + 2m, ...``, so a batch split over a data axis stays split
the same way in each); a ``jax.lax.scan`` over ``m + p - 1`` ticks moves them through the
stages, every stage applying its layers to what it holds and handing the result to the
next stage with ``jax.lax.ppermute``. The last stage's results are summed over the stage
axis (``psum``, the other stages adding zeros), so the output is replicated over it::

    tick     0    1    2    3    4    5    6
    stage 0  F0   F1   F2   F3   .    .    .      (p = 4, m = 4: Fk is micro-batch k)
    stage 1  .    F0   F1   F2   F3   .    .
    stage 2  .    .    F0   F1   F2   F3   .
    stage 3  .    .    .    F0   F1   F2   F3

This is GPipe's fill and drain: the idle fraction (``.``) is ``(p - 1) / (m + p - 1)``.
(An idle tick skips the stage's layers with a ``jax.lax.cond`` on the stage's own
index: the program is the same on every device, the branch taken is not.) The backward
is JAX's autodiff of the scan: the transposed scan runs the ticks in reverse and each
``ppermute`` transposes to a send to the previous stage, which is GPipe's reverse
pipeline, all forwards before all backwards.

With ``virtual_stages=v > 1`` (the circular pipeline), the stack is cut into ``p * v``
chunks of ``L / (p * v)`` layers, chunk ``j`` living on stage ``j mod p``; micro-batches
go round the ring of stages ``v`` times (the last stage sends back to the first, which
keeps returning micro-batches in a buffer until their turn). That takes ``m * v + p - 1``
ticks of ``1 / v`` the work each, so the idle fraction falls to
``(p - 1) / (m * v + p - 1)``, at the price of ``v`` times the sends. It needs
``m >= p``. The stacked parameters are re-laid out (chunk order differs from stage
order): parameters stored split contiguously over the stage axis move between devices
on every call, and their gradients back (XLA may warn that it rematerialises them).

Supported: any ``layer_fn(layer_params, h) -> h`` that keeps ``h``'s shapes and dtypes
(``h`` an array or a pytree of arrays with a common leading batch dim), ``jax.grad`` /
``jax.value_and_grad`` through it (w.r.t. the stacked parameters and the input), other
mesh axes left to the compiler (``shard_map`` is manual over ``axis`` only, so a batch
sharded over a data axis stays sharded), and ``remat=True`` (each stage's layers are
recomputed in the backward instead of keeping their inner activations).

Not supported: heterogeneous stages (an embedding or a head inside the pipeline: run
them before and after), and schedules other than GPipe's order. 1F1B, interleaved 1F1B
and zero-bubble need each stage to run its own sequence of forward and backward
programs, so the backward cannot be autodiff of one forward scan: that is the MPMD
runtime (``jscaler.parallelize(..., plan=megatron(pp=...), schedule=...)``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jscaler.errors import PlanError

__all__ = ["spmd_pipeline"]


def _vary(x, axis: str):
    """``x`` typed as varying over ``axis`` inside shard_map (no data moves)."""
    aval = jax.typeof(x)
    if axis in getattr(aval, "vma", frozenset()):
        return x
    return jax.lax.pcast(x, (axis,), to="varying")


def _explicit(mesh: Mesh, axis: str) -> bool:
    return axis in getattr(mesh, "explicit_axes", ())


def _spec(a, axis: str, lead: bool) -> tuple[list, list]:
    """``a``'s spec entries now, and with ``axis`` on dim 0 (``lead``) or nowhere."""
    spec = list(jax.typeof(a).sharding.spec)
    spec += [None] * (a.ndim - len(spec))

    def drop(e):
        if isinstance(e, tuple):
            rest = tuple(n for n in e if n != axis)
            return rest if len(rest) > 1 else (rest[0] if rest else None)
        return None if e == axis else e

    want = [drop(e) for e in spec]
    if lead:
        want[0] = axis
    return spec, want


def _place(a, mesh: Mesh, axis: str, lead: bool):
    """``a`` laid out as the shard_map below reads it, for a mesh whose stage axis is
    Explicit (an Auto axis is resharded by shard_map itself): its dim 0 split over
    ``axis`` (``lead``) or ``axis`` nowhere; other axes left where they are."""
    if not _explicit(mesh, axis):
        return a
    spec, want = _spec(a, axis, lead)
    return a if want == spec else jax.reshard(a, NamedSharding(mesh, P(*want)))


def _check(layer_fn, stacked_params, x, mesh, axis, microbatches, virtual_stages):
    if not isinstance(mesh, Mesh):
        raise PlanError(f"spmd_pipeline: mesh must be a jax.sharding.Mesh, got {mesh!r}")
    if axis not in mesh.shape:
        raise PlanError(
            f"spmd_pipeline: expected the stage axis {axis!r} among the mesh axes, found "
            f"{tuple(mesh.shape)}"
        )
    for name, v in (("microbatches", microbatches), ("virtual_stages", virtual_stages)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise PlanError(f"spmd_pipeline: {name} must be a positive int, got {v!r}")
    p = mesh.shape[axis]
    leaves = jax.tree.leaves(stacked_params)
    if not leaves:
        raise PlanError("spmd_pipeline: stacked_params has no arrays")
    lengths = {jnp.shape(a)[0] if jnp.ndim(a) else None for a in leaves}
    if len(lengths) != 1 or None in lengths:
        raise PlanError(
            "spmd_pipeline: expected every leaf of stacked_params to have the same leading "
            f"(layer) dim, found leading dims {sorted(map(str, lengths))}"
        )
    (n_layers,) = lengths
    chunks = p * virtual_stages
    if n_layers % chunks:
        what = f"{p} stages" + (f" x {virtual_stages} virtual stages" if virtual_stages > 1 else "")
        raise PlanError(
            f"spmd_pipeline: expected the number of layers to be divisible by {what} "
            f"({chunks}), found {n_layers} layers; use a layer count that is a multiple of "
            f"{chunks} or another stage count"
        )
    x_leaves = jax.tree.leaves(x)
    if not x_leaves or any(jnp.ndim(a) == 0 for a in x_leaves):
        raise PlanError("spmd_pipeline: x must be an array (or pytree) with a batch dim")
    batches = {jnp.shape(a)[0] for a in x_leaves}
    if len(batches) != 1:
        raise PlanError(
            f"spmd_pipeline: expected one batch size over x's leaves, found {sorted(batches)}"
        )
    (batch,) = batches
    if batch % microbatches:
        raise PlanError(
            f"spmd_pipeline: expected the batch size to be divisible by {microbatches} "
            f"micro-batches, found batch {batch}; pick microbatches dividing {batch}"
        )
    if virtual_stages > 1 and microbatches < p:
        raise PlanError(
            f"spmd_pipeline: the circular pipeline (virtual_stages={virtual_stages}) needs "
            f"at least as many micro-batches as stages ({p}), found {microbatches}"
        )
    # one layer must map h to an h of the same shapes and dtypes (the scan carry)
    one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), stacked_params)
    h = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct((batch // microbatches, *a.shape[1:]), a.dtype), x
    )
    out = jax.eval_shape(layer_fn, one, h)
    if jax.tree.structure(out) != jax.tree.structure(h) or any(
        (o.shape, o.dtype) != (i.shape, i.dtype)
        for o, i in zip(jax.tree.leaves(out), jax.tree.leaves(h))
    ):
        found = jax.tree.map(lambda a: f"{a.dtype}{list(a.shape)}", out)
        want = jax.tree.map(lambda a: f"{a.dtype}{list(a.shape)}", h)
        raise PlanError(
            "spmd_pipeline: expected layer_fn to keep the activations' shapes and dtypes "
            f"(a homogeneous stack), found {want} -> {found}"
        )
    return p, n_layers


def spmd_pipeline(
    layer_fn: Callable[[Any, Any], Any],
    stacked_params: Any,
    x: Any,
    *,
    mesh: Mesh,
    axis: str = "stage",
    microbatches: int,
    virtual_stages: int = 1,
    remat: bool = False,
) -> Any:
    """Applies ``L`` stacked layers to ``x`` as a GPipe pipeline over ``mesh``'s ``axis``.

    Equal (up to float rounding) to applying ``layer_fn`` with ``stacked_params[0]``,
    then ``stacked_params[1]``, ... to ``x`` on one device; differentiable.

    Args:
      layer_fn: ``layer_fn(layer_params, h) -> h``, one layer; ``h`` keeps its shapes.
      stacked_params: a pytree whose leaves have a leading dim ``L`` (layer ``i``'s
        parameters at index ``i``), ``L`` divisible by ``p * virtual_stages``.
      x: the activations entering the stack, ``(batch, ...)`` (or a pytree of such).
      mesh: the device mesh; ``axis`` is the pipeline's stage axis (``p`` devices).
        Other axes are left to the compiler.
      axis: the name of the stage axis.
      microbatches: ``m``; the batch must be divisible by it.
      virtual_stages: chunks per stage; more than 1 runs the circular pipeline (needs
        ``m >= p``).
      remat: recompute each stage's layers in the backward.

    Returns:
      The stack's output for the whole batch, micro-batches reassembled in order (row
      ``i`` of the output is row ``i`` of ``x`` through the stack), replicated over
      ``axis``.

    Raises:
      PlanError: a layer count not divisible by the stages, a batch not divisible by the
        micro-batches, a stage axis missing from the mesh, or a ``layer_fn`` that changes
        the activations' shapes.
    """
    p, n_layers = _check(layer_fn, stacked_params, x, mesh, axis, microbatches, virtual_stages)
    m, v = microbatches, virtual_stages
    per_chunk = n_layers // (p * v)
    ticks = m * v + p - 1

    # (L, ...) -> (p, v, L/(p v), ...): chunk j = r p + s (layers j*c .. j*c+c-1) goes to
    # stage s as its r-th chunk. With v = 1 this is a reshape of the stage-major layout,
    # so layers already split over the stage axis stay where they are.
    def to_stages(a):
        shape = (p, per_chunk, *a.shape[1:])
        if v == 1 and _explicit(mesh, axis):
            a = _place(a, mesh, axis, True)
            _, want = _spec(a, axis, True)
            a = jax.lax.reshape(
                a, shape, out_sharding=NamedSharding(mesh, P(axis, None, *want[1:]))
            )
            return a[:, None]
        if v == 1:
            return a.reshape(shape)[:, None]
        if _explicit(mesh, axis):
            a = _place(a, mesh, axis, False).reshape(v, *shape)
            return _place(jnp.swapaxes(a, 0, 1), mesh, axis, True)
        # Auto axes: pin the stage axis to the stage dim on both sides of the transpose
        # (other dims left to the compiler), so that neither direction replicates
        rest = [P.UNCONSTRAINED] * (a.ndim - 1)
        a = a.reshape(v, *shape)
        a = jax.lax.with_sharding_constraint(a, NamedSharding(mesh, P(None, axis, *rest)))
        a = jnp.swapaxes(a, 0, 1)
        return jax.lax.with_sharding_constraint(a, NamedSharding(mesh, P(axis, None, *rest)))

    params = jax.tree.map(to_stages, stacked_params)

    # micro-batch k holds rows k, k + m, k + 2m, ...: a batch split over a data axis
    # stays split the same way inside every micro-batch
    def to_micro(a):
        a = _place(a, mesh, axis, False).reshape(a.shape[0] // m, m, *a.shape[1:])
        return jnp.swapaxes(a, 0, 1)

    xs = jax.tree.map(to_micro, x)

    def chunk_fn(chunk_params, h):
        def one(h, lp):
            return layer_fn(lp, h), None

        return jax.lax.scan(one, h, chunk_params)[0]

    if remat:
        chunk_fn = jax.checkpoint(chunk_fn)

    forward = [(i, i + 1) for i in range(p - 1)]
    ring = [(i, (i + 1) % p) for i in range(p)]

    def body(local, xs):
        local = jax.tree.map(lambda a: a[0], local)  # (v, c, ...)
        stage = jax.lax.axis_index(axis)
        xs = jax.tree.map(lambda a: _vary(a, axis), xs)
        zero = jax.tree.map(lambda a: jnp.zeros_like(a[0]), xs)

        def tick(carry, t):
            received, buffer = carry
            fresh = jax.tree.map(lambda a: a[jnp.minimum(t, m - 1)], xs)
            if v > 1:
                # stage 0 takes a new micro-batch for the first m ticks, then the ones
                # coming back round the ring (micro-batch t mod m, kept in the buffer)
                back = jax.tree.map(lambda b: b[t % m], buffer)
                fresh = jax.tree.map(lambda f, b: jnp.where(t < m, f, b), fresh, back)
            h = jax.tree.map(lambda f, r: jnp.where(stage == 0, f, r), fresh, received)
            # stage s at tick t works on flat iteration t - s: round (t - s) // m; in the
            # fill and drain ticks it has none and skips its layers
            i = t - stage
            r = jnp.clip(i // m, 0, v - 1)
            chunk = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, r, 0, False), local)
            busy = (i >= 0) & (i < m * v)
            h = jax.lax.cond(busy, chunk_fn, lambda _, h: h, chunk, h)
            sent = jax.lax.ppermute(h, axis, ring if v > 1 else forward)
            if v > 1:
                # what stage 0 received was the last stage's iteration t - p + 1
                slot = (t - p + 1) % m
                buffer = jax.tree.map(
                    lambda b, s: jax.lax.dynamic_update_index_in_dim(b, s, slot, 0),
                    buffer,
                    sent,
                )
            return (sent, buffer), h

        buffer = jax.tree.map(jnp.zeros_like, xs) if v > 1 else None
        _, ys = jax.lax.scan(tick, (zero, buffer), jnp.arange(ticks))
        # the last stage's final round: ticks (v - 1) m + p - 1 ... m v + p - 2, in order
        first = (v - 1) * m + p - 1
        out = jax.tree.map(lambda y: jnp.where(stage == p - 1, y[first:], 0), ys)
        return jax.tree.map(lambda o: jax.lax.psum(o, axis), out)

    out = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P(axis), P()),
        out_specs=P(),
        axis_names=frozenset({axis}),
    )(params, xs)
    return jax.tree.map(lambda o, a: jnp.swapaxes(o, 0, 1).reshape(a.shape), out, x)
