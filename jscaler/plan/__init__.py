"""Plans: the three primitives over a graph, frozen Plans, validation.

Owns: ``Plan``/``Node``/``SubOp``/``MeshSpec`` (frozen, JSON round-trip), the primitives
``op_trans``/``op_assign``/``op_order`` and their algorithms, dim classes, ``validate``,
and helpers spaces are written with. Imports ``jscaler.ir`` and ``jscaler.errors`` only.
"""

from jscaler.plan.classes import DimClasses as DimClasses
from jscaler.plan.helpers import assign_mesh as assign_mesh
from jscaler.plan.helpers import batch_axes as batch_axes
from jscaler.plan.helpers import data_parallel as data_parallel
from jscaler.plan.helpers import recompute_layers as recompute_layers
from jscaler.plan.helpers import shard_dim as shard_dim
from jscaler.plan.helpers import split_classes as split_classes
from jscaler.plan.helpers import split_ops as split_ops
from jscaler.plan.kind import AnyPlan as AnyPlan
from jscaler.plan.mesh import MeshSpec as MeshSpec
from jscaler.plan.order import order_schedule as order_schedule
from jscaler.plan.pieces import Piece as Piece
from jscaler.plan.pieces import device_pieces as device_pieces
from jscaler.plan.pieces import op_pieces as op_pieces
from jscaler.plan.pipeline import PipelinePlan as PipelinePlan
from jscaler.plan.pipeline import StageGroup as StageGroup
from jscaler.plan.pipeline import stage_of_ops as stage_of_ops
from jscaler.plan.plan import Node as Node
from jscaler.plan.plan import Plan as Plan
from jscaler.plan.plan import Region as Region
from jscaler.plan.plan import SubOp as SubOp
from jscaler.plan.primitives import Algorithm as Algorithm
from jscaler.plan.primitives import coshard as coshard
from jscaler.plan.primitives import decouple as decouple
from jscaler.plan.primitives import manual as manual
from jscaler.plan.primitives import op_assign as op_assign
from jscaler.plan.primitives import op_order as op_order
from jscaler.plan.primitives import op_trans as op_trans
from jscaler.plan.primitives import recompute as recompute
from jscaler.plan.primitives import replicate as replicate
from jscaler.plan.primitives import split as split
from jscaler.plan.schedule import Block as Block
from jscaler.plan.schedule import Schedule as Schedule
from jscaler.plan.schedule import one_f_one_b as one_f_one_b
from jscaler.plan.timeline import Timeline as Timeline
from jscaler.plan.timeline import simulate as simulate
from jscaler.plan.validate import validate as validate
