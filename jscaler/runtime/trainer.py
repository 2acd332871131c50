"""Trainer: one jitted SPMD training step built from a lowered plan.

The step computes the loss with the plan's layouts, differentiates it with JAX, lays the
gradients out as the plan's ``grad`` ops say (accumulating over micro-batches), runs the
optax update in the ``update`` ops' layout (the optimizer state's), and stores the new
parameters in their storage layout. ZeRO-1/2/3 are these layouts, not separate code.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jscaler.compile.lower import Lowered
from jscaler.cost.cluster import Cluster
from jscaler.errors import NonFiniteLossError, PlanError
from jscaler.ir.graph import Graph
from jscaler.runtime.checkpoint import Checkpointable
from jscaler.runtime.distributed import peer_failures_as_errors

__all__ = ["Trainer"]


class Trainer(Checkpointable):
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
        *,
        replan: Callable | None = None,
        cluster: Cluster | None = None,
        optimizer_slots: int = 0,
    ):
        self.precision = precision
        self.cluster = cluster
        self._optimizer = optimizer
        self._optimizer_slots = optimizer_slots
        self._m = microbatches
        self._sig = graph.signature
        self._replan = replan
        self._graphdef = None
        p_leaves, s_leaves = self._sig.split(model_or_params)
        if self._sig.kind == "nnx":
            self._graphdef = self._sig.graphdef
        self._n_p, self._n_s = len(p_leaves), len(s_leaves)
        self._master_dtypes = [x.dtype for x in p_leaves]
        self._variants: dict = {}
        self._key = None
        self._use(batch_key(batch_shapes), self._layouts(graph, lowered, batch_shapes))
        self._params = _place(p_leaves, self._p_shard)
        self._state = _place(s_leaves, self._s_shard)
        params_tree = self._tree(self._params)
        self._opt_state = jax.jit(optimizer.init, out_shardings=self._opt_shard)(params_tree)
        self.step_count = 0

    def _layouts(self, graph: Graph, lowered: Lowered, batch_shapes) -> dict:
        """Everything that depends on the batch shape: the plan, its lowering, the
        shardings of parameters, state, batch and optimizer state, the compiled steps."""
        shard = lowered.input_shardings()
        p_shard = shard[: self._n_p]
        abstract = [
            jax.ShapeDtypeStruct(t.shape, d) for t, d in zip(graph.params(), self._master_dtypes)
        ]
        abstract_opt = jax.eval_shape(self._optimizer.init, self._tree(abstract))
        param_ids = [t for t in graph.inputs if graph.tensors[t].role == "param"]
        upd = self._tree([lowered.sharding(lowered.update[t]) for t in param_ids])
        rep = NamedSharding(lowered.mesh, PartitionSpec())
        roles = [graph.tensors[t] for t in graph.inputs]
        return {
            "graph": graph,
            "plan": lowered.plan,
            "_low": lowered,
            "_batch_shapes": batch_shapes,
            "_p_shard": p_shard,
            "_s_shard": shard[self._n_p : self._n_p + self._n_s],
            "_b_shard": shard[self._n_p + self._n_s :],
            "_opt_shard": optax.tree_map_params(
                self._optimizer,
                lambda _, s: s,
                abstract_opt,
                upd,
                transform_non_params=lambda _: rep,
            ),
            "_grad_layouts": [lowered.grad[t] for t in param_ids],
            "_upd_layouts": [lowered.update[t] for t in param_ids],
            "_p_dtypes": [t.dtype for t in roles if t.role == "param"],
            "_b_dtypes": [t.dtype for t in roles if t.role == "batch"],
            "_step_fn": None,
            "_grad_fn": None,
            "_eval_fn": None,
        }

    def _use(self, key, attrs: dict) -> None:
        """Makes one batch shape's layouts and compiled steps the current ones."""
        if self._key is not None:
            self._variants[self._key] = {a: getattr(self, a) for a in attrs}
        for a, v in attrs.items():
            setattr(self, a, v)
        self._key = key

    def _for_batch(self, batch) -> None:
        """Switches to the step for this batch's shapes: a new shape is planned (from the
        space given to ``parallelize``), lowered and compiled once, then cached; the
        parameters and optimizer state move to its layouts if they differ."""
        leaves = jax.tree_util.tree_leaves(batch)
        key = batch_key(leaves)
        if key == self._key or self._replan is None or len(leaves) != len(self._b_shard):
            return  # same shape, or batch_leaves explains the mismatch
        attrs = self._variants.get(key)
        if attrs is None:
            graph, lowered, shapes = self._replan(batch)
            attrs = self._layouts(graph, lowered, shapes)
        before = (self._p_shard, self._s_shard, self._opt_shard)
        self._use(key, attrs)
        if before != (self._p_shard, self._s_shard, self._opt_shard):
            self._params = [jax.device_put(x, s) for x, s in zip(self._params, self._p_shard)]
            self._state = [jax.device_put(x, s) for x, s in zip(self._state, self._s_shard)]
            self._opt_state = jax.device_put(self._opt_state, self._opt_shard)

    # ---- trees -----------------------------------------------------------------------

    def _tree(self, p_leaves):
        return jax.tree_util.tree_unflatten(self._sig.params_def, list(p_leaves))

    @property
    def params(self):
        """The current parameters, gathered to full arrays: an nnx model's Params State,
        your params pytree, or linen variables' ``"params"`` collection."""
        return self._tree([_gather(p) for p in self._params])

    def shardings(self):
        """The NamedSharding each parameter is stored with, in the parameters' structure."""
        return self._tree(self._p_shard)

    @property
    def model(self):
        """For an nnx model: a new model holding the current parameters and state."""
        if self._sig.kind != "nnx":
            raise TypeError(
                "model is for nnx models; use .params for a params pytree, .variables for "
                "linen variables (has_aux=True)"
            )
        state = [_gather(s) for s in self._state]
        state = jax.tree_util.tree_unflatten(self._sig.state_def, state)
        return nnx.merge(self._graphdef, self.params, state)

    @property
    def variables(self) -> dict:
        """For linen variables (``has_aux=True``): ``{"params": ..., <collection>: ...}``
        with the current parameters and collections (``.params`` is the ``"params"``
        tree alone)."""
        return self._sig.variables(self.params, [_gather(s) for s in self._state])

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
            loss, new_state, grads = self._loss_and_grads(params, state, batch)
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
            updates, new_opt = self._optimizer.update(g_tree, opt_state, p_tree)
            new = jax.tree_util.tree_leaves(optax.apply_updates(p_tree, updates))
            # a NaN/inf loss or gradient leaves everything as it was (step() raises)
            ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
            keep = lambda a, b: jax.tree_util.tree_map(lambda x, y: jnp.where(ok, x, y), a, b)  # noqa: E731
            return (
                keep(new, params),
                keep(new_opt, opt_state),
                keep(new_state, state),
                loss,
                grad_norm,
            )

        rep = NamedSharding(low.mesh, PartitionSpec())
        return jax.jit(
            step,
            in_shardings=(self._p_shard, self._opt_shard, self._s_shard, self._b_shard),
            out_shardings=(self._p_shard, self._opt_shard, self._s_shard, rep, rep),
            donate_argnums=(0, 1, 2),
        )

    def _put_batch(self, batch) -> list:
        leaves = batch_leaves(batch, self._sig, self._batch_shapes)
        return [jax.device_put(x, sh) for x, sh in zip(leaves, self._b_shard)]  # not donated

    def compiled(self, batch):
        """The compiled training step for this batch: ``.as_text()`` shows the collectives
        XLA emitted, ``.memory_analysis()`` the per-device memory."""
        self._for_batch(batch)
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

    @peer_failures_as_errors
    def step(self, batch) -> dict[str, float]:
        """One training step: ``{"loss", "grad_norm"}`` (loss before the update).

        Raises:
          NonFiniteLossError: the loss or a gradient is NaN or infinite; the update was not
            applied, so the parameters and optimizer state are those before this step.
        """
        self._for_batch(batch)
        if self._step_fn is None:
            self._step_fn = self._build_step()
        b = self._put_batch(batch)
        self._params, self._opt_state, self._state, loss, gnorm = self._step_fn(
            self._params, self._opt_state, self._state, b
        )
        loss, gnorm = float(loss), float(gnorm)
        check_finite(loss, gnorm, self.step_count + 1)
        self.step_count += 1
        return {"loss": loss, "grad_norm": gnorm}

    def global_batch(self, local_batch):
        """The global batch, in the plan's batch layout, from this process's rows.

        In a multi-process run each process loads only the rows its own devices hold
        under the plan (:meth:`local_rows`: process ``i`` of ``P`` gets rows ``i*B/P ...
        (i+1)*B/P`` of a batch of ``B`` rows under every space whose outer mesh axis is
        ``dp``), and ``jax.make_array_from_process_local_data`` assembles the global arrays
        without any process reading the others' data. In one process it is the batch.

        Example::

            start, stop = trainer.local_rows(global_batch_size)
            trainer.step(trainer.global_batch(load_rows(start, stop)))

        Raises:
          PlanError: the plan does not split the batch across processes (``megatron(tp=8)``
            over two hosts replicates it: pass the whole batch), or the rows do not fit.
        """
        leaves, tdef = jax.tree_util.tree_flatten(local_batch)
        if len(leaves) != len(self._b_shard):
            raise PlanError(
                f"the local batch has {len(leaves)} leaves; the trainer was made for "
                f"{len(self._b_shard)}: pass this process's rows of a batch of the same "
                f"structure as the example batch"
            )
        n = jax.process_count()
        full = [jax.ShapeDtypeStruct((x.shape[0] * n, *x.shape[1:]), x.dtype) for x in leaves]
        self._for_batch(full)  # a new shape plans its own layouts first
        out = []
        for i, (x, sh, want) in enumerate(zip(leaves, self._b_shard, self._batch_shapes)):
            start, stop = _rows(sh, tuple(want.shape), self.plan.name)
            if x.shape[0] != stop - start:
                raise PlanError(
                    f"local batch leaf {i} has {x.shape[0]} rows; under the plan "
                    f"{self.plan.name!r} this process holds rows {start}:{stop} of "
                    f"{want.shape[0]} (see trainer.local_rows)"
                )
            out.append(jax.make_array_from_process_local_data(sh, np.asarray(x), want.shape))
        return jax.tree_util.tree_unflatten(tdef, out)

    def local_rows(self, batch_size: int | None = None) -> tuple[int, int]:
        """``(start, stop)``: the rows of a global batch of ``batch_size`` rows (default the
        example batch's) that this process's devices hold under the plan."""
        want = tuple(self._batch_shapes[0].shape)
        if batch_size is not None:
            want = (batch_size, *want[1:])
        return _rows(self._b_shard[0], want, self.plan.name)

    def eval(self, batch) -> dict[str, float]:
        """The loss on ``batch`` at the current parameters, without an update (the forward
        only, under the same plan; model state such as BatchNorm statistics is not
        updated either): ``{"loss"}``."""
        self._for_batch(batch)
        if self._eval_fn is None:
            rep = NamedSharding(self._low.mesh, PartitionSpec())
            self._eval_fn = jax.jit(
                self._loss_only,
                in_shardings=(self._p_shard, self._s_shard, self._b_shard),
                out_shardings=rep,
            )
        return {"loss": float(self._eval_fn(self._params, self._state, self._put_batch(batch)))}

    def _loss_only(self, params, state, batch):
        low, m = self._low, self._m

        def one(mb):
            p = [x.astype(d) for x, d in zip(params, self._p_dtypes)]
            mb = [x.astype(d) for x, d in zip(mb, self._b_dtypes)]
            return low.forward(*p, *state, *mb)[0].astype(jnp.float32)

        if m == 1:
            return one(batch)
        split = [microbatches(b, m) for b in batch]
        losses = jax.lax.map(lambda i: one([b[:, i] for b in split]), jnp.arange(m))
        return losses.mean()

    def export(self):
        """The trained model as plain host arrays, gathered from every device (and every
        process): for an nnx model an ``nnx.State`` of all its variables (load it with
        ``nnx.update(model, trainer.export())``), for a params pytree the pytree, for
        linen variables (``has_aux=True``) the variables with every collection."""
        params = self._tree([_gather(p) for p in self._params])
        if self._sig.kind == "linen":
            return self._sig.variables(params, [_gather(s) for s in self._state])
        if self._sig.kind != "nnx":
            return params
        state = jax.tree_util.tree_unflatten(self._sig.state_def, [_gather(s) for s in self._state])
        return nnx.merge_state(params, state)

    def estimate(self, cluster: str | Cluster | None = None):
        """The cost model's prediction of this plan's step (:class:`jscaler.Estimate`) on
        ``cluster`` (default: the one given to ``parallelize``, else ``cpu``)."""
        from jscaler.runtime.preflight import predict

        return predict(
            self.plan, cluster or self.cluster or "cpu", microbatches=self._m,
            precision=self.precision, slots=self._optimizer_slots,
        )  # fmt: skip

    def timeline(self, path: str, cluster: str | Cluster | None = None):
        """Writes the plan's step as a timeline, SIMULATED by the cost model on ``cluster``:
        one lane per device, each op's forward and backward and the step's collectives, as
        a Chrome trace (``.json``: open it in https://ui.perfetto.dev) or a PNG
        (``.png``). Returns the :class:`jscaler.Estimate` it drew. For a measured trace,
        run steps under ``jax.profiler.trace(dir)`` (``jscaler train --profile DIR``)."""
        from jscaler.runtime.timeline import write_spmd_timeline

        est = self.estimate(cluster)
        write_spmd_timeline(self.plan, est, path, self.precision, self._m)
        return est

    def value_and_grad(self, batch):
        """Loss and gathered gradients at the current parameters, without an update."""
        self._for_batch(batch)
        if self._grad_fn is None:
            rep = NamedSharding(self._low.mesh, PartitionSpec())
            self._grad_fn = jax.jit(
                lambda p, s, b: (lambda r: (r[0], r[2]))(self._loss_and_grads(p, s, b)),
                in_shardings=(self._p_shard, self._s_shard, self._b_shard),
                out_shardings=(rep, [self._low.sharding(lay) for lay in self._grad_layouts]),
            )
        loss, grads = self._grad_fn(self._params, self._state, self._put_batch(batch))
        return float(loss), self._tree([_gather(g) for g in grads])


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


