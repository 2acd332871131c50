"""The Graph IR: tracing, ops with dim annotations, pTensor/vTensor masks.

Owns: turning a loss function into a :class:`Graph` (``trace``), the annotation rules of
every primitive (``rules_*.py``, extended with ``register_op``), and the mask algebra of
tensor pieces (``vtensor``). Imports nothing else of jscaler but ``jscaler.errors``.
"""

from jscaler.ir import (  # noqa: F401  (registers the rules)
    rules_elementwise,
    rules_index,
    rules_linalg,
    rules_nn,
    rules_shape,
)
from jscaler.ir.annotation import Annotation as Annotation
from jscaler.ir.check import check_annotations as check_annotations
from jscaler.ir.chunk import chunk_loops as chunk_loops
from jscaler.ir.evaluate import evaluate as evaluate
from jscaler.ir.graph import LOOP_PRIMITIVES as LOOP_PRIMITIVES
from jscaler.ir.graph import Coverage as Coverage
from jscaler.ir.graph import Graph as Graph
from jscaler.ir.graph import Layer as Layer
from jscaler.ir.graph import Literal as Literal
from jscaler.ir.graph import Loop as Loop
from jscaler.ir.graph import Op as Op
from jscaler.ir.graph import Tensor as Tensor
from jscaler.ir.registry import register_op as register_op
from jscaler.ir.trace import trace as trace
from jscaler.ir.unroll import unroll as unroll
from jscaler.ir.vtensor import Mask as Mask
from jscaler.ir.vtensor import PTensor as PTensor
from jscaler.ir.vtensor import VTensor as VTensor
