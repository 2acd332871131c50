"""The ``jscaler`` command.

The only engine module that may import ``models/`` (and later ``spaces/``,
``schedules/``): it turns names on the command line into objects.
"""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jscaler",
        description="Parallelise single-device Flax training with searched plans.",
    )
    p.add_argument(
        "--devices",
        type=int,
        default=8,
        help="number of simulated CPU devices when no accelerator is present (default 8)",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    ins = sub.add_parser(
        "inspect",
        help="trace a model's loss and print its graph: module paths, annotations, FLOPs",
        description="Trace a reference model's loss into jscaler's Graph IR and print every "
        "op with its Flax module path, primitive, dim annotation (''=splittable, "
        "'+'=partial sums, '^'=not splittable), shapes and FLOPs, then the coverage.",
    )
    ins.add_argument("--model", required=True, help="a reference model, e.g. gpt-tiny")
    ins.add_argument("--batch-size", type=int, default=None, help="batch size to trace with")
    ins.add_argument(
        "--select", default=None, help="only ops under matching module paths, e.g. 'blocks/0/*'"
    )
    ins.add_argument("--summary", action="store_true", help="print only the summary lines")
    ins.add_argument("--json", action="store_true", help="print the graph as JSON")
    ins.set_defaults(run=_inspect)
    return p


def _inspect(args) -> int:
    import jax

    import models
    from jscaler import trace
    from jscaler.ir.report import graph_summary, graph_table, op_record

    spec = models.get(args.model)
    model = _abstract_model(spec)
    batch = spec.batch(args.batch_size or spec.batch_size, 0)
    batch = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
    graph = trace(spec.loss, model, batch, strict=False)
    shown = graph.select(args.select) if args.select else graph
    if args.json:
        cov = graph.coverage()
        out = {
            "model": spec.name,
            "coverage": {"ops": cov.ops, "flops": cov.flops},
            "ops": [op_record(graph, o) for o in shown.ops],
        }
        print(json.dumps(out, indent=1))
        return 0
    print(f"{spec.name}: {spec.description}")
    if not args.summary:
        print(graph_table(shown))
        print()
    print(graph_summary(graph))
    return 0


def _abstract_model(spec):
    """The model with shapes only, so inspecting a 7B config allocates nothing."""
    import jax

    if spec.kind == "nnx":
        from flax import nnx

        return nnx.eval_shape(lambda: spec.init(0))
    return jax.eval_shape(lambda: spec.init(0))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from jscaler._setup import enable_compilation_cache, use_cpu_devices

    use_cpu_devices(args.devices)
    enable_compilation_cache()
    from jscaler.errors import JscalerError

    try:
        return args.run(args)
    except (JscalerError, KeyError) as e:
        print(f"jscaler {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
