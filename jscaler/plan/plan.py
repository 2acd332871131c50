"""Plan: a frozen record of op-trans, op-assign and op-order decisions over a graph.

Each op of the plan graph (forward ops, per-parameter grad/update ops, inserted
identities) has a *tree* of sub-ops: the root is the whole op; ``op_trans`` turns a leaf
into a split or replicate node with n children; ``op_assign`` gives a leaf a device. A
sub-op is named by its op id and the child indices from the root: ``SubOp(14, (1, 3))``
is piece 3 of piece 1 of op 14.

A Plan is immutable and hashable (its compiled programs are cached on it) and round-trips
through JSON exactly. It keeps its graph for convenience, but its identity is the graph's
fingerprint, not the object.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType
from typing import Any, ClassVar

from jscaler.errors import PlanError
from jscaler.ir.graph import Graph
from jscaler.ir.memo import Memoized
from jscaler.plan.augment import PlanGraph, augment
from jscaler.plan.mesh import MeshSpec

__all__ = ["REGION_KINDS", "Node", "Plan", "Region", "SubOp", "graph_fingerprint"]

# Manual regions the lowering knows how to run (``jscaler.compile`` holds their kernels):
# ring attention over a mesh axis; coshard (colocated pieces one after another); and any
# subgraph run on local shards with the collectives the plan's layouts imply.
REGION_KINDS = ("ring_attention", "coshard", "shard_map")
NEEDS_AXIS = ("ring_attention",)

PLAN_FORMAT = 1


@dataclass(frozen=True)
class SubOp:
    """A sub-op: op id and the child index at each level of its op's tree."""

    op: int
    path: tuple[int, ...] = ()

    def __str__(self):
        return f"{self.op}" + "".join(f".{i}" for i in self.path)


@dataclass(frozen=True)
class Node:
    """A node of an op's sub-op tree.

    ``algo`` is ``'leaf'`` (a sub-op that runs; ``device`` is where), ``'split'`` (its
    ``children`` compute slices along annotation dim ``dim``, or partial sums when the
    dim is '+'), or ``'replicate'`` (every child computes the whole).
    """

    algo: str = "leaf"
    dim: str | None = None
    children: tuple[Node, ...] = ()
    device: int | None = None

    def __post_init__(self):
        if self.algo not in ("leaf", "split", "replicate"):
            raise PlanError(f"unknown sub-op algorithm {self.algo!r}")
        if self.algo == "leaf" and self.children:
            raise PlanError("a leaf sub-op has no children")
        if self.algo != "leaf" and (len(self.children) < 1 or self.device is not None):
            raise PlanError(f"a {self.algo} node needs children and no device")
        if self.algo == "split" and not self.dim:
            raise PlanError("a split node needs the dim it splits")

    def at(self, path: tuple[int, ...]) -> Node:
        node = self
        for i in path:
            if i >= len(node.children):
                raise PlanError(f"no sub-op at {path}: the tree has no child {i} there")
            node = node.children[i]
        return node

    def replace(self, path: tuple[int, ...], new: Node) -> Node:
        if not path:
            return new
        kids = list(self.children)
        kids[path[0]] = kids[path[0]].replace(path[1:], new)
        return Node(self.algo, self.dim, tuple(kids), self.device)

    def leaves(self, path: tuple[int, ...] = ()) -> tuple[tuple[tuple[int, ...], Node], ...]:
        """``(path, leaf)`` pairs in order (walked once per tree: nodes are immutable)."""
        found = self.__dict__.get("_leaves")
        if found is None:
            out, stack = [], [((), self)]
            while stack:
                at, node = stack.pop()
                if node.algo == "leaf":
                    out.append((at, node))
                else:
                    stack.extend(
                        ((*at, i), node.children[i]) for i in reversed(range(len(node.children)))
                    )
            found = tuple(out)
            object.__setattr__(self, "_leaves", found)
        return found if not path else tuple((path + p, leaf) for p, leaf in found)

    def __hash__(self) -> int:  # trees key caches: hash each once
        found = self.__dict__.get("_hash")
        if found is None:
            found = hash((self.algo, self.dim, self.children, self.device))
            object.__setattr__(self, "_hash", found)
        return found

    def __eq__(self, other) -> bool:  # plans share subtrees: same object, or hashes first
        if self is other:
            return True
        if not isinstance(other, Node) or hash(self) != hash(other):
            return False
        return (self.algo, self.dim, self.device, self.children) == (
            other.algo, other.dim, other.device, other.children,
        )  # fmt: skip

    def to_json(self):
        if self.algo == "leaf":
            return {"device": self.device}
        d = {"algo": self.algo, "children": [c.to_json() for c in self.children]}
        if self.dim is not None:
            d["dim"] = self.dim
        return d

    @classmethod
    def from_json(cls, d) -> Node:
        if "children" not in d:
            return cls(device=d.get("device"))
        return cls(d["algo"], d.get("dim"), tuple(cls.from_json(c) for c in d["children"]))


