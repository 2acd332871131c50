"""PipelineProgram: stages on device groups, a driver walking the schedule, one update.

The :class:`StageDriver` dispatches the schedule's blocks in an order that respects their
data dependencies and every group's own order (:meth:`Schedule.order`); JAX dispatches
each program asynchronously, so groups run concurrently. Activations and their gradients
move between groups' meshes with ``jax.device_put``. Parameter gradients accumulate per
stage over micro-batches, into an accumulator each backward program takes donated and
reduce-scatters into (split over the group's devices: ``Lowered.accumulator``); a
parameter read by several stages (a tied embedding and LM head) lives on each of them
and its gradients are summed.

The optimizer sees the whole tree in one program over every pipeline device: master
parameters and optimizer state are sharded over all of them (ZeRO-1 across the
pipeline), so transforms such as ``clip_by_global_norm`` see every gradient. After the
update each stage receives its parameters back in its storage layout. The master copy is
the :class:`TrainState`'s ``params``; the stages' copies are derived from it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from jscaler.compile.lower import lower
from jscaler.cost.cluster import Cluster
from jscaler.cost.estimate import Estimate
from jscaler.cost.pipeline import estimate_pipeline
from jscaler.errors import PlanError, ScheduleError
from jscaler.ir.graph import Graph
from jscaler.plan.pipeline import PipelinePlan, pass_of_ops, stage_of_ops
from jscaler.plan.schedule import Block, Schedule
from jscaler.runtime.batch import batch_leaves, microbatches
from jscaler.runtime.handoff import handoff_for
from jscaler.runtime.program import guarded_update, initial_state, optimizer_shardings
from jscaler.runtime.stages import Stage, build_stages
from jscaler.runtime.state import TrainState

__all__ = ["DriverLog", "PipelineProgram", "StageDriver", "multi_process"]


@dataclass
class DriverLog:
    """What the driver ran in the last step: blocks per group in dispatch order, and the
    most forward residual sets (activations kept for a backward) alive at once per stage."""

    blocks: list[list[Block]] = field(default_factory=list)
    in_flight: list[int] = field(default_factory=list)


class StageDriver:
    """A pipeline plan's stage programs, the order the driver dispatches their blocks, and
    the handoff of gradients to (and parameters from) the update mesh.

    Used by :class:`PipelineProgram` and by ``parallelize_step`` under a pipeline plan:
    :meth:`run` takes the stages' parameters and state and the batch and returns the mean
    loss and each stage's gradient contributions.
    """

    def __init__(self, graph: Graph, pplan: PipelinePlan, schedule: Schedule, devices: list):
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
        self.graph, self.plan, self.schedule = graph, pplan, schedule
        self.microbatches = schedule.microbatches
        lowered = [lower(g.plan, [devices[d] for d in g.devices]) for g in pplan.groups]
        pass_of = pass_of_ops(graph, schedule.passes)
        stage_of = stage_of_ops(graph, schedule.stages, pplan.cuts, pass_of)
        dtypes = {t: graph.tensors[t].dtype for t in graph.inputs}
        # one program set per (pass, stage); the last pass's are the stages proper
        self.programs: list[Stage] = build_stages(
            lowered, schedule.placement, stage_of, dtypes, pass_of
        )
        self.stages: list[Stage] = self.programs[-schedule.stages :]
        self.order = [b for rnd in schedule.order() for b in rnd]
        self.producer = {t: st.index for st in self.programs for t in st.acts_out}
        self.log = DriverLog()
        self.param_ids = [t for t in graph.inputs if graph.tensors[t].role == "param"]
        self.state_ids = [t for t in graph.inputs if graph.tensors[t].role == "state"]
        self.batch_ids = [t for t in graph.inputs if graph.tensors[t].role == "batch"]
        read = {t for st in self.stages for t in st.params}
        unused = [graph.tensors[t].name for t in self.param_ids if t not in read]
        if unused:
            raise PlanError(f"parameter {unused[0]!r} is read by no stage")
        # the update runs on every pipeline device (see jscaler.runtime.handoff)
        shapes = [graph.tensors[t].shape for t in self.param_ids]
        self.handoff = handoff_for(
            self.stages, devices, pplan, self.param_ids, shapes, stacked=multi_process()
        )

    def stage_state(self, state: dict) -> list[list]:
        """Per stage, the state variables it reads (``state``: tensor id -> host array)."""
        return [[jax.device_put(state[t], st.sharding(t)) for t in st.state] for st in self.stages]

    def _split(self, batch: dict) -> list[list]:
        """Per stage program, per micro-batch: the batch leaves it reads, on its mesh.
        Micro-batch j holds rows j, j+m, j+2m, ... (as the single-program step)."""
        m = self.microbatches
        host = {t: microbatches(np.asarray(x), m) for t, x in batch.items()}
        return [
            [[jax.device_put(host[t][:, j], st.sharding(t)) for t in st.batch] for j in range(m)]
            for st in self.programs
        ]

    def run(self, stage_params: list, stage_state: list, batch: dict):
        """Runs every block of the schedule; returns (mean loss, per-stage parameter
        gradients accumulated over the micro-batches). ``batch``: tensor id -> array."""
        m, programs, n = self.microbatches, self.programs, self.schedule.stages
        last = len(programs) - n  # index of the last pass's stage 0
        mb = self._split(batch)
        acts: dict = {}  # (tensor, microbatch, consumer stage) -> value on its mesh
        cots: dict = {}  # (tensor, microbatch, consumer stage) -> cotangent on producer mesh
        res: dict = {}  # (stage, microbatch) -> (inputs held, residuals kept)
        saved: dict = {}  # (stage, microbatch) -> forward inputs of a recomputed block
        wcot: dict = {}  # (stage, microbatch) -> output cotangents kept for W
        grads: dict = {}  # stage index -> accumulated parameter gradients (donated on)
        losses = []
        log = DriverLog([[] for _ in self.schedule.groups], [0] * n)
        alive = [0] * n
        seed = np.float32(1.0 / m)  # a host value: every process places its own copy

        def inputs(st, j):
            a = [acts.pop((t, j, st.index)) for t in st.acts_in]
            f = [acts.pop((t, j, st.index)) for t in st.frozen]
            s = st.stage
            return stage_params[s], a, f, stage_state[s], mb[st.index][j]

        def keep(st, j, r):
            res[(st.stage, j)] = r
            alive[st.stage] += 1
            log.in_flight[st.stage] = max(log.in_flight[st.stage], alive[st.stage])

        def send(st, j, out_acts, outs):
            for t, v in zip(st.acts_out, out_acts):
                for c in st.consumers[t]:
                    acts[(t, j, c)] = jax.device_put(v, programs[c].sharding(t))
            losses.extend(outs[:1])

        def out_cot(st, j):
            ca = [_sum([cots.pop((t, j, c)) for c in st.consumers[t]]) for t in st.acts_out]
            if not st.outputs:
                return ca, []
            one = jax.device_put(seed, NamedSharding(st.low.mesh, PartitionSpec()))
            return ca, [one] * len(st.outputs)

        def send_back(st, j, d_acts):
            for t, v in zip(st.acts_in, d_acts):
                src = programs[self.producer[t]]
                # same layout on this mesh first: across processes, device_put moves an
                # array between device sets only shard for shard
                v = jax.device_put(v, st.sharding(t))
                cots[(t, j, st.index)] = jax.device_put(v, src.sharding(t))

        for b in self.order:
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
                    keep(st, j, (st.held(args), r))
                    send(st, j, out_acts, outs)
            elif b.kind == "R":
                args = saved.pop((b.stage, j))
                _, r = st.forward_res(*args)
                keep(st, j, (st.held(args), r))
            elif b.kind == "B":
                cot = out_cot(st, j)
                if self.schedule.split_backward:
                    d_acts = st.backward_input(*res[(b.stage, j)], cot)
                    wcot[(b.stage, j)] = cot
                else:
                    acc = grads.pop(st.index, None)
                    grads[st.index], d_acts = st.backward(acc, *res.pop((b.stage, j)), cot)
                    alive[b.stage] -= 1
                send_back(st, j, d_acts)
            else:  # W
                acc, r = grads.pop(st.index, None), res.pop((b.stage, j))
                grads[st.index] = st.backward_weight(acc, *r, wcot.pop((b.stage, j)))
                alive[b.stage] -= 1
        self.log = log
        return self.handoff.scalar(_sum(losses)) / m, grads


class PipelineProgram:
    """A :class:`~jscaler.runtime.program.Program` for a :class:`PipelinePlan` and a
    :class:`Schedule`: the :class:`StageDriver` runs the stages, one jitted update over
    every pipeline device applies the optimizer to the master parameters.

    Attributes (besides the Program's): ``schedule``, ``driver`` (its ``stages``,
    ``programs`` and ``log``, the last step's :class:`DriverLog`).
    """

    def __init__(
        self,
        graph: Graph,
        pplan: PipelinePlan,
        schedule: Schedule,
        devices: list,
        optimizer: optax.GradientTransformation,
        master: list[jax.ShapeDtypeStruct],
        *,
        batch_shapes: list[jax.ShapeDtypeStruct],
        precision: str = "fp32",
        slots: int = 0,
    ):
        self.driver = StageDriver(graph, pplan, schedule, devices)
        self.graph, self.plan, self.schedule = graph, pplan, schedule
        self.microbatches, self.batch_shapes = schedule.microbatches, batch_shapes
        self.precision, self.optimizer, self.slots = precision, optimizer, slots
        self.params_def = graph.signature.params_def
        self.batch_def = graph.signature.batch_def
        h = self.driver.handoff
        opt_shard = optimizer_shardings(optimizer, self.tree(master), self.tree(h.master), h.rep)
        n_state = len(self.driver.state_ids)
        self._shardings = TrainState(list(h.master), opt_shard, [None] * n_state)
        # the jitted optimizer update (public: a bench compiles it to read its memory)
        self.update_step = self._jit_update()  # traced and compiled at the first step
        self._staged: tuple = ((), None)  # (the master arrays, their stages' copies)

    @property
    def stages(self) -> list[Stage]:
        return self.driver.stages

    @property
    def log(self) -> DriverLog:
        return self.driver.log

    def tree(self, leaves):
        return jax.tree_util.tree_unflatten(self.params_def, list(leaves))

    def shardings(self) -> TrainState:
        return self._shardings

    def init(self, params: list, model_state: list) -> TrainState:
        host_state = [np.asarray(x) for x in model_state]  # the stages take it from the host
        return initial_state(self.optimizer, self.params_def, params, self._shardings, host_state)

    # ---- the stages' copies of the state -------------------------------------------------

    def _stage_inputs(self, state: TrainState) -> tuple[list, list]:
        """Each stage's parameters (in its layout) and state, derived from the master copy;
        kept while the master arrays are the same objects (they are replaced each step)."""
        master, stage_params = self._staged
        same = len(master) == len(state.params) and all(
            a is b for a, b in zip(master, state.params)
        )
        if not same:
            h = self.driver.handoff
            stage_params = h.stage_params(state.params, jax.jit(h.broadcast)(state.params))
            self._staged = (list(state.params), stage_params)
        by_id = dict(zip(self.driver.state_ids, state.model_state))
        return stage_params, self.driver.stage_state(by_id)

    def _batch(self, batch) -> dict:
        leaves = batch_leaves(batch, self.batch_def, self.batch_shapes)
        return dict(zip(self.driver.batch_ids, leaves))

    def _run(self, state: TrainState, batch):
        stage_params, stage_state = self._stage_inputs(state)
        return self.driver.run(stage_params, stage_state, self._batch(batch))

    # ---- the update ------------------------------------------------------------------------

    def _jit_update(self):
        h = self.driver.handoff

        def update(master, opt_state, contributions):
            g = [h.reduce(parts) for parts in contributions]
            grad_norm = optax.tree.norm(g)
            ok = jnp.isfinite(grad_norm)  # else nothing changes (the trainer raises)
            new, new_opt, _, ok = guarded_update(
                self.optimizer, self.tree(master), self.tree(g), opt_state, ok
            )
            new = jax.tree_util.tree_leaves(new)
            return new, new_opt, grad_norm, ok, h.broadcast(new)

        sh = self._shardings
        return jax.jit(
            update,
            out_shardings=(sh.params, sh.opt_state, h.rep, h.rep, None),
            donate_argnums=(0, 1),
        )

    def step(self, state: TrainState, batch) -> tuple[TrainState, dict[str, float]]:
        new, metrics, _ = self._step(state, batch, keep_grads=False)
        return new, metrics

    def step_and_grads(self, state: TrainState, batch):
        return self._step(state, batch, keep_grads=True)

    def _step(self, state: TrainState, batch, keep_grads: bool):
        loss, grads = self._run(state, batch)
        loss = float(loss)
        h = self.driver.handoff
        contributions = h.gradients(grads)
        kept = [h.gathered(parts) for parts in contributions] if keep_grads else None
        if not math.isfinite(loss):  # caught before the update runs
            return state, {"loss": loss, "grad_norm": float("nan")}, kept
        master, opt, gnorm, done, stacked = self.update_step(
            state.params, state.opt_state, contributions
        )
        self._staged = (list(master), h.stage_params(master, stacked))
        gnorm = float(np.asarray(gnorm.addressable_data(0)))
        done = bool(np.asarray(done.addressable_data(0)))  # not done: the old arrays
        new = TrainState(master, opt, state.model_state, state.step + done)
        return new, {"loss": loss, "grad_norm": gnorm}, kept

    def value_and_grad(self, state: TrainState, batch) -> tuple[float, list]:
        loss, grads = self._run(state, batch)
        h = self.driver.handoff
        return float(loss), [h.gathered(parts) for parts in h.gradients(grads)]

    def eval(self, state: TrainState, batch) -> dict[str, float]:
        loss, _ = self._run(state, batch)
        return {"loss": float(loss)}

    def compiled(self, state: TrainState, batch):
        raise PlanError(
            f"the pipeline {self.plan.name!r} runs one program per stage group and an update, "
            f"not one compiled step; inspect trainer.program.stages instead"
        )

    def comm_table(self):
        raise PlanError("comm_table() covers single-program plans; a pipeline has one per group")

    # ---- multi-process batches -------------------------------------------------------------

    def global_batch(self, local_batch):
        """The batch itself: every process of a pipeline reads the whole batch (each stage
        group takes its micro-batches from it)."""
        leaves = jax.tree_util.tree_leaves(local_batch)
        for i, (x, want) in enumerate(zip(leaves, self.batch_shapes)):
            if x.shape[0] != want.shape[0]:
                raise PlanError(
                    f"local batch leaf {i} has {x.shape[0]} rows; the pipeline "
                    f"{self.plan.name!r} reads all {want.shape[0]} rows of the batch in "
                    f"every process: pass the whole batch"
                )
        return local_batch

    def local_rows(self, batch_size: int | None = None) -> tuple[int, int]:
        rows = batch_size if batch_size is not None else self.batch_shapes[0].shape[0]
        return 0, rows

    # ---- predictions -----------------------------------------------------------------------

    @staticmethod
    def predict(
        plan: PipelinePlan, cluster, *, microbatches: int, precision: str, slots: int, schedule,
        expert_skew: float = 1.0,
    ) -> Estimate:  # fmt: skip
        """The cost model's step for ``plan`` under ``schedule`` (before anything is
        lowered); its ``timeline`` holds the blocks' spans."""
        dtype = "bf16" if precision == "bf16" else "fp32"
        return estimate_pipeline(
            plan, cluster, microbatches=microbatches, schedule=schedule, dtype=dtype,
            optimizer_slots=slots, expert_skew=expert_skew,
        )  # fmt: skip

    def estimate(self, cluster: str | Cluster, expert_skew: float = 1.0) -> Estimate:
        return self.predict(
            self.plan, cluster, microbatches=self.microbatches, precision=self.precision,
            slots=self.slots, schedule=self.schedule, expert_skew=expert_skew,
        )  # fmt: skip

    def timeline(self, path: str, cluster: str | Cluster) -> Estimate:
        from jscaler.report.timeline import write_pipeline_timeline

        est = self.estimate(cluster)
        title = (
            f"{self.plan.name} / {self.schedule.name} on {est.devices} x {est.cluster}: "
            f"bubble {est.bubble:.1%}, SIMULATED by the cost model"
        )
        write_pipeline_timeline(est.timeline, path, title, est.step_time)
        return est


def multi_process() -> bool:
    """Whether the run spans processes (then gradients and parameters move between the
    stages and the update mesh as stacked arrays: :class:`jscaler.runtime.handoff.Stacked`)."""
    return jax.process_count() > 1


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
