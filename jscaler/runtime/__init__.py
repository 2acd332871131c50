"""Running plans: ``parallelize`` and the ``Trainer`` it returns.

Imports ``jscaler.ir``, ``jscaler.plan`` and ``jscaler.compile``.
"""

from jscaler.runtime.autodiff import grad as grad
from jscaler.runtime.autodiff import value_and_grad as value_and_grad
from jscaler.runtime.parallelize import Space as Space
from jscaler.runtime.parallelize import parallelize as parallelize
from jscaler.runtime.pipeline import PipelineTrainer as PipelineTrainer
from jscaler.runtime.spmd_pipeline import spmd_pipeline as spmd_pipeline
from jscaler.runtime.step import ParallelStep as ParallelStep
from jscaler.runtime.step import parallelize_step as parallelize_step
from jscaler.runtime.trainer import Trainer as Trainer
