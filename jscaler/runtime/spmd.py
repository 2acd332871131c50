"""SpmdProgram: one jitted SPMD training step built from a lowered plan.

The step computes the loss with the plan's layouts, differentiates it with JAX, lays the
gradients out as the plan's ``grad`` ops say (accumulating over micro-batches), runs the
optax update in the ``update`` ops' layout (the optimizer state's), and stores the new
parameters in their storage layout. ZeRO-1/2/3 are these layouts, not separate code.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from jscaler.compile.comm import comm_table
from jscaler.compile.lower import Lowered
from jscaler.cost.cluster import Cluster
from jscaler.cost.estimate import Estimate, estimate
from jscaler.errors import PlanError
from jscaler.ir.graph import Graph
from jscaler.plan.plan import Plan
from jscaler.runtime.batch import accumulate, batch_leaves, microbatches, process_rows
from jscaler.runtime.program import guarded_update, initial_state, optimizer_shardings
from jscaler.runtime.state import TrainState, gather

__all__ = ["SpmdProgram"]


class SpmdProgram:
    """A :class:`~jscaler.runtime.program.Program` for a single-program plan.

    Args:
      graph: the traced graph (micro-batch shape).
      lowered: the plan, lowered onto the devices.
      optimizer: the optax transformation.
      master: the parameters' shapes and dtypes as the trainer stores them (fp32 masters
        under bf16 compute).
      microbatches, batch_shapes, precision: as :func:`jscaler.parallelize` was given.
      slots: the optimizer's per-parameter state arrays (for the memory estimate).
    """

    def __init__(
        self,
        graph: Graph,
        lowered: Lowered,
        optimizer: optax.GradientTransformation,
        master: list[jax.ShapeDtypeStruct],
        *,
        microbatches: int,
        batch_shapes: list[jax.ShapeDtypeStruct],
        precision: str = "fp32",
        slots: int = 0,
    ):
        self.graph, self.low, self.plan = graph, lowered, lowered.plan
        self.microbatches, self.batch_shapes, self.precision = microbatches, batch_shapes, precision
        self.optimizer, self.slots = optimizer, slots
        self.params_def = graph.signature.params_def
        self.batch_def = graph.signature.batch_def
        roles = [graph.tensors[t] for t in graph.inputs]
        n_p = sum(t.role == "param" for t in roles)
        n_s = sum(t.role == "state" for t in roles)
        shard = lowered.input_shardings()
        param_ids = [t for t in graph.inputs if graph.tensors[t].role == "param"]
        rep = NamedSharding(lowered.mesh, PartitionSpec())
        self.rep = rep
        opt_shard = optimizer_shardings(
            optimizer,
            self.tree(master),
            self.tree([lowered.sharding(lowered.update[t]) for t in param_ids]),
            rep,
        )
        self._shardings = TrainState(list(shard[:n_p]), opt_shard, list(shard[n_p : n_p + n_s]))
        self.batch_shardings = shard[n_p + n_s :]
        self.grad_layouts = [lowered.grad[t] for t in param_ids]
        self.update_layouts = [lowered.update[t] for t in param_ids]
        self.compute_dtypes = [t.dtype for t in roles if t.role == "param"]
        self.batch_dtypes = [t.dtype for t in roles if t.role == "batch"]
        # jitted here, traced and compiled at their first call
        sh = self._shardings
        self._step = jax.jit(
            self._update,
            in_shardings=(sh.params, sh.opt_state, sh.model_state, self.batch_shardings),
            out_shardings=(sh.params, sh.opt_state, sh.model_state, rep, rep, rep),
            donate_argnums=(0, 1, 2),
        )
        grad_shardings = [lowered.sharding(lay) for lay in self.grad_layouts]
        self._step_and_grads = jax.jit(  # the step, its gradients as outputs too
            functools.partial(self._update, keep_grads=True),
            in_shardings=(sh.params, sh.opt_state, sh.model_state, self.batch_shardings),
            out_shardings=(sh.params, sh.opt_state, sh.model_state, rep, rep, rep, grad_shardings),
            donate_argnums=(0, 1, 2),
        )
        self._grad = jax.jit(
            lambda p, s, b: (lambda r: (r[0], r[2]))(self._loss_and_grads(p, s, b)),
            in_shardings=(sh.params, sh.model_state, self.batch_shardings),
            out_shardings=(rep, grad_shardings),
        )
        self._eval = jax.jit(
            self._loss_only,
            in_shardings=(sh.params, sh.model_state, self.batch_shardings),
            out_shardings=rep,
        )

    def tree(self, leaves):
        """The parameters' pytree from their leaves."""
        return jax.tree_util.tree_unflatten(self.params_def, list(leaves))

    def shardings(self) -> TrainState:
        return self._shardings

    def init(self, params: list, model_state: list) -> TrainState:
        sh = self._shardings
        copy = lambda x, s: jax.device_put(jnp.array(x, copy=True), s)  # noqa: E731
        placed_state = [copy(x, s) for x, s in zip(model_state, sh.model_state)]
        return initial_state(self.optimizer, self.params_def, params, sh, placed_state)

    # ---- the step ------------------------------------------------------------------------

    def _loss_and_grads(self, params, state, batch):
        low, m = self.low, self.microbatches

        def one(params, state, mb):
            params = [p.astype(d) for p, d in zip(params, self.compute_dtypes)]
            mb = [x.astype(d) for x, d in zip(mb, self.batch_dtypes)]
            outs = low.forward(*params, *state, *mb)
            return outs[0].astype(jnp.float32), ([], list(outs[1:]))

        def reduce_grads(gs):
            return [
                jax.lax.with_sharding_constraint(g, low.sharding(lay))
                for g, lay in zip(gs, self.grad_layouts)
            ]

        loss, _, state, grads = accumulate(
            jax.value_and_grad(one, has_aux=True), params, state, batch,
            m=m, batch=range(len(batch)), shardings=self.batch_shardings, reduce=reduce_grads,
            loss_dtype=jnp.float32, aux_avals=[],
        )  # fmt: skip
        return loss, state, grads

    def _update(self, params, opt_state, state, batch, keep_grads=False):
        low = self.low
        loss, new_state, grads = self._loss_and_grads(params, state, batch)
        grad_norm = optax.tree.norm(grads)
        at = lambda xs: [  # noqa: E731
            jax.lax.with_sharding_constraint(x, low.sharding(lay))
            for x, lay in zip(xs, self.update_layouts)
        ]
        p_tree, g_tree = self.tree(at(params)), self.tree(at(grads))
        ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)  # else nothing changes: step() raises
        new, new_opt, new_state, ok = guarded_update(
            self.optimizer, p_tree, g_tree, opt_state, ok, (new_state, state)
        )
        out = jax.tree_util.tree_leaves(new), new_opt, new_state, loss, grad_norm, ok
        return (*out, grads) if keep_grads else out

    def put_batch(self, batch) -> list:
        """The batch's leaves, checked, on the plan's batch layouts (never donated)."""
        leaves = batch_leaves(batch, self.batch_def, self.batch_shapes)
        return [jax.device_put(x, s) for x, s in zip(leaves, self.batch_shardings)]

    def compiled(self, state: TrainState, batch):
        b = self.put_batch(batch)
        args = (state.params, state.opt_state, state.model_state, b)
        return self._step.lower(*args).compile()

    def step(self, state: TrainState, batch) -> tuple[TrainState, dict[str, float]]:
        new, metrics, _ = self._run_step(self._step, state, batch)
        return new, metrics

    def step_and_grads(self, state: TrainState, batch):
        new, metrics, (grads,) = self._run_step(self._step_and_grads, state, batch)
        return new, metrics, [gather(g) for g in grads]

    def _run_step(self, jitted, state: TrainState, batch):
        """``jitted`` (the step, or the step returning its gradients too) on ``state``:
        the next state, the metrics and what else it returned."""
        b = self.put_batch(batch)
        out = jitted(state.params, state.opt_state, state.model_state, b)
        (params, opt, model_state, loss, gnorm, done), extra = out[:6], out[6:]
        loss, gnorm, done = float(loss), float(gnorm), bool(done)  # not done: the old arrays
        new = TrainState(params, opt, model_state, state.step + done)
        return new, {"loss": loss, "grad_norm": gnorm}, extra

    def value_and_grad(self, state: TrainState, batch) -> tuple[float, list]:
        loss, grads = self._grad(state.params, state.model_state, self.put_batch(batch))
        return float(loss), [gather(g) for g in grads]

    def eval(self, state: TrainState, batch) -> dict[str, float]:
        loss = self._eval(state.params, state.model_state, self.put_batch(batch))
        return {"loss": float(loss)}

    def _loss_only(self, params, state, batch):
        low, m = self.low, self.microbatches

        def one(mb):
            p = [x.astype(d) for x, d in zip(params, self.compute_dtypes)]
            mb = [x.astype(d) for x, d in zip(mb, self.batch_dtypes)]
            return low.forward(*p, *state, *mb)[0].astype(jnp.float32)

        if m == 1:
            return one(batch)
        split = [microbatches(b, m) for b in batch]
        losses = jax.lax.map(lambda i: one([b[:, i] for b in split]), jnp.arange(m))
        return losses.mean()

    # ---- multi-process batches -------------------------------------------------------------

    def global_batch(self, local_batch):
        leaves, tdef = jax.tree_util.tree_flatten(local_batch)
        out = []
        for i, (x, sh, want) in enumerate(zip(leaves, self.batch_shardings, self.batch_shapes)):
            start, stop = process_rows(sh, tuple(want.shape), self.plan.name)
            if x.shape[0] != stop - start:
                raise PlanError(
                    f"local batch leaf {i} has {x.shape[0]} rows; under the plan "
                    f"{self.plan.name!r} this process holds rows {start}:{stop} of "
                    f"{want.shape[0]} (see trainer.local_rows)"
                )
            out.append(jax.make_array_from_process_local_data(sh, np.asarray(x), want.shape))
        return jax.tree_util.tree_unflatten(tdef, out)

    def local_rows(self, batch_size: int | None = None) -> tuple[int, int]:
        want = tuple(self.batch_shapes[0].shape)
        if batch_size is not None:
            want = (batch_size, *want[1:])
        return process_rows(self.batch_shardings[0], want, self.plan.name)

    # ---- predictions -----------------------------------------------------------------------

    def comm_table(self):
        return comm_table(self.low, self.microbatches)

    @staticmethod
    def predict(
        plan: Plan, cluster, *, microbatches: int, precision: str, slots: int, schedule=None,
        expert_skew: float = 1.0,
    ) -> Estimate:  # fmt: skip
        """The cost model's step for ``plan`` (before anything is lowered)."""
        dtype = "bf16" if precision == "bf16" else "fp32"
        return estimate(
            plan, cluster, dtype=dtype, microbatches=microbatches, optimizer_slots=slots,
            expert_skew=expert_skew,
        )  # fmt: skip

    def estimate(self, cluster: str | Cluster, expert_skew: float = 1.0) -> Estimate:
        return self.predict(
            self.plan, cluster, microbatches=self.microbatches, precision=self.precision,
            slots=self.slots, expert_skew=expert_skew,
        )  # fmt: skip

    def timeline(self, path: str, cluster: str | Cluster) -> Estimate:
        from jscaler.report.timeline import write_spmd_timeline

        est = self.estimate(cluster)
        write_spmd_timeline(self.plan, est, path, self.precision, self.microbatches)
        return est
