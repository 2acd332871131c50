"""The free parameters of each space, as the settings a search tries on N devices.

A space fixes the structure of a plan and leaves knobs (degrees, stages, ZeRO stage,
recompute); ``settings(name, n)`` lists the space's instances worth trying on ``n``
devices: degrees that divide ``n`` (tensor degrees within a node of 8), pipelines of 1, 2
and 4 stages. ``jscaler plan --space NAME`` predicts each with the cost model and ranks
them (the best that fits first).
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


def settings(name: str, n: int) -> list[tuple[str, object]]:
    """``[(expression, space)]`` for space ``name`` on ``n`` devices."""
    if name not in SPACES:
        raise KeyError(f"no space {name!r}; spaces: {sorted(SPACES)}")
    make = SPACES[name]
    out: list[tuple[str, dict]] = []
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
    elif name == "alpa_like":
        out = [{"pp": pp} for pp in PP if _divides(n, pp)]
    else:
        out = [{}]
    return [(expression(name, kw), make(**kw)) for kw in out]


def expression(name: str, kw: dict) -> str:
    """The plan expression of space ``name`` with knobs ``kw``: ``megatron(tp=2, pp=1)``."""
    args = ", ".join(f"{k}={v!r}" for k, v in kw.items())
    return f"{name}({args})"
