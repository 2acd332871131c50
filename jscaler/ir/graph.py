"""The Graph IR: the forward computation of a loss as ops over pTensors.

A :class:`Graph` is what :func:`jscaler.trace` returns. Its ops are jaxpr equations with
nested ``jit`` calls inlined; custom-derivative and rematerialised calls stay whole as
``call`` ops (their custom gradients survive) and ``scan`` stays a ``loop`` op that
:func:`jscaler.ir.unroll` expands. Every op carries its Flax module path and its dim
annotation. Running a graph on values is :func:`jscaler.ir.evaluate`.

The graph is immutable: :meth:`select`, :func:`~jscaler.ir.unroll` and friends return new
graphs. This module imports no other module of the IR but ``annotation``.
"""

from __future__ import annotations

import fnmatch
import functools
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from jscaler.ir.annotation import Annotation
from jscaler.ir.memo import Memoized

__all__ = [
    "LOOP_PRIMITIVES", "Coverage", "Graph", "Layer", "Literal", "Loop", "Op", "Remat", "Tensor",
]  # fmt: skip

# the ops that join an exposed scan's body to the graph around it (jscaler.ir.expose)
LOOP_PRIMITIVES = ("scan_carry", "scan_slice", "scan_final", "scan_stack")


@dataclass(frozen=True)
class Tensor:
    """A logical tensor (pTensor) of the graph.

    Attributes:
      id: unique within the graph.
      shape, dtype: its abstract value.
      role: ``param`` (trained), ``state`` (other model variables, e.g. RNG counters or
        batch statistics), ``batch``, ``const`` (closed-over constant) or ``value``
        (computed by an op).
      name: where it comes from, e.g. ``blocks/0/attn/q_proj/kernel`` or ``batch/tokens``;
        empty for computed values.
    """

    id: int
    shape: tuple[int, ...]
    dtype: str
    role: str = "value"
    name: str = ""

    @property
    def size(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class Literal:
    """A constant operand written inline in the jaxpr (e.g. ``2.0`` in ``x * 2``)."""

    value: Any = field(compare=False)
    dtype: str = ""

    def __repr__(self):
        return f"Literal({self.value!r})"


@dataclass(frozen=True)
class Loop:
    """A ``scan`` whose body's ops are graph ops (:func:`jscaler.ir.expose.expose_loops`).

    The ops of one exposed scan are contiguous and all carry the same Loop: per carry a
    ``scan_carry`` (initial value -> the body's carry in), per stacked input a
    ``scan_slice`` (the stack -> one iteration's slice), the body's ops, then per carry a
    ``scan_final`` (the body's carry out -> the scan's result) and per stacked output a
    ``scan_stack``. They describe one iteration; the loop runs them ``length`` times.

    Attributes:
      index: which exposed scan of the graph (0, 1, ... in order).
      length, reverse, unroll: the scan's own parameters.
      carries: (carry-in tensor, carry-out tensor) per carry: one value across iterations.
    """

    index: int
    length: int
    reverse: bool = False
    unroll: int = 1
    carries: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class Remat:
    """A user's ``jax.checkpoint`` (``nnx.remat``, ``nn.remat``) whose ops an exposed scan's
    body holds as its own: they run again in the backward, under the user's ``policy``
    (None: nothing saved). ``index`` tells two checkpoints of one body apart."""

    index: int
    policy: Any = field(default=None, compare=False)
    prevent_cse: bool = True


@dataclass(frozen=True)
class Op:
    """One operation of the graph.

    Attributes:
      id: unique within the graph; ops are stored in a valid execution order.
      primitive: the jaxpr primitive name (``dot_general``, ``custom_jvp_call``, ``scan``).
      inputs: tensor ids, or :class:`Literal` for inline constants.
      outputs: tensor ids.
      path: the Flax module path, e.g. ``blocks/0/attn/q_proj``.
      annotation: the dim annotation, None when no rule exists (only in non-strict traces).
      flops: floating-point operations of one execution.
      kind: ``op`` (a primitive), ``call`` (a custom-derivative or remat call kept whole,
        ``body`` is its inner graph) or ``loop`` (a scan, ``body`` is one iteration).
      loop: the exposed scan this op runs in (:class:`Loop`), None outside every scan.
      remat: the user's checkpoint the op runs under inside a scan's body (:class:`Remat`).
    """

    id: int
    primitive: str
    inputs: tuple[int | Literal, ...]
    outputs: tuple[int, ...]
    path: str
    annotation: Annotation | None
    flops: float
    kind: str = "op"
    eqn: Any = field(default=None, compare=False, repr=False)
    body: Graph | None = field(default=None, compare=False, repr=False)
    loop: Loop | None = None
    remat: Remat | None = None

    @property
    def repeats(self) -> int:
        """How many times the op runs per step: its scan's length, else 1."""
        return 1 if self.loop is None else self.loop.length

    @functools.cached_property
    def tensor_inputs(self) -> tuple[int, ...]:
        return tuple(i for i in self.inputs if not isinstance(i, Literal))

    @property
    def where(self) -> str:
        """``primitive at module path``, for messages."""
        return f"{self.primitive!r} (op {self.id}) at module path {self.path or '<root>'!r}"


@dataclass(frozen=True)
class Coverage:
    """Fractions (0..1) of ops and of FLOPs that carry a dim annotation."""

    ops: float
    flops: float


@dataclass(frozen=True)
class Layer:
    """One repeated layer: the i-th entry of one or more parallel module lists."""

    name: str
    index: int
    graph: Graph = field(compare=False, repr=False)


@dataclass(frozen=True, eq=False)
class Graph(Memoized):
    """Ops over tensors, with graph-level inputs and outputs (tensor ids or literals).

    ``consts`` holds the values of ``const`` tensors; ``signature`` (top-level graphs
    only) knows how to call the graph like the traced loss function.
    """

    tensors: dict[int, Tensor]
    ops: tuple[Op, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int | Literal, ...]
    consts: dict[int, Any] = field(default_factory=dict)
    signature: Any = None

    # ---- lookup ----------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.ops)

    def __iter__(self) -> Iterator[Op]:
        return iter(self.ops)

    def op(self, op_id: int) -> Op:
        for o in self.ops:
            if o.id == op_id:
                return o
        raise KeyError(f"no op with id {op_id} in this graph")

    def producer(self, tensor_id: int) -> Op | None:
        return self._producers().get(tensor_id)

    def consumers(self, tensor_id: int) -> tuple[Op, ...]:
        return self._consumers().get(tensor_id, ())

    def _consumers(self) -> dict[int, tuple[Op, ...]]:
        cache = self.__dict__.get("_consumer_cache")
        if cache is None:
            users: dict[int, list[Op]] = {}
            for o in self.ops:
                for t in dict.fromkeys(o.tensor_inputs):
                    users.setdefault(t, []).append(o)
            cache = {t: tuple(us) for t, us in users.items()}
            object.__setattr__(self, "_consumer_cache", cache)
        return cache

    def _producers(self) -> dict[int, Op]:
        cache = self.__dict__.get("_producer_cache")
        if cache is None:
            cache = {t: o for o in self.ops for t in o.outputs}
            object.__setattr__(self, "_producer_cache", cache)
        return cache

    @property
    def flops(self) -> float:
        """FLOPs of one forward pass (an exposed scan's body counted once per iteration)."""
        return float(sum(o.flops * o.repeats for o in self.ops))

    def params(self) -> tuple[Tensor, ...]:
        """The trained parameters among the inputs, in input order."""
        return tuple(self.tensors[i] for i in self.inputs if self.tensors[i].role == "param")

    def param_behind(self, t, views) -> int | None:
        """The parameter tensor ``t`` is, through at most three ops whose primitives are in
        ``views`` (a weight's casts and transposes before its matmul) or that take one
        layer's slice of a stacked parameter (an exposed scan's ``scan_slice``, a pipeline
        chunk's ``scan_chunk``), or None."""
        for _ in range(4):
            if isinstance(t, Literal):
                return None
            if self.tensors[t].role == "param":
                return t
            op = self.producer(t)
            if op is None or op.primitive not in (*views, "scan_slice", "scan_chunk"):
                return None
            t = op.inputs[0]
        return None

    # ---- subgraphs -------------------------------------------------------------------

    def subgraph(self, ops: Sequence[Op]) -> Graph:
        """The graph of the given ops; its inputs and outputs are the boundary tensors."""
        chosen = {o.id for o in ops}
        ops = tuple(o for o in self.ops if o.id in chosen)
        produced = {t for o in ops for t in o.outputs}
        inputs: dict[int, None] = {}
        for o in ops:
            for t in o.tensor_inputs:
                if t not in produced:
                    inputs.setdefault(t)
        graph_outputs = {t for t in self.outputs if not isinstance(t, Literal)}
        users = self._consumers()
        outputs = tuple(
            t
            for o in ops
            for t in o.outputs
            if t in graph_outputs or any(u.id not in chosen for u in users.get(t, ()))
        )
        keep = set(inputs) | produced
        return Graph(
            {i: t for i, t in self.tensors.items() if i in keep},
            ops,
            tuple(inputs),
            outputs,
            {i: v for i, v in self.consts.items() if i in keep},
        )

    def select(self, pattern: str) -> Graph:
        """Ops whose module path matches a glob, as a subgraph.

        ``*`` matches within one path component, ``**`` across components. A pattern that
        matches a module selects everything inside it: ``"blocks/*/attn"`` selects every
        op of every block's attention, as does ``"blocks/*/attn/**"``.
        """
        rx = _glob_regex(pattern)
        return self.subgraph([o for o in self.ops if rx.match(o.path)])

    def layers(self) -> tuple[Layer, ...]:
        """Groups ops into repeated layers, in execution order.

        A layer is the i-th entry of a module list (a path component that is an integer,
        e.g. ``blocks/3/...``). Lists under the same parent with the same entries are
        parallel (``attns/i`` and ``mlps/i``) and form one layer per index. Computed once
        per graph.
        """
        return self._once("_layer_cache", self._find_layers)

    def layer_runs(self) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """The runs of repeated layers in execution order: per maximal run of one layer's
        ops (ops outside every layer end a run and belong to none), the layer's index in
        :meth:`layers` and the run's op ids. A model that runs its layers once per forward
        pass (AlphaFold2's recycling) has a run per layer per pass; others, one per layer.
        Computed once per graph.
        """
        return self._once("_run_cache", self._find_runs)

    def _once(self, key: str, make):
        """``make()``, computed on the first call and kept on the graph under ``key``."""
        cached = self.__dict__.get(key)
        if cached is None:
            cached = make()
            object.__setattr__(self, key, cached)
        return cached

    def _find_runs(self) -> tuple[tuple[int, tuple[int, ...]], ...]:
        index = {o.id: i for i, lay in enumerate(self.layers()) for o in lay.graph.ops}
        runs: list[tuple[int, list[int]]] = []
        last = None  # the layer of the op before (None: outside every layer)
        for o in self.ops:
            here = index.get(o.id)
            if here is not None:
                if here != last:
                    runs.append((here, []))
                runs[-1][1].append(o.id)
            last = here
        return tuple((i, tuple(ids)) for i, ids in runs)

    def _find_layers(self) -> tuple[Layer, ...]:
        members: dict[tuple[str, str], dict[int, list[Op]]] = {}
        for o in self.ops:
            entry = _list_entry(o.path)
            if entry is not None:
                key, i = entry
                members.setdefault(key, {}).setdefault(i, []).append(o)
        if not members:
            members = self._members_by_params()
        families: dict[tuple[str, tuple[int, ...]], list[str]] = {}
        for (parent, lst), entries in members.items():
            families.setdefault((parent, tuple(sorted(entries))), []).append(lst)
        layers = []
        for (parent, indices), lists in families.items():
            prefix = parent + "/" if parent else ""
            for i in indices:
                ops = [o for lst in lists for o in members[(parent, lst)][i]]
                name = "+".join(f"{prefix}{lst}/{i}" for lst in lists)
                layers.append((min(o.id for o in ops), Layer(name, i, self.subgraph(ops))))
        return tuple(layer for _, layer in sorted(layers, key=lambda x: x[0]))

    def _members_by_params(self) -> dict[tuple[str, str], dict[int, list[Op]]]:
        """Module-list entries of a graph whose ops carry no module paths (a function of a
        params pytree): from the parameters' names. An op reading a parameter of entry i
        of a list (``blocks/3/qkv/kernel``, directly or through casts, transposes and
        reshapes) belongs to that entry; one reading another parameter to none; an op
        reading no parameter to the entry of the last op that did. Only lists whose
        entries hold the same parameters count (repeated layers)."""
        views = {"convert_element_type", "copy", "transpose", "reshape", "broadcast_in_dim"}
        members: dict[tuple[str, str], dict[int, list[Op]]] = {}
        current = None
        for o in self.ops:
            names = []
            for t in o.tensor_inputs:
                p = self.param_behind(t, views)
                if p is not None:
                    names.append(self.tensors[p].name)
            if names:
                entries = {_list_entry(n) for n in names}
                current = entries.pop() if len(entries) == 1 else None
            if current is not None:
                key, i = current
                members.setdefault(key, {}).setdefault(i, []).append(o)
        return {k: v for k, v in members.items() if len(v) > 1 and self._same_params(k, v)}

    def _same_params(self, key: tuple[str, str], entries: dict[int, list[Op]]) -> bool:
        """Whether every entry of list ``key`` holds the same parameters (names below the
        entry, shapes): repeated layers, not a list of differently shaped ones."""
        prefix = f"{key[0]}/{key[1]}/" if key[0] else f"{key[1]}/"
        held: dict[str, set] = {}
        for t in self.params():
            if t.name.startswith(prefix):
                i, _, rest = t.name[len(prefix) :].partition("/")
                held.setdefault(i, set()).add((rest, t.shape))
        return len(held) == len(entries) and len({frozenset(v) for v in held.values()}) == 1

    # ---- analysis --------------------------------------------------------------------

    def coverage(self) -> Coverage:
        """Fractions of ops and of FLOPs whose op carries a dim annotation."""
        if not self.ops:
            return Coverage(1.0, 1.0)
        annotated = [o for o in self.ops if o.annotation is not None]
        total = self.flops
        covered = sum(o.flops * o.repeats for o in annotated)
        return Coverage(len(annotated) / len(self.ops), covered / total if total else 1.0)

    def unannotated(self) -> tuple[Op, ...]:
        return tuple(o for o in self.ops if o.annotation is None)

    # ---- execution -------------------------------------------------------------------

    def as_fn(self) -> Callable:
        """A callable with the traced loss function's signature, computing it from the ops.

        For an nnx model it updates the model's non-parameter state (RNG counters, batch
        statistics) as the original did.
        """
        if self.signature is None:
            raise TypeError(
                "as_fn() needs a traced graph; run a subgraph with jscaler.ir.evaluate(graph, ...)"
            )
        return self.signature.make_fn(self)


def _glob_regex(pattern: str) -> re.Pattern:
    parts = []
    for i, piece in enumerate(pattern.split("**")):
        if i:
            parts.append(".*")
        parts.append(fnmatch.translate(piece)[4:-3].replace(".*", "[^/]*"))
    return re.compile("^(?:" + "".join(parts) + ")(?:/.*)?$")


def _list_entry(path: str) -> tuple[tuple[str, str], int] | None:
    """``((parent, list name), index)`` of the first module-list entry in ``path``
    (``model/blocks/3/attn`` -> ``(("model", "blocks"), 3)``), or None."""
    parts = path.split("/") if path else []
    k = next((k for k, p in enumerate(parts) if k > 0 and p.isdigit()), None)
    if k is None:
        return None
    return ("/".join(parts[: k - 1]), parts[k - 1]), int(parts[k])
