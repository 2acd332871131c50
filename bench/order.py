"""``jscaler bench order``: the op-order search with and without the space's order rules.

For 3F1B (AlphaFold2's three passes per micro-batch) and 1F1B at a given stage count,
the CP-SAT block scheduler (:func:`jscaler.search.search_order`) runs under 1F1B's memory
bound (stage s holds at most p - s micro-batches) twice: free, and with the paper's
op_order rules (tables 4 and 7) added as constraints. Printed per case: the makespan
found (unit costs F = 1, B = 2), the solver's status and wall time, and the hand-written
schedule's simulated makespan beside it.
"""

from __future__ import annotations


def run(stages: int = 4, microbatches=(4, 8, 16), time_limit: float = 60.0) -> list[list[str]]:
    import jscaler
    from jscaler.search import search_order
    from schedules.classic import one_f_one_b
    from schedules.tables import rules_1f1b, rules_3f1b
    from schedules.three_f_one_b import three_f_one_b

    rows = []
    bound = [stages - s for s in range(stages)]
    cases = [("3F1B", 3, rules_3f1b, three_f_one_b), ("1F1B", 1, rules_1f1b, one_f_one_b)]
    for name, passes, rules, hand in cases:
        for m in microbatches:
            ref = jscaler.simulate(hand(stages, m)).makespan
            free = search_order(stages, m, passes=passes, memory=bound, time_limit=time_limit)
            ruled = search_order(
                stages, m, passes=passes, memory=bound, rules=rules(stages),
                time_limit=time_limit,
            )  # fmt: skip
            rows.append(
                [
                    name, str(stages), str(m), f"{ref:g}",
                    f"{free.makespan:g}", free.status, f"{free.wall:.2f}",
                    f"{ruled.makespan:g}", ruled.status, f"{ruled.wall:.2f}",
                    f"{free.wall / ruled.wall:.1f}x" if ruled.wall else "-",
                ]
            )  # fmt: skip
    return rows


def table(rows) -> list[str]:
    from bench.table import columns

    cols = [
        "schedule", "stages", "m", "hand-written", "free: makespan", "status", "s",
        "with rules: makespan", "status", "s", "rules speed-up",
    ]  # fmt: skip
    return columns(cols, rows, left=1)


def main(args) -> int:
    ms = (args.microbatches,) if args.microbatches else (4, 8, 16)
    print(
        f"op-order search (CP-SAT, 1 worker) at {args.pp} stages under 1F1B's memory "
        "bound; unit costs F=1, B=2; makespans in those units"
    )
    print("\n".join(table(run(args.pp, ms))))
    return 0
