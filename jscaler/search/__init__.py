"""Search: the op-trans + op-assign ILP (CP-SAT) over per-op strategies on a mesh.

Owns :func:`build_problem` (strategies, node/edge costs and memory from the cost model),
:func:`solve` (CP-SAT, deterministic), :func:`brute_force` (the check on small graphs),
:func:`to_plan` and the space-like :func:`intra_op`; and :func:`search_order`, the
op-order search over pipeline blocks (CP-SAT scheduling under a memory bound);
:func:`propagate` completes a partial plan from the ops it fixes; :func:`slice_stages`
cuts layers into pipeline stages by dynamic programming (Alpa's stage slicing).
Imports ``jscaler.cost``, ``jscaler.plan``, ``jscaler.compile`` and ``jscaler.ir``.
"""

from jscaler.search.auto import IntraOp as IntraOp
from jscaler.search.auto import intra_op as intra_op
from jscaler.search.ilp import Solution as Solution
from jscaler.search.ilp import brute_force as brute_force
from jscaler.search.ilp import explain as explain
from jscaler.search.ilp import solve as solve
from jscaler.search.ilp import to_plan as to_plan
from jscaler.search.order import OrderResult as OrderResult
from jscaler.search.order import search_order as search_order
from jscaler.search.problem import Problem as Problem
from jscaler.search.problem import build_problem as build_problem
from jscaler.search.problem import objective as objective
from jscaler.search.propagate import propagate as propagate
from jscaler.search.stages import best_split as best_split
from jscaler.search.stages import layer_costs as layer_costs
from jscaler.search.stages import slice_stages as slice_stages
