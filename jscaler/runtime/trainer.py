"""Trainer: a TrainState and the Programs that advance it. Made by ``jscaler.parallelize``.

The trainer holds the state (:class:`~jscaler.runtime.state.TrainState`) and asks its
:class:`~jscaler.runtime.builder.Planner` for the Program of each batch's signature; a
Program of another layout gets the state moved to it first
(:func:`~jscaler.runtime.state.relayout`). Pipelines are a Program like any other.
"""

from __future__ import annotations

from pathlib import Path

import jax
from flax import nnx

from jscaler.cost.cluster import Cluster
from jscaler.cost.estimate import Estimate
from jscaler.errors import PlanError
from jscaler.ir.graph import Graph
from jscaler.plan.kind import AnyPlan
from jscaler.runtime import checkpoint, safetensors_io
from jscaler.runtime.builder import Planner
from jscaler.runtime.distributed import peer_failures_as_errors
from jscaler.runtime.program import Program, check_finite
from jscaler.runtime.state import TrainState, gather, relayout

__all__ = ["Trainer"]


class Trainer:
    """Trains a model under a plan. Made by :func:`jscaler.parallelize`.

    Attributes:
      state: the :class:`TrainState` (parameters, optimizer state, model state, step).
      program: the :class:`Program` of the last batch's signature (an SPMD step, or a
        pipeline's stages, driver and update: ``program.schedule``, ``program.stages``,
        ``program.log``).
      planner: the :class:`Planner` building and caching a Program per batch signature.
    """

    def __init__(self, planner: Planner, example_batch):
        self.planner = planner
        self.program: Program = planner.program(example_batch)
        sig = self.program.graph.signature
        self._sig = sig
        p_leaves, s_leaves = sig.split(planner.model)
        self.state: TrainState = self.program.init(p_leaves, s_leaves)
        self.pending_save: checkpoint.PendingSave | None = None  # save(wait=False)

    # ---- what it runs --------------------------------------------------------------------

    @property
    def plan(self) -> AnyPlan:
        """The validated plan of the current Program."""
        return self.program.plan

    @property
    def graph(self) -> Graph:
        """The traced graph (at micro-batch shape) of the current Program."""
        return self.program.graph

    @property
    def precision(self) -> str:
        """``"fp32"``, or ``"bf16"``: the step computes in bf16 while parameters and
        optimizer state stay fp32."""
        return self.program.precision

    @property
    def cluster(self) -> Cluster | None:
        """The cluster given to ``parallelize`` (None: none was)."""
        return self.planner.cluster

    @property
    def step_count(self) -> int:
        """Updates applied so far (``state.step``)."""
        return int(self.state.step)

    def use(self, batch) -> Program:
        """Makes the Program for ``batch``'s signature current (built on first sight; the
        state moves to its layouts if they differ) and returns it."""
        program = self.planner.program(batch)
        if program is not self.program:
            if program.shardings() != self.program.shardings():
                self.state = relayout(self.state, program.shardings())
            self.program = program
        return program

    # ---- training --------------------------------------------------------------------------

    @peer_failures_as_errors
    def step(self, batch) -> dict[str, float]:
        """One training step: ``{"loss", "grad_norm"}`` (loss before the update).

        Raises:
          NonFiniteLossError: the loss or a gradient is NaN or infinite, or the update
            would make a parameter or optimizer state entry so; the update was not applied,
            so the parameters and optimizer state are those before this step.
        """
        before = self.state.step
        self.state, metrics = self.use(batch).step(self.state, batch)
        applied = self.state.step != before
        check_finite(metrics["loss"], metrics["grad_norm"], before + 1, applied)
        return metrics

    @peer_failures_as_errors
    def step_and_grads(self, batch) -> tuple[dict[str, float], object]:
        """:meth:`step`, also returning the gradients it applied (gathered, in the
        parameters' pytree): ``(metrics, grads)``. One compiled program where
        :meth:`value_and_grad` then :meth:`step` compile two, so checks against one device
        (:func:`jscaler.runtime.reference.trainer_steps`, ``jscaler verify``) use it.

        Raises:
          NonFiniteLossError: as :meth:`step`.
        """
        before = self.state.step
        self.state, metrics, grads = self.use(batch).step_and_grads(self.state, batch)
        check_finite(metrics["loss"], metrics["grad_norm"], before + 1, self.state.step != before)
        return metrics, self._tree(grads)

    def eval(self, batch) -> dict[str, float]:
        """The loss on ``batch`` at the current parameters, without an update (the forward
        only under the same plan; model state such as BatchNorm statistics is not updated
        either): ``{"loss"}``."""
        return self.use(batch).eval(self.state, batch)

    def value_and_grad(self, batch):
        """Loss and gathered gradients at the current parameters, without an update."""
        loss, grads = self.use(batch).value_and_grad(self.state, batch)
        return loss, self._tree(grads)

    # ---- batches across processes ------------------------------------------------------------

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
        leaves = jax.tree_util.tree_leaves(local_batch)
        n_in = len(self.program.batch_shapes)
        if len(leaves) != n_in:
            raise PlanError(
                f"the local batch has {len(leaves)} leaves; the trainer was made for "
                f"{n_in}: pass this process's rows of a batch of the same structure as the "
                f"example batch"
            )
        n = jax.process_count()
        full = [jax.ShapeDtypeStruct((x.shape[0] * n, *x.shape[1:]), x.dtype) for x in leaves]
        full = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(local_batch), full)
        return self.use(full).global_batch(local_batch)

    def local_rows(self, batch_size: int | None = None) -> tuple[int, int]:
        """``(start, stop)``: the rows of a global batch of ``batch_size`` rows (default the
        example batch's) that this process's devices hold under the plan."""
        return self.program.local_rows(batch_size)

    # ---- what it holds -----------------------------------------------------------------------

    def _tree(self, leaves):
        return jax.tree_util.tree_unflatten(self._sig.params_def, list(leaves))

    @property
    def params(self):
        """The current parameters, gathered to full arrays: an nnx model's Params State,
        your params pytree, or linen variables' ``"params"`` collection."""
        return self._tree([gather(p) for p in self.state.params])

    def shardings(self):
        """The sharding each parameter is stored with, in the parameters' structure."""
        return self._tree(self.program.shardings().params)

    def _model_state(self) -> list:
        return [gather(s) for s in self.state.model_state]

    @property
    def model(self):
        """For an nnx model: a new model holding the current parameters and state."""
        if self._sig.kind != "nnx":
            raise TypeError(
                "model is for nnx models; use .params for a params pytree, .variables for "
                "linen variables (has_aux=True)"
            )
        state = jax.tree_util.tree_unflatten(self._sig.state_def, self._model_state())
        return nnx.merge(self._sig.graphdef, self.params, state)

    @property
    def variables(self) -> dict:
        """For linen variables (``has_aux=True``): ``{"params": ..., <collection>: ...}``
        with the current parameters and collections (``.params`` is the ``"params"``
        tree alone)."""
        return self._sig.variables(self.params, self._model_state())

    def export(self):
        """The trained model as plain host arrays, gathered from every device (and every
        process): for an nnx model an ``nnx.State`` of all its variables (load it with
        ``nnx.update(model, trainer.export())``), for a params pytree the pytree, for
        linen variables (``has_aux=True``) the variables with every collection."""
        if self._sig.kind == "linen":
            return self.variables
        if self._sig.kind != "nnx":
            return self.params
        state = jax.tree_util.tree_unflatten(self._sig.state_def, self._model_state())
        return nnx.merge_state(self.params, state)

    # ---- checkpoints -------------------------------------------------------------------------

    def _names(self) -> checkpoint.Names:
        g = self.graph
        by_role = {
            r: tuple(g.tensors[t].name for t in g.inputs if g.tensors[t].role == r)
            for r in ("param", "state")
        }
        return checkpoint.Names(by_role["param"], by_role["state"], self.plan.name or "")

    def checkpoint_bytes(self) -> int:
        """About how many bytes one checkpoint of this trainer takes on disk: its
        parameters, optimizer state and model state at their global sizes, with
        :func:`~jscaler.runtime.checkpoint.disk_bytes`'s margin for metadata and blocks."""
        state = (self.state.params, self.state.opt_state, self.state.model_state)
        return checkpoint.disk_bytes(state)

    def save(self, directory, wait: bool = True) -> Path:
        """Saves the :attr:`state` to ``directory/<step>`` atomically; returns that path
        once it is on disk. See :mod:`jscaler.runtime.checkpoint`.

        ``wait=False`` returns once the arrays are copied to the host and writes them in
        the background while training goes on (orbax's asynchronous checkpointing); the
        next save, :meth:`restore` and :meth:`wait_for_save` wait for it first."""
        self.wait_for_save()
        if wait:
            return checkpoint.save(directory, self.state, self.program.shardings(), self._names())
        self.pending_save = checkpoint.save_async(
            directory, self.state, self.program.shardings(), self._names()
        )
        return self.pending_save.path

    def wait_for_save(self) -> Path | None:
        """Blocks until a background save (``save(wait=False)``) is on disk; returns its
        path (None when none is running). Raises CheckpointError if it failed."""
        pending, self.pending_save = self.pending_save, None
        return None if pending is None else pending.wait()

    def restore(self, directory, step: int | None = None) -> int:
        """Loads the newest usable checkpoint in ``directory`` (or ``step``) into this
        trainer's layouts, whatever plan or device count saved it; returns its step."""
        self.wait_for_save()
        self.state = checkpoint.restore(
            directory, self.state, self.program.shardings(), self._names(), step
        )
        return self.step_count

    def load_safetensors(self, directory) -> safetensors_io.LoadReport:
        """Replaces the parameters with those of the Hugging Face safetensors checkpoint in
        ``directory`` (``model.safetensors``, PyTorch or Flax names; see
        :mod:`jscaler.runtime.safetensors_io`) and starts the optimizer afresh from them;
        the step count is kept. Each device reads only the slices of each tensor that the
        plan gives it. Returns what was read.

        Raises:
          CheckpointError: a parameter is missing from the checkpoint or has another shape
            there.
        """
        like = [jax.ShapeDtypeStruct(p.shape, p.dtype) for p in self.state.params]
        params, report = safetensors_io.read(
            directory, self._names().params, like, self.program.shardings().params
        )
        fresh = self.program.init(params, self.state.model_state)
        self.state = fresh.replace(step=self.state.step)
        return report

    # ---- inspection and predictions ------------------------------------------------------------

    def compiled(self, batch):
        """The compiled training step for this batch: ``.as_text()`` shows the collectives
        XLA emitted, ``.memory_analysis()`` the per-device memory."""
        return self.use(batch).compiled(self.state, batch)

    def hlo(self, batch) -> str:
        """The compiled HLO text of the training step for this batch."""
        return self.compiled(batch).as_text()

    def comm_table(self):
        """The collectives the plan implies per step (a :class:`CommTable`): tensor, module
        path, collective, mesh axes and bytes, derived from the layouts, not from XLA."""
        return self.program.comm_table()

    def estimate(self, cluster: str | Cluster | None = None, expert_skew: float = 1.0) -> Estimate:
        """The cost model's prediction of this plan's step (:class:`jscaler.Estimate`) on
        ``cluster`` (default: the one given to ``parallelize``, else ``cpu``); a
        pipeline's ``timeline`` holds the blocks' spans. ``expert_skew``: a
        mixture-of-experts router's load imbalance (the busiest expert-parallel device's
        rows over the mean; 1, balanced), as :func:`jscaler.estimate` takes it."""
        return self.program.estimate(cluster or self.cluster or "cpu", expert_skew)

    def timeline(self, path: str, cluster: str | Cluster | None = None) -> Estimate:
        """Writes the plan's step as a timeline, SIMULATED by the cost model on ``cluster``:
        one lane per device (per device group for a pipeline), each op's forward and
        backward and the step's collectives, as a Chrome trace (``.json``: open it in
        https://ui.perfetto.dev) or a PNG (``.png``). Returns the :class:`jscaler.Estimate`
        it drew. For a measured trace, run steps under ``jax.profiler.trace(dir)``
        (``jscaler train --profile DIR``)."""
        return self.program.timeline(path, cluster or self.cluster or "cpu")
