"""Reading the collectives XLA compiled, from ``compiled.as_text()``.

Each collective is counted with its kind, its per-device payload in bytes (the larger of
what one device sends or receives: the gathered result of an all-gather, the input of a
reduce-scatter, the buffer of an all-reduce), the mesh axes it runs over and the module
path jax recorded for it. The CPU backend does not form reduce-scatters: an all-reduce
whose every user keeps only 1/n of it (n devices in its group) is counted as one. Nor
does it fold an all-reduce whose only reader is an all-reduce over other mesh axes (the
SPMD partitioner reduces a contraction split over two axes one axis at a time; the GPU
compiler's AllReduceFolder makes the pair one all-reduce over both): such a pair is
counted as that one all-reduce, as it runs on a GPU. A collective inside a ``while`` loop
(a ``scan`` over layers) runs once per iteration: it counts ``times`` = the loop's known
trip count (nested loops multiply).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

__all__ = ["Collective", "collectives", "summarize"]

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
    "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16,
}  # fmt: skip
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)$")
_SHAPE = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_LIST_GROUPS = re.compile(r"replica_groups=\{\{([\d,]*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


@dataclass(frozen=True)
class Collective:
    kind: str
    bytes: int
    axes: tuple[str, ...]
    group: int
    op_name: str
    name: str
    times: int = 1  # runs per step: the trip counts of the while loops around it


def _shape_bytes(text: str) -> tuple[int, int]:
    """(bytes, elements) of an HLO result type (a shape or a tuple of shapes)."""
    total_b = total_e = 0
    for dtype, dims in _SHAPE.findall(text):
        if dtype not in DTYPE_BYTES:
            continue
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        total_b += n * DTYPE_BYTES[dtype]
        total_e += n
    return total_b, total_e


_AXIS = re.compile(r"'([^']+)'(?:=(\d+)|:\((\d+)\)(\d+))?")


def _group(line: str, mesh) -> tuple[tuple[str, ...], int]:
    """(mesh axes, devices per group) of a collective; sub-axes read as 'tp:(1)2'.

    With ``mesh`` (``((name, size), ...)``, major first), anonymous axes (``axis_0``) and
    explicit device groups are named by the mesh axes they span."""
    m = _MESH_GROUPS.search(line)
    if m:
        declared = [(a, int(s)) for a, s, _, _ in _AXIS.findall(m.group(1)) if s]
        sizes = dict(declared)
        rename = {}
        named = [(n, size) for n, size in mesh or () if size > 1]
        if named and [s for _, s in declared] == [s for _, s in named]:
            rename = {a: n for (a, _), (n, _) in zip(declared, named)}
        axes, group = [], 1
        for name, _, _, sub in _AXIS.findall(m.group(2)):
            group *= int(sub) if sub else sizes.get(name, 1)
            name = rename.get(name, name)
            axes.append(name if not sub else f"{name}:{sub}")
        return tuple(axes), group
    m = _LIST_GROUPS.search(line)
    if m:
        ids = [int(x) for x in m.group(1).split(",") if x]
        return _spanned(ids, mesh), len(ids)
    m = _PAIRS.search(line)
    if m:  # collective-permute: the axes along which sources and targets differ
        pairs = [
            tuple(int(x) for x in p.split(",")) for p in re.findall(r"\{(\d+,\d+)\}", m.group(1))
        ]
        axes = set()
        for a, b in pairs:
            axes.update(_spanned([a, b], mesh))
        return tuple(n for n, _ in mesh or () if n in axes), 2
    m = _IOTA_GROUPS.search(line)
    if m:  # [groups, size]<=[dims]T(perm): iota over dims, transposed, cut into groups
        n_groups, size = int(m.group(1)), int(m.group(2))
        dims = [int(x) for x in m.group(3).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(4):
            ids = ids.transpose([int(x) for x in m.group(4).split(",")])
        first = ids.reshape(n_groups, size)[0].tolist()
        return _spanned(first, mesh), size
    return (), 1


def _spanned(ids: list[int], mesh) -> tuple[str, ...]:
    """The mesh axes along which a group of flat device positions varies."""
    if not mesh:
        return ()
    coords = []
    for i in ids:
        c = []
        for _, size in reversed(mesh):
            c.append(i % size)
            i //= size
        coords.append(c[::-1])
    return tuple(name for k, (name, _) in enumerate(mesh) if len({c[k] for c in coords}) > 1)


def collectives(hlo_text: str, mesh=None) -> list[Collective]:
    """Every collective of a compiled HLO module (async start/done pairs counted once).

    Args:
      mesh: the program's mesh axes ``((name, size), ...)``, to name the axes of groups
        XLA prints as device lists or with anonymous axis names.
    """
    instrs = {}
    users = defaultdict(list)
    runs = _runs(hlo_text)
    where = {}  # instruction -> its computation
    computation = ""
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        head = None if m else _COMPUTATION.match(line)
        if head:
            computation = head.group(1)
        if not m:
            continue
        name, rtype, opcode, rest = m.groups()
        instrs[name] = (rtype, opcode, line)
        where[name] = computation
        for operand in re.findall(r"%([\w.\-]+)", rest.split("),")[0]):
            users[operand].append(name)
    folded = _folded_pairs(instrs, users, mesh)
    out = []
    for name, (rtype, opcode, line) in instrs.items():
        kind = opcode.removesuffix("-start")
        if kind not in KINDS or opcode.endswith("-done"):
            continue
        axes, group = _group(line, mesh)
        op = _OP_NAME.search(line)
        op_name = op.group(1) if op else ""
        parts = _tuple_parts(rtype)
        if kind == "all-to-all" and len(parts) > 1:
            parts = [rtype]  # one exchange: its tuple holds the n chunks of one buffer
        for i, part in enumerate(parts):
            if (name, i) in folded.inner:
                continue
            part_axes, part_group = axes, group
            if (name, i) in folded.outer:
                inner_axes, inner_group = folded.outer[name, i]
                part_axes = _in_mesh_order(inner_axes + axes, mesh)
                part_group = inner_group * group
            nbytes, elems = _shape_bytes(part)
            part_kind = kind
            if kind == "reduce-scatter":
                nbytes *= group
            elif kind == "all-reduce" and part_group > 1:
                readers = _readers(name, i, len(parts) > 1, instrs, users)
                kept = [_shape_bytes(instrs[u][0])[1] for u in readers]
                if kept and all(k * part_group == elems for k in kept):
                    part_kind = "reduce-scatter"
            times = runs.get(where[name], 1)
            out.append(Collective(part_kind, nbytes, part_axes, part_group, op_name, name, times))
    return out


_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\))?.*\{\s*$")
_CALLED = re.compile(
    r"\b(body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')


def _runs(hlo_text: str) -> dict[str, int]:
    """computation name -> how many times it runs per execution of the entry: a while
    loop's body its known trip count times its caller's (1 when XLA does not know it)."""
    calls: dict[str, list[tuple[str, int]]] = defaultdict(list)
    entry, computation = None, ""
    for line in hlo_text.splitlines():
        head = _COMPUTATION.match(line)
        if head and not _INSTR.match(line):
            computation = head.group(1)
            if line.lstrip().startswith("ENTRY"):
                entry = computation
            continue
        trips = _TRIPS.search(line)
        for role, callee in _CALLED.findall(line):
            n = int(trips.group(1)) if trips and role == "body" else 1
            calls[computation].append((callee, n))
        for group in _BRANCHES.findall(line):
            for callee in re.findall(r"%?([\w.\-]+)", group):
                calls[computation].append((callee, 1))
    runs: dict[str, int] = {}
    todo = [(entry, 1)] if entry else []
    while todo:
        comp, n = todo.pop()
        if runs.get(comp, 0) >= n:
            continue
        runs[comp] = n
        todo.extend((callee, n * k) for callee, k in calls.get(comp, ()))
    return runs


@dataclass(frozen=True)
class _Folds:
    inner: frozenset  # (all-reduce, element) whose only reader is another all-reduce
    outer: dict  # (all-reduce, element) -> (axes, group) of the inner one it absorbs


def _folded_pairs(instrs, users, mesh) -> _Folds:
    """All-reduce elements read only by an all-reduce over disjoint mesh axes."""
    inner, outer = set(), {}
    for name, (rtype, opcode, line) in instrs.items():
        if opcode not in ("all-reduce", "all-reduce-start"):
            continue
        axes, group = _group(line, mesh)
        is_tuple = len(_tuple_parts(rtype)) > 1
        for i in range(len(_tuple_parts(rtype))):
            readers = _readers(name, i, is_tuple, instrs, users)
            if len(readers) != 1 or instrs[readers[0]][1] not in ("all-reduce", "all-reduce-start"):
                continue
            reader = readers[0]
            r_axes, _ = _group(instrs[reader][2], mesh)
            position = _operand_position(instrs[reader][2], name, i, is_tuple, instrs)
            if not axes or not r_axes or set(axes) & set(r_axes) or position is None:
                continue
            inner.add((name, i))
            outer[reader, position] = (axes, group)
    return _Folds(frozenset(inner), outer)


def _operand_position(line, name, index, is_tuple, instrs) -> int | None:
    """Which operand of the instruction ``line`` is element ``index`` of ``name``."""
    m = _INSTR.match(line)
    operands = re.findall(r"%([\w.\-]+)", m.group(4).split("),")[0]) if m else []
    for k, operand in enumerate(operands):
        if not is_tuple and operand == name:
            return k
        rtype, opcode, text = instrs.get(operand, ("", "", ""))
        if (
            is_tuple
            and opcode == "get-tuple-element"
            and re.search(rf"\(%{re.escape(name)}\)", text)
            and re.search(rf"index={index}\b", text)
        ):
            return k
    return None


def _in_mesh_order(axes, mesh) -> tuple[str, ...]:
    order = [n for n, _ in mesh or ()]
    return tuple(sorted(axes, key=lambda a: order.index(a) if a in order else len(order)))


def _tuple_parts(rtype: str) -> list[str]:
    """The element types of a tuple result (a plain shape is a one-element list)."""
    rtype = rtype.strip()
    if not rtype.startswith("("):
        return [rtype]
    return [m.group(0) for m in _SHAPE.finditer(rtype)]


def _readers(name, index, is_tuple, instrs, users):
    """The instructions reading element ``index`` of ``name`` (through get-tuple-element)."""
    if not is_tuple:
        return [u for u in users.get(name, []) if u in instrs]
    out = []
    for u in users.get(name, []):
        rtype, opcode, line = instrs.get(u, ("", "", ""))
        if opcode == "get-tuple-element" and re.search(rf"index={index}\b", line):
            out.extend(v for v in users.get(u, []) if v in instrs)
    return out


def summarize(colls: list[Collective]) -> dict[str, tuple[int, int]]:
    """kind -> (count, bytes)."""
    out: dict[str, tuple[int, int]] = {}
    for c in colls:
        n, b = out.get(c.kind, (0, 0))
        out[c.kind] = (n + c.times, b + c.bytes * c.times)
    return out
