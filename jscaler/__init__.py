"""jscaler: parallelise a single-device Flax training step with searched plans.

The public API, exported once here::

    graph = jscaler.trace(loss_fn, model_or_params, batch)
    graph.coverage(), graph.select("blocks/*/attn"), graph.layers(), graph.as_fn()
"""

from jscaler.errors import AnnotationError as AnnotationError
from jscaler.errors import JscalerError as JscalerError
from jscaler.errors import MaskError as MaskError
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

__version__ = "0.1.0"

__all__ = [
    "Annotation",
    "AnnotationError",
    "Coverage",
    "Graph",
    "JscalerError",
    "Layer",
    "Mask",
    "MaskError",
    "Op",
    "PTensor",
    "Tensor",
    "TraceError",
    "UnsupportedOpError",
    "VTensor",
    "check_annotations",
    "register_op",
    "trace",
]
