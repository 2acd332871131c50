"""Lowering plans to JAX: layouts from pieces, sharding constraints, shard_map regions.

Owns: layouts (``layout.py``), the lowering (``lower.py``), manual regions and their
kernels (``regions.py``, ``attention.py``: ring attention), the comm table predicted
from the layouts (``comm.py``) and the reader of compiled collectives (``hlo.py``).
Imports ``jscaler.ir`` and ``jscaler.plan``.
"""

from jscaler.compile.layout import Layout as Layout
from jscaler.compile.layout import layout_of as layout_of
from jscaler.compile.lower import Lowered as Lowered
from jscaler.compile.lower import lower as lower