@dataclass(frozen=True)
class Region:
    """A subgraph lowered by hand (``shard_map`` with explicit collectives) instead of by
    layouts: ``kind`` names the kernel, ``ops`` the ops it replaces, ``axis`` the mesh axis
    a kernel runs its own collectives over (the ring of ring attention; ``None`` for
    kinds whose collectives follow from the layouts)."""

    kind: str
    ops: tuple[int, ...]
    axis: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "ops", tuple(sorted(int(o) for o in self.ops)))
        if self.kind not in REGION_KINDS:
            raise PlanError(
                f"unknown manual region kind {self.kind!r}; known kinds: {list(REGION_KINDS)}"
            )
        if not self.ops:
            raise PlanError(f"a {self.kind} region needs at least one op")
        if self.kind in NEEDS_AXIS and not self.axis:
            raise PlanError(f"a {self.kind} region needs the mesh axis it runs over")

    def to_json(self):
        return {"kind": self.kind, "ops": list(self.ops), "axis": self.axis}


def graph_fingerprint(graph: Graph) -> str:
    """A stable hash of what a plan depends on: ops, annotations, shapes, param names."""
    return graph.memo((graph_fingerprint,), lambda: _fingerprint(graph))  # every plan asks


def _fingerprint(graph: Graph) -> str:
    h = hashlib.sha256()
    for o in graph.ops:
        h.update(f"{o.id}:{o.primitive}:{o.annotation}:{o.path};".encode())
    for i in graph.inputs:
        t = graph.tensors[i]
        h.update(f"{t.role}:{t.name}:{t.shape}:{t.dtype};".encode())
    return h.hexdigest()[:16]


