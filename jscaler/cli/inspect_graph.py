"""``jscaler inspect``: trace a reference model and print its graph."""

from __future__ import annotations

import json

from jscaler.cli.common import abstract_model, add_devices
from jscaler.cli.numbers import positive_int


def register(sub) -> None:
    ins = sub.add_parser(
        "inspect",
        help="trace a model's loss and print its graph: module paths, annotations, FLOPs",
        description="Trace a reference model's loss into jscaler's Graph IR and print every "
        "op with its Flax module path, primitive, dim annotation (''=splittable, "
        "'+'=partial sums, '^'=not splittable), shapes and FLOPs, then the coverage.",
    )
    ins.add_argument(
        "--model",
        required=True,
        help="a reference model, e.g. gpt-tiny, or your own as 'package.module:factory' or "
        "'path/file.py:factory' (factory() returns (model_or_params, loss, batch))",
    )
    ins.add_argument(
        "--batch-size", type=positive_int, default=None, help="batch size to trace with"
    )
    ins.add_argument(
        "--select", default=None, help="only ops under matching module paths, e.g. 'blocks/0/*'"
    )
    ins.add_argument("--summary", action="store_true", help="print only the summary lines")
    ins.add_argument("--json", action="store_true", help="print the graph as JSON")
    add_devices(ins)
    ins.set_defaults(run=_inspect)


def _inspect(args) -> int:
    import jax

    import models
    from jscaler import trace
    from jscaler.ir.report import graph_summary, graph_table, op_record

    spec = models.get(args.model)
    model = abstract_model(spec)
    batch = spec.batch(args.batch_size or spec.batch_size, 0)
    batch = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
    graph = trace(spec.loss, model, batch, strict=False)
    shown = graph.select(args.select) if args.select else graph
    if args.select and not shown.ops:
        from jscaler.errors import TraceError

        paths = sorted({"/".join(o.path.split("/")[:2]) for o in graph.ops if o.path})
        raise TraceError(
            f"--select {args.select!r} matches no op's module path; paths start with "
            f"{', '.join(paths[:8]) or '(no module paths)'}{', ...' if len(paths) > 8 else ''}"
        )
    if args.json:
        cov = graph.coverage()
        out = {
            "model": spec.name,
            "coverage": {"ops": cov.ops, "flops": cov.flops},
            "experts": _experts(graph),
            "ops": [op_record(graph, o) for o in shown.ops],
        }
        print(json.dumps(out, indent=1))
        return 0
    print(f"{spec.name}: {spec.description}")
    if not args.summary:
        print(graph_table(shown))
        print()
    print(graph_summary(graph))
    experts = _experts(graph)
    if experts:
        print(f"experts (for expert(ep=...)): {experts}")
    return 0


def _experts(graph) -> str:
    """The stacked expert weights the ``expert`` space finds, one per name."""
    from spaces.expert import expert_axes

    found = expert_axes(graph)
    return ", ".join(
        f"{graph.tensors[t].name} {list(graph.tensors[t].shape)} axis {axis}" for t, axis in found
    )
