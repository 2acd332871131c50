"""jscaler: parallelise a single-device Flax training step with searched plans.

The public API, exported once here::

    graph = jscaler.trace(loss_fn, model_or_params, batch)          # the Graph IR
    plan = spaces.megatron(tp=2)(graph, 8)                           # or the primitives:
    plan, subs = jscaler.op_trans(plan, op, jscaler.split("b"), 2)   # op-trans
    plan = jscaler.op_assign(plan, subs[0], 0)                       # op-assign
    plan = jscaler.op_order(plan, subs[0], subs[1])                  # op-order
    jscaler.validate(plan)
    trainer = jscaler.parallelize(model, loss_fn, optax.sgd(0.1), batch, plan=plan)
"""

from jscaler.compile.attention import AttentionRegion as AttentionRegion
from jscaler.compile.attention import find_attention as find_attention
from jscaler.cost import CLUSTERS as CLUSTERS
from jscaler.cost import Cluster as Cluster
from jscaler.cost import Estimate as Estimate
from jscaler.cost import estimate as estimate
from jscaler.errors import AnnotationError as AnnotationError
from jscaler.errors import AssignmentError as AssignmentError
from jscaler.errors import CheckpointError as CheckpointError
from jscaler.errors import ConfigError as ConfigError
from jscaler.errors import CoverageError as CoverageError
from jscaler.errors import CycleError as CycleError
from jscaler.errors import DataError as DataError
from jscaler.errors import DistributedError as DistributedError
from jscaler.errors import JscalerError as JscalerError
from jscaler.errors import LayoutError as LayoutError
from jscaler.errors import MaskError as MaskError
from jscaler.errors import NonFiniteLossError as NonFiniteLossError
from jscaler.errors import OutOfMemoryError as OutOfMemoryError
from jscaler.errors import PlanError as PlanError
from jscaler.errors import ScheduleError as ScheduleError
from jscaler.errors import SplitError as SplitError
from jscaler.errors import TraceError as TraceError
from jscaler.errors import UnsupportedOpError as UnsupportedOpError
from jscaler.ir import Annotation as Annotation
from jscaler.ir import Coverage as Coverage
from jscaler.ir import Graph as Graph
from jscaler.ir import Layer as Layer
from jscaler.ir import Mask as Mask
from jscaler.ir import Op as Op
from jscaler.ir import PTensor as PTensor
from jscaler.ir import Tensor as Tensor
from jscaler.ir import VTensor as VTensor
from jscaler.ir import check_annotations as check_annotations
from jscaler.ir import register_op as register_op
from jscaler.ir import trace as trace
from jscaler.plan import AnyPlan as AnyPlan
from jscaler.plan import Block as Block
from jscaler.plan import DimClasses as DimClasses
from jscaler.plan import MeshSpec as MeshSpec
from jscaler.plan import Node as Node
from jscaler.plan import PipelinePlan as PipelinePlan
from jscaler.plan import Plan as Plan
from jscaler.plan import Region as Region
from jscaler.plan import Schedule as Schedule
from jscaler.plan import StageGroup as StageGroup
from jscaler.plan import SubOp as SubOp
from jscaler.plan import coshard as coshard
from jscaler.plan import data_parallel as data_parallel
from jscaler.plan import decouple as decouple
from jscaler.plan import manual as manual
from jscaler.plan import one_f_one_b as one_f_one_b
from jscaler.plan import op_assign as op_assign
from jscaler.plan import op_order as op_order
from jscaler.plan import op_trans as op_trans
from jscaler.plan import order_schedule as order_schedule
from jscaler.plan import recompute as recompute
from jscaler.plan import replicate as replicate
from jscaler.plan import simulate as simulate
from jscaler.plan import split as split
from jscaler.plan import stage_of_ops as stage_of_ops
from jscaler.plan import validate as validate
from jscaler.runtime import ParallelStep as ParallelStep
from jscaler.runtime import Program as Program
from jscaler.runtime import Recipe as Recipe
from jscaler.runtime import Space as Space
from jscaler.runtime import Trainer as Trainer
from jscaler.runtime import TrainState as TrainState
from jscaler.runtime import grad as grad
from jscaler.runtime import parallelize as parallelize
from jscaler.runtime import parallelize_step as parallelize_step
from jscaler.runtime import spmd_pipeline as spmd_pipeline
from jscaler.runtime import value_and_grad as value_and_grad
from jscaler.search import intra_op as intra_op
from jscaler.search import propagate as propagate
from jscaler.version import __version__ as __version__

__all__ = [
    "AnyPlan",
    "Annotation",
    "AnnotationError",
    "AssignmentError",
    "AttentionRegion",
    "Block",
    "check_annotations",
    "CheckpointError",
    "Cluster",
    "CLUSTERS",
    "ConfigError",
    "Coverage",
    "CoverageError",
    "CycleError",
    "DataError",
    "data_parallel",
    "decouple",
    "DimClasses",
    "DistributedError",
    "Estimate",
    "estimate",
    "find_attention",
    "grad",
    "Graph",
    "intra_op",
    "JscalerError",
    "Layer",
    "LayoutError",
    "manual",
    "Mask",
    "MaskError",
    "MeshSpec",
    "NonFiniteLossError",
    "Node",
    "one_f_one_b",
    "Op",
    "op_assign",
    "op_order",
    "op_trans",
    "OutOfMemoryError",
    "order_schedule",
    "parallelize",
    "parallelize_step",
    "ParallelStep",
    "PipelinePlan",
    "Plan",
    "Program",
    "PlanError",
    "propagate",
    "PTensor",
    "Recipe",
    "recompute",
    "Region",
    "register_op",
    "replicate",
    "Schedule",
    "ScheduleError",
    "simulate",
    "Space",
    "split",
    "SplitError",
    "spmd_pipeline",
    "stage_of_ops",
    "StageGroup",
    "SubOp",
    "Tensor",
    "trace",
    "TraceError",
    "Trainer",
    "TrainState",
    "UnsupportedOpError",
    "validate",
    "value_and_grad",
    "VTensor",
]