@dataclass(frozen=True, eq=False)
class Plan(Memoized):
    """op-trans / op-assign / op-order decisions for one graph on one mesh.

    Build one with :meth:`Plan.create` and the primitives (``op_trans``, ``op_assign``,
    ``op_order``), or get one from a space (``spaces.megatron(tp=2)(graph, devices)``).
    """

    graph: Graph = field(repr=False)
    mesh: MeshSpec
    trees: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))
    identities: tuple[int, ...] = ()
    orders: tuple[tuple[SubOp, SubOp], ...] = ()
    recompute: tuple[tuple[int, ...], ...] = ()
    fingerprint: str = ""
    name: str = ""
    regions: tuple[Region, ...] = ()
    # how a search found the plan, for --explain (None: not searched): the intra-op ILP's
    # (problem, solution), the joint search's result; a plan derived from it has neither
    solved: Any = field(default=None, repr=False)
    searched: Any = field(default=None, repr=False)
    is_pipeline: ClassVar[bool] = False  # see jscaler.plan.kind.AnyPlan

    def __post_init__(self):
        object.__setattr__(self, "trees", MappingProxyType(dict(self.trees)))
        if not self.fingerprint:
            object.__setattr__(self, "fingerprint", graph_fingerprint(self.graph))

    @classmethod
    def create(cls, graph: Graph, mesh: MeshSpec, name: str = "") -> Plan:
        """A plan with every op whole and unassigned."""
        return cls(graph, mesh, name=name)

    # ---- identity ----------------------------------------------------------------------

    def _key(self):
        return (
            self.fingerprint,
            self.mesh,
            tuple(sorted(self.trees.items())),
            self.identities,
            self.orders,
            self.recompute,
            self.regions,
        )

    def __eq__(self, other):
        return isinstance(other, Plan) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def evolve(self, **changes) -> Plan:
        fields = dict(
            graph=self.graph,
            mesh=self.mesh,
            trees=self.trees,
            identities=self.identities,
            orders=self.orders,
            recompute=self.recompute,
            fingerprint=self.fingerprint,
            name=self.name,
            regions=self.regions,
        )
        fields.update(changes)
        return Plan(**fields)

    # ---- the plan graph --------------------------------------------------------------

    @cached_property
    def pgraph(self) -> PlanGraph:
        """The forward graph with identities spliced in, plus grad/update ops: one per
        graph and identities, shared by every plan that has them (with what is derived
        from its graph: dim classes, the layers, which values need gradients)."""
        key = (augment, self.identities)
        return self.graph.memo(key, lambda: augment(self.graph, self.identities))

    def tree(self, op_id: int) -> Node:
        """The sub-op tree of an op (a single unassigned leaf if untouched)."""
        return self.trees.get(op_id, Node())

    def sub_ops(self, op_id: int) -> tuple[SubOp, ...]:
        return tuple(SubOp(op_id, p) for p, _ in self.tree(op_id).leaves())

    def devices_of(self, op_id: int) -> tuple[int | None, ...]:
        return tuple(leaf.device for _, leaf in self.tree(op_id).leaves())

    def region_of(self, op_id: int) -> Region | None:
        """The manual region an op belongs to, if any."""
        return next((r for r in self.regions if op_id in r.ops), None)

    @property
    def spmd_plans(self) -> tuple:
        """Itself (see :class:`~jscaler.plan.kind.AnyPlan`)."""
        return (self,)

    def is_recomputed(self, op_id: int) -> bool:
        return any(op_id in g for g in self.recompute)

    # ---- JSON ------------------------------------------------------------------------

    def describe(self) -> dict:
        """What a process runs under this plan, JSON-able (see :class:`AnyPlan`)."""
        return {"plan": self.to_json()}

    def to_json(self) -> str:
        data = {
            "format": PLAN_FORMAT,
            "name": self.name,
            "fingerprint": self.fingerprint,
            "params": {t.name: list(t.shape) for t in self.graph.params()},
            "mesh": self.mesh.to_json(),
            "trees": {str(k): v.to_json() for k, v in sorted(self.trees.items())},
            "identities": list(self.identities),
            "orders": [[[a.op, list(a.path)], [b.op, list(b.path)]] for a, b in self.orders],
            "recompute": [list(g) for g in self.recompute],
            "regions": [r.to_json() for r in self.regions],
        }
        return json.dumps(data, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, graph: Graph, source: str = "the plan JSON") -> Plan:
        """Loads a plan for ``graph`` (``source``: where ``text`` came from, for errors);
        text that is not a jscaler plan, or a plan made for another graph, is a
        PlanError."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(
                f"{source} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}); "
                f"write plans with jscaler plan --out or Plan.to_json()"
            ) from None
        if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise PlanError(
                f"{source} is not a jscaler plan: format {found!r}, expected {PLAN_FORMAT}; "
                f"write plans with jscaler plan --out or Plan.to_json()"
            )
        if not isinstance(data.get("fingerprint"), str):
            raise PlanError(
                f"{source} is a damaged jscaler plan (no graph fingerprint); make it again "
                f"with jscaler plan --out"
            )
        fp = graph_fingerprint(graph)
        if data["fingerprint"] != fp:
            raise PlanError(f"{source}: {_mismatch_message(data, graph)}")
        try:
            return cls._from_data(data, graph, fp)
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise PlanError(
                f"{source} is a damaged jscaler plan ({type(e).__name__}: {e}); make it again "
                f"with jscaler plan --out"
            ) from None

    @classmethod
    def _from_data(cls, data: dict, graph: Graph, fp: str) -> Plan:
        return cls(
            graph,
            MeshSpec.from_json(data["mesh"]),
            {int(k): Node.from_json(v) for k, v in data["trees"].items()},
            tuple(data["identities"]),
            tuple((SubOp(a[0], tuple(a[1])), SubOp(b[0], tuple(b[1]))) for a, b in data["orders"]),
            tuple(tuple(g) for g in data["recompute"]),
            fp,
            data.get("name", ""),
            tuple(
                Region(r["kind"], tuple(r["ops"]), r.get("axis")) for r in data.get("regions", [])
            ),
        )


def _mismatch_message(data: dict, graph: Graph) -> str:
    theirs = data.get("params", {})
    ours = {t.name: list(t.shape) for t in graph.params()}
    for name in sorted(set(theirs) | set(ours)):
        if theirs.get(name) != ours.get(name):
            return (
                f"this plan was made for a different graph: param {name!r} has shape "
                f"{theirs.get(name)} in the plan and {ours.get(name)} in the model. Make the "
                f"plan again for this model (or restore the model it was made for)."
            )
    return (
        "this plan was made for a different graph (same params, different ops or batch "
        "shapes); make the plan again for this model and batch"
    )
