"""PipelineTrainer: stages on device groups, a driver walking the schedule, one update.

The driver dispatches the schedule's blocks in an order that respects their data
dependencies and every group's own order (:meth:`Schedule.order`); JAX dispatches each
program asynchronously, so groups run concurrently. Activations and their gradients move
between groups' meshes with ``jax.device_put``. Parameter gradients accumulate per stage
over micro-batches; a parameter read by several stages (a tied embedding and LM head)
lives on each of them and its gradients are summed.

The optimizer sees the whole tree in one program over every pipeline device: master
parameters and optimizer state are sharded over all of them (ZeRO-1 across the
pipeline), so transforms such as ``clip_by_global_norm`` see every gradient. After the
update each stage receives its parameters back in its storage layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from jscaler.compile.lower import lower
from jscaler.errors import PlanError, ScheduleError
from jscaler.ir.graph import Graph
from jscaler.plan.pipeline import PipelinePlan, pass_of_ops, stage_of_ops
from jscaler.plan.schedule import Block, Schedule
from jscaler.runtime.checkpoint import Checkpointable
from jscaler.runtime.distributed import peer_failures_as_errors
from jscaler.runtime.handoff import handoff_for
from jscaler.runtime.stages import Stage, build_stages
from jscaler.runtime.trainer import batch_key, batch_leaves, check_finite, microbatches

__all__ = ["DriverLog", "PipelineTrainer"]


@dataclass
class DriverLog:
    """What the driver ran in the last step: blocks per group in dispatch order, and the
    most forward residual sets (activations kept for a backward) alive at once per stage."""

    blocks: list[list[Block]] = field(default_factory=list)
    in_flight: list[int] = field(default_factory=list)


class PipelineTrainer(Checkpointable):
    """Trains a model under a pipeline plan and schedule. Made by :func:`jscaler.parallelize`.

    Same interface as :class:`Trainer`: ``step``, ``value_and_grad``, ``params``,
    ``model``; plus ``schedule``, ``stages`` and ``log`` (the last step's :class:`DriverLog`).
    """

    def __init__(
        self,
        graph: Graph,
        pplan: PipelinePlan,
        schedule: Schedule,
        devices: list,
        optimizer: optax.GradientTransformation,
        model_or_params,
        batch_shapes: list[jax.ShapeDtypeStruct],
        precision: str = "fp32",
        *,
        replan=None,
    ):
        self._build(graph, pplan, schedule, devices)
        self._devices = devices
        self._replan = replan
        self._variants: dict = {}
        self._key = batch_key(batch_shapes)
        self.precision = precision
        self._optimizer = optimizer
        self._batch_shapes = batch_shapes
        self._graphdef = self._sig.graphdef if self._sig.kind == "nnx" else None
        self.step_count = 0
        self.cluster = None  # set by parallelize: the cluster= it was given
        self.optimizer_slots = 0  # set by parallelize: the optimizer's per-parameter state
        p_leaves, s_leaves = self._sig.split(model_or_params)
        self._master = [
            jax.device_put(np.array(x), s) for x, s in zip(p_leaves, self._master_shard)
        ]
        tree = self._tree(self._master)
        abstract = jax.eval_shape(optimizer.init, tree)
        self._opt_shard = optax.tree_map_params(
            optimizer,
            lambda _, s: s,
            abstract,
            self._tree(self._master_shard),
            transform_non_params=lambda _: self._rep,
        )
        self._opt_state = jax.jit(optimizer.init, out_shardings=self._opt_shard)(tree)
        self._state = dict(zip(self._state_ids, [np.asarray(x) for x in s_leaves]))
        by_id = dict(zip(self._param_ids, p_leaves))
        self._stage_params = [
            [jax.device_put(np.array(by_id[t]), st.sharding(t)) for t in st.params]
            for st in self.stages
        ]
        self._stage_state = [
            [jax.device_put(self._state[t], st.sharding(t)) for t in st.state] for st in self.stages
        ]
        self._update_fn = None

    def _build(self, graph: Graph, pplan: PipelinePlan, schedule: Schedule, devices: list):
        """The stage programs, the driver's order and the handoff to the update mesh (no
        parameters yet: ``_stage_params`` and ``_stage_state`` are set by the caller)."""
        if len(schedule.groups) != len(pplan.groups):
            raise ScheduleError(
                f"schedule {schedule.name!r} runs on {len(schedule.groups)} device groups; "
                f"the plan {pplan.name!r} has {len(pplan.groups)}"
            )
        if len(graph.outputs) != 1:
            raise PlanError(
                "pipelines train models without mutable state (the loss function updates "
                f"{len(graph.outputs) - 1} state variable(s)); use a plan without pp"
            )
        schedule.check()
        self.graph = graph
        self.pplan = pplan
        self.plan = pplan  # what tables and the CLI print
        self.schedule = schedule
        self._m = schedule.microbatches
        self._sig = graph.signature
        lowered = [lower(g.plan, [devices[d] for d in g.devices]) for g in pplan.groups]
        pass_of = pass_of_ops(graph, schedule.passes)
        stage_of = stage_of_ops(graph, schedule.stages, pplan.cuts, pass_of)
        dtypes = {t: graph.tensors[t].dtype for t in graph.inputs}
        # one program set per (pass, stage); the last pass's are the stages proper
        self._programs = build_stages(lowered, schedule.placement, stage_of, dtypes, pass_of)
        self.stages: list[Stage] = self._programs[-schedule.stages :]
        self._order = [b for rnd in schedule.order() for b in rnd]
        self._producer = {t: st.index for st in self._programs for t in st.acts_out}
        self.log = DriverLog()
        self._param_ids = [t for t in graph.inputs if graph.tensors[t].role == "param"]
        self._state_ids = [t for t in graph.inputs if graph.tensors[t].role == "state"]
        self._batch_ids = [t for t in graph.inputs if graph.tensors[t].role == "batch"]
        read = {t for st in self.stages for t in st.params}
        unused = [graph.tensors[t].name for t in self._param_ids if t not in read]
        if unused:
            raise PlanError(f"parameter {unused[0]!r} is read by no stage")
        # the update runs on every pipeline device (see jscaler.runtime.handoff)
        shapes = [graph.tensors[t].shape for t in self._param_ids]
        self._handoff = handoff_for(
            self.stages, devices, pplan, self._param_ids, shapes, stacked=_multi_process()
        )
        self._rep = self._handoff.rep
        self._master_shard = self._handoff.master

    _BUILT = (
        "graph", "pplan", "plan", "schedule", "_m", "_sig", "_programs", "stages", "_order",
        "_producer", "log", "_param_ids", "_state_ids", "_batch_ids", "_handoff", "_rep",
        "_master_shard", "_batch_shapes", "_update_fn",
    )  # fmt: skip

    def _for_batch(self, batch) -> None:
        """Switches to the stages for this batch's shapes: a new shape is planned (from the
        space given to ``parallelize``) and built once, then cached; the master parameters
        and optimizer state move to its update layout if it differs, and every stage gets
        its parameters from them."""
        leaves = jax.tree_util.tree_leaves(batch)
        key = batch_key(leaves)
        if key == self._key or self._replan is None or len(leaves) != len(self._batch_ids):
            return  # same shape, or batch_leaves explains the mismatch
        self._variants[self._key] = {a: getattr(self, a) for a in self._BUILT}
        attrs = self._variants.get(key)
        if attrs is None:
            graph, pplan, schedule, shapes = self._replan(batch)
            self._build(graph, pplan, schedule, self._devices)
            self._batch_shapes, self._update_fn = shapes, None
        else:
            for a, v in attrs.items():
                setattr(self, a, v)
        self._key = key
        self._master = [jax.device_put(x, s) for x, s in zip(self._master, self._master_shard)]
        opt_shard = optax.tree_map_params(
            self._optimizer, lambda _, s: s, self._opt_state,
            self._tree(self._master_shard), transform_non_params=lambda _: self._rep,
        )  # fmt: skip
        self._opt_shard = opt_shard
        self._opt_state = jax.device_put(self._opt_state, opt_shard)
        stacked = jax.jit(self._handoff.broadcast)(self._master)
        self._stage_params = self._handoff.stage_params(self._master, stacked)
        self._stage_state = [
            [jax.device_put(self._state[t], st.sharding(t)) for t in st.state] for st in self.stages
        ]

    # ---- trees --------------------------------------------------------------------------

    def _tree(self, leaves):
        return jax.tree_util.tree_unflatten(self._sig.params_def, list(leaves))

    @property
    def params(self):
        """The current parameters, gathered to full arrays (nnx State or your pytree)."""
        return self._tree(
            [np.asarray(multihost_utils.process_allgather(p, tiled=True)) for p in self._master]
        )

    @property
    def model(self):
        """For an nnx model: a new model holding the current parameters and state."""
        if self._sig.kind != "nnx":
            raise TypeError("model is for nnx models; use .params for a params pytree")
        state = jax.tree_util.tree_unflatten(
            self._sig.state_def, [self._state[t] for t in self._state_ids]
        )
        return nnx.merge(self._graphdef, self.params, state)

    # ---- the driver ---------------------------------------------------------------------

    def _split_batch(self, batch) -> list[list]:
        """Per stage program, per micro-batch: the batch leaves it reads, on its mesh.
        Micro-batch j holds rows j, j+m, j+2m, ... (as the single-program trainer)."""
        leaves = batch_leaves(batch, self._sig, self._batch_shapes)
        m = self._m
        host = {t: microbatches(np.asarray(x), m) for t, x in zip(self._batch_ids, leaves)}
        return [
            [[jax.device_put(host[t][:, j], st.sharding(t)) for t in st.batch] for j in range(m)]
            for st in self._programs
        ]

    def _run(self, batch):
        """Runs every block of the schedule; returns (mean loss, per-param gradient
        contributions, one per stage reading the param)."""
        m, programs, n = self._m, self._programs, self.schedule.stages
        last = len(programs) - n  # index of the last pass's stage 0
        mb = self._split_batch(batch)
        acts: dict = {}  # (tensor, microbatch, consumer stage) -> value on its mesh
        cots: dict = {}  # (tensor, microbatch, consumer stage) -> cotangent on producer mesh
        res: dict = {}  # (stage, microbatch) -> residuals
        saved: dict = {}  # (stage, microbatch) -> forward inputs of a recomputed block
        wcot: dict = {}  # (stage, microbatch) -> output cotangents kept for W
        grads: dict = {}  # stage index -> accumulated parameter gradients
        losses = []
        log = DriverLog([[] for _ in self.schedule.groups], [0] * n)
        alive = [0] * n
        seed = np.float32(1.0 / m)  # a host value: every process places its own copy

        def inputs(st, j):
            a = [acts.pop((t, j, st.index)) for t in st.acts_in]
            f = [acts.pop((t, j, st.index)) for t in st.frozen]
            s = st.stage
            return self._stage_params[s], a, f, self._stage_state[s], mb[st.index][j]

        def keep(st, j, r):
            res[(st.stage, j)] = r
            alive[st.stage] += 1
            log.in_flight[st.stage] = max(log.in_flight[st.stage], alive[st.stage])

        def send(st, j, out_acts, outs):
            for t, v in zip(st.acts_out, out_acts):
                for c in st.consumers[t]:
                    acts[(t, j, c)] = jax.device_put(v, programs[c].sharding(t))
            losses.extend(outs[:1])

        def add_grads(st, g):
            grads[st.index] = _add_lists(grads[st.index], g) if st.index in grads else g

        def out_cot(st, j):
            ca = [_sum([cots.pop((t, j, c)) for c in st.consumers[t]]) for t in st.acts_out]
            if not st.outputs:
                return ca, []
            one = jax.device_put(seed, NamedSharding(st.low.mesh, PartitionSpec()))
            return ca, [one] * len(st.outputs)

        def send_back(st, j, d_acts):
            for t, v in zip(st.acts_in, d_acts):
                src = programs[self._producer[t]]
                # same layout on this mesh first: across processes, device_put moves an
                # array between device sets only shard for shard
                v = jax.device_put(v, st.sharding(t))
                cots[(t, j, st.index)] = jax.device_put(v, src.sharding(t))

        for b in self._order:
            j = b.microbatch
            st = programs[b.pass_ * n + b.stage] if b.kind == "F" else programs[last + b.stage]
            log.blocks[st.group].append(b)
            if b.kind == "F":
                args = inputs(st, j)
                if st.index < last:  # an earlier forward pass: no gradient, nothing kept
                    send(st, j, *st.forward(*args))
                elif self.schedule.recomputed(b.stage, j):
                    saved[(b.stage, j)] = args
                    send(st, j, *st.forward(*args))
                else:
                    (out_acts, outs), r = st.forward_res(*args)
                    keep(st, j, r)
                    send(st, j, out_acts, outs)
            elif b.kind == "R":
                _, r = st.forward_res(*saved.pop((b.stage, j)))
                keep(st, j, r)
            elif b.kind == "B":
                cot = out_cot(st, j)
                if self.schedule.split_backward:
                    d_acts = st.backward_input(res[(b.stage, j)], cot)
                    wcot[(b.stage, j)] = cot
                else:
                    d_params, d_acts = st.backward(res.pop((b.stage, j)), cot)
                    alive[b.stage] -= 1
                    add_grads(st, d_params)
                send_back(st, j, d_acts)
            else:  # W
                d_params = st.backward_weight(res.pop((b.stage, j)), wcot.pop((b.stage, j)))
                alive[b.stage] -= 1
                add_grads(st, d_params)
        self.log = log
        return self._handoff.scalar(_sum(losses)) / m, grads

    # ---- the update ---------------------------------------------------------------------

    def _build_update(self):
        def update(master, opt_state, contributions):
            g = [self._handoff.reduce(parts) for parts in contributions]
            grad_norm = optax.tree.norm(g)
            p_tree, g_tree = self._tree(master), self._tree(g)
            updates, new_opt = self._optimizer.update(g_tree, opt_state, p_tree)
            new = jax.tree_util.tree_leaves(optax.apply_updates(p_tree, updates))
            # a NaN/inf gradient leaves everything as it was (step() raises)
            ok = jnp.isfinite(grad_norm)
            keep = lambda a, b: jax.tree_util.tree_map(lambda x, y: jnp.where(ok, x, y), a, b)  # noqa: E731
            new, new_opt = keep(new, master), keep(new_opt, opt_state)
            return new, new_opt, grad_norm, self._handoff.broadcast(new)

        return jax.jit(
            update,
            out_shardings=(self._master_shard, self._opt_shard, self._rep, None),
            donate_argnums=(0, 1),
        )

    @peer_failures_as_errors
    def step(self, batch) -> dict[str, float]:
        """One training step: ``{"loss", "grad_norm"}`` (loss before the update).

        Raises:
          NonFiniteLossError: the loss or a gradient is NaN or infinite; the update was
            not applied (a NaN loss is caught before the update runs).
        """
        self._for_batch(batch)
        loss, grads = self._run(batch)
        check_finite(float(loss), 0.0, self.step_count + 1)
        if self._update_fn is None:
            self._update_fn = self._build_update()
        self._master, self._opt_state, gnorm, stacked = self._update_fn(
            self._master, self._opt_state, self._handoff.gradients(grads)
        )
        self._stage_params = self._handoff.stage_params(self._master, stacked)
        gnorm = float(np.asarray(gnorm.addressable_data(0)))
        check_finite(float(loss), gnorm, self.step_count + 1)
        self.step_count += 1
        return {"loss": float(loss), "grad_norm": gnorm}

    def value_and_grad(self, batch):
        """Loss and gathered gradients at the current parameters, without an update."""
        self._for_batch(batch)
        loss, grads = self._run(batch)
        total = [self._handoff.gathered(parts) for parts in self._handoff.gradients(grads)]
        return loss, self._tree(total)

    def eval(self, batch) -> dict[str, float]:
        """The loss on ``batch`` at the current parameters, without an update (the
        schedule runs, its gradients are dropped): ``{"loss"}``."""
        self._for_batch(batch)
        loss, _ = self._run(batch)
        return {"loss": float(loss)}

    def export(self):
        """The trained model as plain host arrays gathered from every device and process:
        for an nnx model an ``nnx.State`` of all its variables (``nnx.update(model,
        trainer.export())``), else the params pytree."""
        if self._sig.kind != "nnx":
            return self.params
        state = [self._state[t] for t in self._state_ids]
        return nnx.merge_state(
            self.params, jax.tree_util.tree_unflatten(self._sig.state_def, state)
        )

    def estimate(self, cluster=None):
        """The cost model's prediction of this pipeline's step (:class:`jscaler.Estimate`)
        on ``cluster`` (default ``cpu``); its ``timeline`` holds the blocks' spans."""
        from jscaler.runtime.preflight import predict

        return predict(
            self.pplan, cluster or self.cluster or "cpu", microbatches=self._m,
            schedule=self.schedule, precision=self.precision, slots=self.optimizer_slots,
        )  # fmt: skip

    def timeline(self, path: str, cluster=None):
        """Writes the schedule's blocks at the durations the cost model predicts on
        ``cluster``, one lane per device group, as a Chrome trace (``.json``) or a PNG
        (``.png``); SIMULATED. Returns the :class:`jscaler.Estimate`."""
        from jscaler.runtime.timeline import write_pipeline_timeline

        est = self.estimate(cluster)
        title = (
            f"{self.pplan.name} / {self.schedule.name} on {est.devices} x {est.cluster}: "
            f"bubble {est.bubble:.1%}, SIMULATED by the cost model"
        )
        write_pipeline_timeline(est.timeline, path, title)
        return est

    def comm_table(self):
        raise PlanError("comm_table() covers single-program plans; a pipeline has one per group")


def _sum(values):
    """Sums arrays on one mesh (cotangents from several consumers, the micro-batches'
    losses); a single value is returned as it is."""
    total = values[0]
    for v in values[1:]:
        total = _add(total, v)
    return total


@jax.jit
def _add(a, b):
    return a + b


@jax.jit
def _add_lists(a, b):
    return [x + y for x, y in zip(a, b)]


def _multi_process() -> bool:
    return jax.process_count() > 1
