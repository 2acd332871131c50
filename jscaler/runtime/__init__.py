"""Running plans: ``parallelize`` and the ``Trainer`` it returns; ``parallelize_step``.

One way through: a :class:`~jscaler.runtime.builder.Planner` builds a
:class:`~jscaler.runtime.program.Program` per batch signature (an SPMD step or a
pipeline), the :class:`Trainer` advances a :class:`TrainState` with it.

Imports ``jscaler.ir``, ``jscaler.plan``, ``jscaler.compile`` and ``jscaler.cost``.
"""

from jscaler.runtime.builder import Planner as Planner
from jscaler.runtime.builder import Space as Space
from jscaler.runtime.parallelize import parallelize as parallelize
from jscaler.runtime.program import Program as Program
from jscaler.runtime.recipe import Recipe as Recipe
from jscaler.runtime.spmd_pipeline import spmd_pipeline as spmd_pipeline
from jscaler.runtime.state import TrainState as TrainState
from jscaler.runtime.step import ParallelStep as ParallelStep
from jscaler.runtime.step import grad as grad
from jscaler.runtime.step import parallelize_step as parallelize_step
from jscaler.runtime.step import value_and_grad as value_and_grad
from jscaler.runtime.trainer import Trainer as Trainer
