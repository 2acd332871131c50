"""Lowering plans to JAX: layouts from pieces, sharding constraints, shard_map regions.

Imports ``jscaler.ir`` and ``jscaler.plan``.
"""

from jscaler.compile.layout import Layout as Layout
from jscaler.compile.layout import layout_of as layout_of
from jscaler.compile.lower import Lowered as Lowered
from jscaler.compile.lower import lower as lower
