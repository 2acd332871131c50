"""The ``jscaler`` command: one module per sub-command, each with a ``register(sub)``.

The only engine package that may import ``models/``, ``spaces/``, ``schedules/`` and
``bench/``: it turns names on the command line into objects.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

from jscaler.cli import (
    bench,
    export,
    inspect_graph,
    launch_cmd,
    plan,
    profile,
    train,
    verify,
    viz,
)
from jscaler.cli.common import describe, parse_schedule
from jscaler.cli.config import CommandParser, apply, find_config, load

__all__ = ["describe", "main", "parse_schedule"]

_COMMANDS = (inspect_graph, train, verify, plan, launch_cmd, bench, viz, profile, export)
INTERNAL_ERROR = 3  # exit status of a crash jscaler did not turn into one of its errors


def _parser() -> tuple[argparse.ArgumentParser, dict[str, CommandParser]]:
    p = argparse.ArgumentParser(
        prog="jscaler",
        description="Parallelise single-device Flax training with searched plans. "
        "Run 'jscaler COMMAND --help' for a command's options.",
        epilog="Exit status: 0 done, 1 verify's mismatch, 2 an error jscaler reports, 3 an "
        "unexpected error (add --traceback anywhere on the line to see where it came from).",
    )
    sub = p.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=CommandParser
    )
    for command in _COMMANDS:
        command.register(sub)
    return p, sub.choices


def main(argv: list[str] | None = None) -> int:
    """Runs ``jscaler ARGV``; returns the exit status: 0 done, 1 ``verify``'s mismatch, 2 an
    error jscaler reports (bad input, a usage error), 3 an unexpected error."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)  # launch: the rest is the child's
    show_traceback = "--traceback" in argv[:cut]
    argv = [a for a in argv[:cut] if a != "--traceback"] + argv[cut:]
    parser, commands = _parser()
    command = commands.get(argv[0]) if argv else None
    if command is not None and "config" in command.long_options():
        from jscaler.errors import ConfigError

        try:  # the file's values become the defaults: the command line overrides them
            if (path := find_config(argv[1:])) is not None:
                apply(command, load(path), path)
        except ConfigError as e:
            print(f"jscaler {argv[0]}: error: {e}", file=sys.stderr)
            return 2
    args = parser.parse_args(argv)
    from jscaler.setup import enable_compilation_cache, init_distributed, use_cpu_devices

    if args.command == "launch":
        return launch_cmd.run(args)
    if not init_distributed():
        use_cpu_devices(args.devices or 8)
    enable_compilation_cache()
    if getattr(args, "cluster", "") is None:  # the local GPU's preset, if one describes it
        from jscaler.cli.common import local_cluster

        args.cluster = local_cluster()
    from jscaler.errors import DistributedError, JscalerError

    try:
        return args.run(args)
    except DistributedError as e:  # a peer is gone: skip jax's shutdown barrier, which
        print(f"jscaler {args.command}: error: {e}", file=sys.stderr)  # would wait for it
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(2)
    except (JscalerError, KeyError) as e:
        print(f"jscaler {args.command}: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001  not one of ours: never exit 1 (verify's mismatch)
        if show_traceback:
            traceback.print_exc()
        first = (str(e).strip().splitlines() or [""])[0][:300]
        print(
            f"jscaler {args.command}: unexpected error: {type(e).__name__}: {first}\n"
            f"(not an error jscaler checks for; "
            + (
                "the traceback above shows where it came from"
                if show_traceback
                else "run again with --traceback to see where it came from"
            )
            + "; if that is inside jscaler, please report it with the command line)",
            file=sys.stderr,
        )
        return INTERNAL_ERROR
