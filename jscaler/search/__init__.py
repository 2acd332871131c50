"""Search: the op-trans + op-assign ILP (HiGHS) over per-op strategies on a mesh.

Owns :func:`build_problem` (strategies, node/edge costs and memory from the cost model),
:func:`solve` (HiGHS, stopped by a deterministic work limit), :func:`brute_force` (the
check on small graphs), :func:`to_plan` and the space-like :func:`intra_op`; and
:func:`search_order`, the op-order search over pipeline blocks (CP-SAT scheduling under
a memory bound);
:func:`propagate` completes a partial plan from the ops it fixes; :func:`slice_stages`
cuts layers into pipeline stages by dynamic programming (Alpa's stage slicing);
:func:`search` and the space :func:`auto` (``plan="auto"``) search jointly over every
:class:`Candidate`: the engine's own and those registered with :func:`register_candidates`.
Imports ``jscaler.cost``, ``jscaler.plan``, ``jscaler.compile`` and ``jscaler.ir``.
"""

from jscaler.search.auto import IntraOp as IntraOp
from jscaler.search.auto import intra_op as intra_op
from jscaler.search.auto import shared_solves as shared_solves
from jscaler.search.candidates import Candidate as Candidate
from jscaler.search.candidates import StagedILP as StagedILP
from jscaler.search.candidates import builtin_candidates as builtin_candidates
from jscaler.search.candidates import register_candidates as register_candidates
from jscaler.search.candidates import register_schedule as register_schedule
from jscaler.search.ilp import Solution as Solution
from jscaler.search.ilp import brute_force as brute_force
from jscaler.search.ilp import explain as explain
from jscaler.search.ilp import solve as solve
from jscaler.search.ilp import to_plan as to_plan
from jscaler.search.joint import Auto as Auto
from jscaler.search.joint import SearchResult as SearchResult
from jscaler.search.joint import auto as auto
from jscaler.search.joint import search as search
from jscaler.search.order import OrderResult as OrderResult
from jscaler.search.order import search_order as search_order
from jscaler.search.problem import Problem as Problem
from jscaler.search.problem import build_problem as build_problem
from jscaler.search.problem import fits_at_all as fits_at_all
from jscaler.search.problem import least_memory as least_memory
from jscaler.search.problem import objective as objective
from jscaler.search.propagate import propagate as propagate
from jscaler.search.stages import best_split as best_split
from jscaler.search.stages import layer_costs as layer_costs
from jscaler.search.stages import slice_stages as slice_stages