def check_finite(loss: float, grad_norm: float, step: int) -> None:
    """Raises :class:`NonFiniteLossError` for a NaN or infinite loss or gradient norm."""
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return
    what = "loss" if not math.isfinite(loss) else "gradient norm"
    raise NonFiniteLossError(
        f"step {step}: the {what} is {loss if what == 'loss' else grad_norm} (loss {loss}, "
        f"gradient norm {grad_norm}); the update was not applied, the parameters are those "
        f"after step {step - 1}. Lower the learning rate, clip gradients "
        f"(optax.clip_by_global_norm), check the batch for NaNs, or compute in fp32",
        step,
    )


def _rows(sharding, shape: tuple, plan: str) -> tuple[int, int]:
    """The contiguous block of rows this process's devices hold of an array of ``shape``
    laid out by ``sharding``; a PlanError when the rows are replicated across processes
    or not one block."""
    spans = {
        idx[0].indices(shape[0])[:2]
        for idx in sharding.addressable_devices_indices_map(shape).values()
    }
    start, stop = min(a for a, _ in spans), max(b for _, b in spans)
    covered = sum(b - a for a, b in spans)
    if jax.process_count() > 1 and stop - start == shape[0]:
        raise PlanError(
            f"the plan {plan!r} does not split the batch across processes (every process "
            f"holds all {shape[0]} rows); pass the whole batch to step(), or use a plan "
            f"whose outer mesh axis is data parallel"
        )
    if covered < stop - start and len(spans) > 1:
        raise PlanError(
            f"under the plan {plan!r} this process holds rows {sorted(spans)} of "
            f"{shape[0]}, not one block; pass the whole batch to step()"
        )
    return start, stop


def _gather(x):
    """A global array as one host numpy array, whichever process holds its shards (a
    PRNG key array stays a key array, gathered through its key data)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = _gather(jax.random.key_data(x))
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    if jax.process_count() > 1 and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def batch_key(leaves) -> tuple:
    """What identifies a batch's compiled step: each leaf's shape and canonical dtype."""
    return tuple((tuple(x.shape), str(jax.dtypes.canonicalize_dtype(x.dtype))) for x in leaves)


def microbatches(x, m: int):
    """(B, ...) -> (B/m, m, ...): micro-batch j is rows j, j+m, j+2m, ... (local to each
    data-parallel shard, so splitting needs no communication)."""
    return x.reshape(x.shape[0] // m, m, *x.shape[1:])


def _place(leaves, shardings) -> list:
    """Copies leaves onto their shardings (never aliasing the caller's buffers)."""
    return [jax.device_put(jnp.array(x, copy=True), s) for x, s in zip(leaves, shardings)]
