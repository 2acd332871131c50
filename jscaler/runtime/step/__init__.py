"""``@jscaler.parallelize_step``: an existing train step, parallelised without rewriting.

:mod:`~jscaler.runtime.step.parallel_step` traces the step once per argument signature
(:mod:`~jscaler.runtime.step.record`), plans the loss with the builder
(:func:`jscaler.runtime.builder.prepare`, as ``parallelize`` does), and compiles it as one
SPMD program (:mod:`~jscaler.runtime.step.spmd`) or, under a pipeline plan, as Alpa's
two-part step over the pipeline's :class:`~jscaler.runtime.pipeline.StageDriver`
(:mod:`~jscaler.runtime.step.pipeline`).
"""

from jscaler.runtime.step.autodiff import grad as grad
from jscaler.runtime.step.autodiff import value_and_grad as value_and_grad
from jscaler.runtime.step.parallel_step import ParallelStep as ParallelStep
from jscaler.runtime.step.parallel_step import parallelize_step as parallelize_step
