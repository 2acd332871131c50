"""The free parameters of each space, as the settings a search tries on N devices.

A space fixes the structure of a plan and leaves knobs (degrees, stages, ZeRO stage,
recompute); ``settings(name, n)`` lists the space's instances worth trying on ``n``
devices: degrees that divide ``n`` (tensor degrees within a node of 8), pipelines of 1, 2
and 4 stages. ``jscaler plan --space NAME`` predicts each with the cost model and ranks
them (the best that fits first).

Given the graph, a setting the model cannot take is left out: expert parallelism's ``ep``
must divide every stacked expert weight's expert count (``expert`` tries each such ``ep``
alone, with ``tp`` inside the experts, and with ZeRO-1 and ZeRO-3; as ``plan="auto"``'s
candidates, the ZeRO ones only where ``ep`` alone does not fit, as recompute is tried).
"""

from __future__ import annotations

from spaces import SPACES

TP = (1, 2, 4, 8)
PP = (1, 2, 4)


def _divides(n: int, *ks: int) -> bool:
    prod = 1
    for k in ks:
        prod *= k
    return n % prod == 0


def settings(name: str, n: int, graph=None) -> list[tuple[str, object]]:
    """``[(expression, space)]`` for space ``name`` on ``n`` devices (for ``graph``'s
    model when given)."""
    return [(expression(name, kw), SPACES[name](**kw)) for kw in knob_settings(name, n, graph)]


def knob_settings(name: str, n: int, graph=None) -> list[dict]:
    """The knobs of space ``name``'s settings on ``n`` devices; with ``graph``, only
    those its model can take (see the module doc)."""
    if name not in SPACES:
        raise KeyError(f"no space {name!r}; spaces: {sorted(SPACES)}")
    out: list[dict] = []
    if name in ("megatron", "megatron_3d"):
        for tp in TP:
            for pp in PP:
                if _divides(n, tp, pp) and (name == "megatron" or pp > 1):
                    out.append({"tp": tp, "pp": pp, "recompute": 1})
    elif name == "deepspeed":
        out = [{"tp": tp, "recompute": 1} for tp in TP if _divides(n, tp) and n // tp > 1]
    elif name == "zero":
        out = [{"stage": s} for s in (1, 2, 3)]
    elif name == "dp":
        out = [{}, {"recompute": 1}]
    elif name == "coshard":
        for tp in TP[1:]:
            for colocate in (2, 4):
                for pp in PP:
                    if _divides(n, tp, pp):
                        out.append({"tp": tp, "colocate": colocate, "pp": pp})
    elif name == "interlaced":
        out = [{"pp": pp, "tp": tp} for pp in (2, 4) for tp in TP if _divides(n, tp, pp)]
    elif name == "alphafold_3f1b":
        for pp in (2, 4):
            for k in TP:
                if _divides(n, k, pp):
                    out.append({"pp": pp, "tp": k})
                    if k > 1:
                        out.append({"pp": pp, "dap": k})
    elif name == "dap":
        out = [{"dap": k} for k in TP[1:] if _divides(n, k)]
    elif name in ("ulysses", "ring"):
        out = [{"sp": k} for k in TP[1:] if _divides(n, k)]
    elif name == "expert":
        out = _expert_settings(n, graph)
    elif name == "alpa_like":
        out = [{"pp": pp} for pp in PP if _divides(n, pp)]
    else:
        out = [{}]
    return out


def _expert_settings(n: int, graph) -> list[dict]:
    """``ep`` alone, with ``tp`` inside the experts (``ep x tp`` dividing ``n``, ``tp``
    within a node) and with ZeRO-1 / ZeRO-3 over the replicas; ``ep`` dividing ``n`` and,
    given the graph, every expert count (none found: no setting)."""
    counts = None
    if graph is not None:
        from spaces.expert import expert_axes

        counts = {graph.tensors[t].shape[a] for t, a in expert_axes(graph)}
        if not counts:
            return []
    out = []
    for ep in TP[1:]:
        if not _divides(n, ep) or (counts is not None and any(c % ep for c in counts)):
            continue
        out.append({"ep": ep})
        out += [{"ep": ep, "tp": tp} for tp in TP[1:-1] if _divides(n, ep, tp)]
        out += [{"ep": ep, "zero": zero} for zero in (1, 3)]
    return out


def expression(name: str, kw: dict) -> str:
    """The plan expression of space ``name`` with knobs ``kw``: ``megatron(tp=2, pp=1)``."""
    args = ", ".join(f"{k}={v!r}" for k, v in kw.items())
    return f"{name}({args})"


def state_shards(name: str, kw: dict, n: int) -> int:
    """How many ways a setting splits the model state, at the least (0: not bounded)."""
    if name in ("megatron", "megatron_3d", "coshard"):
        return n if kw.get("zero") == 3 else kw.get("tp", 1) * kw.get("pp", 1)
    if name == "expert":  # a device holds the dense part over tp, the experts over ep x tp
        return n if kw.get("zero") else kw["ep"] * kw.get("tp", 1)
    if name == "deepspeed" or (name == "zero" and kw.get("stage") == 3):
        return n
    if name in ("dp", "dap", "zero", "ulysses", "ring"):
        return 1
    return 0


# searched elsewhere: megatron_3d is megatron with pp > 1; alpa_like is the engine's own
# ILP pipelines (jscaler.search.StagedILP) with even stages
NOT_SEARCHED = ("megatron_3d", "alpa_like")


def candidates(graph, n: int) -> list:
    """Every space's settings on ``n`` devices as candidates of ``plan="auto"``
    (registered by ``import spaces``): a setting with ``recompute=1`` comes with its
    version without, the recomputing one tried only where that one does not fit; an
    expert setting with ZeRO likewise only where the one without does not fit."""
    from jscaler.search import Candidate

    out = []
    for name in sorted(SPACES):
        if name in NOT_SEARCHED:
            continue
        for kw in knob_settings(name, n, graph):
            expr, space = expression(name, kw), SPACES[name](**kw)
            shards, stages = state_shards(name, kw, n), kw.get("pp", 1)
            if kw.get("recompute"):
                plain = {k: v for k, v in kw.items() if k != "recompute"}
                base = expression(name, plain)
                out.append(Candidate(base, SPACES[name](**plain), shards, stages))
                out.append(
                    Candidate(
                        expr, space, shards, stages, fallback_of=base, recompute=kw["recompute"]
                    )
                )
            elif name == "expert" and kw.get("zero"):  # ZeRO saves memory, never time
                base = expression(name, {k: v for k, v in kw.items() if k != "zero"})
                out.append(Candidate(expr, space, shards, stages, fallback_of=base))
            else:
                out.append(Candidate(expr, space, shards, stages))
    return list({c.name: c for c in out}.values())
