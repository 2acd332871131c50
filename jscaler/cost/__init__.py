"""Cost model: cluster specs, collective times, and a plan's predicted step and memory.

Owns :class:`Cluster` and its presets (``dgx2_v100``, ``dgx1_v100``, ``a100_80g``,
``h100_sxm``, ``cpu``), :func:`collective_time` (alpha-beta per link level) and
:func:`estimate` (compute roofline + comm table + memory per device, MFU/HFU). Imports
``jscaler.plan``, ``jscaler.compile`` (layouts and the comm table) and ``jscaler.ir``.
"""

from jscaler.cost.cluster import CLUSTERS as CLUSTERS
from jscaler.cost.cluster import Cluster as Cluster
from jscaler.cost.cluster import Link as Link
from jscaler.cost.cluster import get_cluster as get_cluster
from jscaler.cost.collective import collective_time as collective_time
from jscaler.cost.estimate import Estimate as Estimate
from jscaler.cost.estimate import estimate as estimate
from jscaler.cost.pipeline import estimate_pipeline as estimate_pipeline
