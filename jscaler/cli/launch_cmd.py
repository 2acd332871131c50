"""``jscaler launch``: N local processes of one command."""

from __future__ import annotations

import argparse

from jscaler.cli.numbers import non_negative_float, positive_int


def register(sub) -> None:
    la = sub.add_parser(
        "launch",
        help="run a jscaler command as N local processes of one JAX program",
        description="Start N processes of a command on this machine, each with its own "
        "simulated CPU devices, joined by jax.distributed.initialize on 127.0.0.1; e.g. "
        "jscaler launch --nprocs 2 --devices-per-proc 4 -- jscaler train --model gpt-tiny "
        '--plan "megatron(pp=2, dp=4)". On a cluster, start the command with srun/mpirun '
        "instead: jscaler joins the run from the SLURM / Open MPI environment.",
    )
    la.add_argument("--nprocs", type=positive_int, default=2, help="processes (default 2)")
    la.add_argument(
        "--devices-per-proc",
        type=positive_int,
        default=4,
        help="CPU devices per process (default 4)",
    )
    la.add_argument(
        "--timeout",
        type=non_negative_float,
        default=None,
        metavar="SECONDS",
        help="stop every process after this long (exit 124; default: no limit)",
    )
    la.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command to run")
    la.set_defaults(run=None, devices=None)


def run(args) -> int:
    from jscaler.launch import launch

    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    return launch(command, args.nprocs, args.devices_per_proc, timeout=args.timeout)
