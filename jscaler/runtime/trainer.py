"""Trainer: one jitted SPMD training step built from a lowered plan.

The step computes the loss with the plan's layouts, differentiates it with JAX, lays the
gradients out as the plan's ``grad`` ops say (accumulating over micro-batches), runs the
optax update in the ``update`` ops' layout (the optimizer state's), and stores the new
parameters in their storage layout. ZeRO-1/2/3 are these layouts, not separate code.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jscaler.compile.lower import Lowered
from jscaler.errors import PlanError
from jscaler.ir.graph import Graph
from jscaler.plan.plan import Plan

__all__ = ["Trainer"]


class Trainer:
    """Trains a model under a plan. Made by :func:`jscaler.parallelize`.

    Attributes:
      plan: the validated :class:`Plan` it runs.
      graph: the traced graph (at micro-batch shape).
      precision: ``"fp32"``, or ``"bf16"``: the step computes in bf16 while parameters
        and optimizer state stay fp32 (gradients arrive in fp32 through the casts).
    """

    def __init__(
        self,
        graph: Graph,
        lowered: Lowered,
        optimizer: optax.GradientTransformation,
        model_or_params: Any,
        microbatches: int,
        batch_shapes: list[jax.ShapeDtypeStruct],
        precision: str = "fp32",
    ):
        self.graph = graph
        self.plan: Plan = lowered.plan
        self.precision = precision
        self._low = lowered
        self._optimizer = optimizer
        self._m = microbatches
        self._sig = graph.signature
        self._batch_shapes = batch_shapes
        self._graphdef = None
        p_leaves, s_leaves = self._sig.split(model_or_params)
        if self._sig.kind == "nnx":
            self._graphdef = self._sig.graphdef
        self._n_p, self._n_s = len(p_leaves), len(s_leaves)
        shard = lowered.input_shardings()
        self._p_shard = shard[: self._n_p]
        self._s_shard = shard[self._n_p : self._n_p + self._n_s]
        self._b_shard = shard[self._n_p + self._n_s :]
        self._params = _place(p_leaves, self._p_shard)
        self._state = _place(s_leaves, self._s_shard)
        params_tree = self._tree(self._params)
        abstract_opt = jax.eval_shape(optimizer.init, params_tree)
        param_ids = [t for t in graph.inputs if graph.tensors[t].role == "param"]
        upd = self._tree([lowered.sharding(lowered.update[t]) for t in param_ids])
        rep = NamedSharding(lowered.mesh, PartitionSpec())
        self._opt_shard = optax.tree_map_params(
            optimizer, lambda _, s: s, abstract_opt, upd, transform_non_params=lambda _: rep
        )
        self._opt_state = jax.jit(optimizer.init, out_shardings=self._opt_shard)(params_tree)
        self._grad_layouts = [lowered.grad[t] for t in param_ids]
        self._upd_layouts = [lowered.update[t] for t in param_ids]
        tensors = graph.tensors
        roles = [tensors[t] for t in graph.inputs]
        self._p_dtypes = [t.dtype for t in roles if t.role == "param"]
        self._b_dtypes = [t.dtype for t in roles if t.role == "batch"]
        self._step_fn = None
        self._grad_fn = None
        self.step_count = 0

    # ---- trees -----------------------------------------------------------------------

    def _tree(self, p_leaves):
        return jax.tree_util.tree_unflatten(self._sig.params_def, list(p_leaves))

    @property
    def params(self):
        """The current parameters, gathered to full arrays (nnx State or your pytree)."""
        return self._tree([jax.device_get(p) for p in self._params])

    def shardings(self):
        """The NamedSharding each parameter is stored with, in the parameters' structure."""
        return self._tree(self._p_shard)

    @property
    def model(self):
        """For an nnx model: a new model holding the current parameters and state."""
        if self._sig.kind != "nnx":
            raise TypeError("model is for nnx models; use .params for a params pytree")
        state = jax.tree_util.tree_unflatten(self._sig.state_def, list(self._state))
        return nnx.merge(self._graphdef, self.params, state)

    # ---- the step --------------------------------------------------------------------

    def _loss_and_grads(self, params, state, batch):
        low, m = self._low, self._m

        def one(params, state, mb):
            params = [p.astype(d) for p, d in zip(params, self._p_dtypes)]
            mb = [x.astype(d) for x, d in zip(mb, self._b_dtypes)]
            outs = low.forward(*params, *state, *mb)
            return outs[0].astype(jnp.float32), list(outs[1:])

        grad_fn = jax.value_and_grad(one, has_aux=True)

        def reduce_grads(gs):
            return [
                jax.lax.with_sharding_constraint(g, low.sharding(lay))
                for g, lay in zip(gs, self._grad_layouts)
            ]

        if m == 1:
            (loss, state), grads = grad_fn(params, state, batch)
            return loss, state, reduce_grads(grads)
        split = [microbatches(b, m) for b in batch]

        def body(carry, i):
            loss_sum, grads_sum, state = carry
            mb = [jax.lax.dynamic_index_in_dim(b, i, 1, keepdims=False) for b in split]
            mb = [jax.lax.with_sharding_constraint(x, sh) for x, sh in zip(mb, self._b_shard)]
            (loss, state), grads = grad_fn(params, state, mb)
            grads = reduce_grads(grads)
            return (loss_sum + loss, [a + g for a, g in zip(grads_sum, grads)], state), None

        zeros = reduce_grads([jnp.zeros_like(p) for p in params])
        init = (jnp.zeros((), jnp.float32), zeros, state)
        (loss, grads, state), _ = jax.lax.scan(body, init, jnp.arange(m))
        return loss / m, state, [g / m for g in grads]

    def _build_step(self):
        low = self._low

        def step(params, opt_state, state, batch):
            loss, state, grads = self._loss_and_grads(params, state, batch)
            grad_norm = optax.tree.norm(grads)
            p_u = [
                jax.lax.with_sharding_constraint(p, low.sharding(lay))
                for p, lay in zip(params, self._upd_layouts)
            ]
            g_u = [
                jax.lax.with_sharding_constraint(g, low.sharding(lay))
                for g, lay in zip(grads, self._upd_layouts)
            ]
            p_tree, g_tree = self._tree(p_u), self._tree(g_u)
            updates, opt_state = self._optimizer.update(g_tree, opt_state, p_tree)
            new = jax.tree_util.tree_leaves(optax.apply_updates(p_tree, updates))
            return new, opt_state, state, loss, grad_norm

        rep = NamedSharding(low.mesh, PartitionSpec())
        return jax.jit(
            step,
            in_shardings=(self._p_shard, self._opt_shard, self._s_shard, self._b_shard),
            out_shardings=(self._p_shard, self._opt_shard, self._s_shard, rep, rep),
            donate_argnums=(0, 1, 2),
        )

    def _put_batch(self, batch) -> list:
        return _place(batch_leaves(batch, self._sig, self._batch_shapes), self._b_shard)

    def compiled(self, batch):
        """The compiled training step for this batch: ``.as_text()`` shows the collectives
        XLA emitted, ``.memory_analysis()`` the per-device memory."""
        if self._step_fn is None:
            self._step_fn = self._build_step()
        b = self._put_batch(batch)
        return self._step_fn.lower(self._params, self._opt_state, self._state, b).compile()

    def comm_table(self):
        """The collectives the plan implies per step (a :class:`CommTable`): tensor, module
        path, collective, mesh axes and bytes, derived from the layouts, not from XLA."""
        from jscaler.compile.comm import comm_table

        return comm_table(self._low, self._m)

    def hlo(self, batch) -> str:
        """The compiled HLO text of the training step for this batch."""
        return self.compiled(batch).as_text()

    def step(self, batch) -> dict[str, float]:
        """One training step: ``{"loss", "grad_norm"}`` (loss before the update)."""
        if self._step_fn is None:
            self._step_fn = self._build_step()
        b = self._put_batch(batch)
        self._params, self._opt_state, self._state, loss, gnorm = self._step_fn(
            self._params, self._opt_state, self._state, b
        )
        self.step_count += 1
        return {"loss": float(loss), "grad_norm": float(gnorm)}

    def value_and_grad(self, batch):
        """Loss and gathered gradients at the current parameters, without an update."""
        if self._grad_fn is None:
            rep = NamedSharding(self._low.mesh, PartitionSpec())
            self._grad_fn = jax.jit(
                lambda p, s, b: (lambda r: (r[0], r[2]))(self._loss_and_grads(p, s, b)),
                in_shardings=(self._p_shard, self._s_shard, self._b_shard),
                out_shardings=(rep, [self._low.sharding(lay) for lay in self._grad_layouts]),
            )
        loss, grads = self._grad_fn(self._params, self._state, self._put_batch(batch))
        return float(loss), self._tree([jax.device_get(g) for g in grads])


def batch_leaves(batch, sig, shapes) -> list:
    """The batch's leaves, after checking its structure and shapes against the example
    batch the trainer was made for."""
    leaves, tdef = jax.tree_util.tree_flatten(batch)
    if tdef != sig.batch_def:
        raise PlanError(f"the batch has structure {tdef}; the trainer was made for {sig.batch_def}")
    for i, (x, want) in enumerate(zip(leaves, shapes)):
        if tuple(x.shape) != tuple(want.shape):
            raise PlanError(
                f"batch leaf {i} has shape {tuple(x.shape)}; the trainer was made for "
                f"{tuple(want.shape)} (the example batch's shape)"
            )
    return leaves


def microbatches(x, m: int):
    """(B, ...) -> (B/m, m, ...): micro-batch j is rows j, j+m, j+2m, ... (local to each
    data-parallel shard, so splitting needs no communication)."""
    return x.reshape(x.shape[0] // m, m, *x.shape[1:])


def _place(leaves, shardings) -> list:
    """Copies leaves onto their shardings (never aliasing the caller's buffers)."""
    return [jax.device_put(jnp.array(x, copy=True), s) for x, s in zip(leaves, shardings)]
