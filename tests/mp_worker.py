"""One process of a multi-process test run; started by tests/test_multiprocess.py.

Usage: ``python tests/mp_worker.py MODE [STEPS]`` in a process whose environment carries
the ``JSCALER_*`` variables that ``jscaler launch`` sets (or from a launch command line).
It joins the run (:func:`jscaler.setup.init_distributed`), parallelises gpt-tiny with
data parallelism over every process's devices (so each step all-reduces across processes)
and trains STEPS steps (default 3), printing ``process P step S loss L`` after each.

Modes:
  ``agree``: every process uses the same plan (the normal path).
  ``disagree``: process 1 picks ``megatron(tp=2)`` while the others pick ``dp``; the plan
    hash check in ``jscaler.parallelize`` must stop every process with a DistributedError.
  ``die``: process 1 kills itself with SIGKILL after its first step; the others must stop
    (non-zero) within the heartbeat timeout instead of hanging in the next all-reduce.
  ``die0``: the same, but process 0 (the one hosting jax.distributed's coordinator) dies.
  ``local``: as ``agree``, but each process passes only its own rows of every batch
    (``Trainer.global_batch``, i.e. ``jax.make_array_from_process_local_data``).
  ``restore``: parallelise under ``zero(stage=3)`` (parameters split across the
    processes), restore the checkpoint in ``$JSCALER_TEST_CKPT`` (saved by one process on
    8 devices under another plan) and train from its step.
  ``quit``: process 1 returns exit status 2 after its first step (an error of its own);
    the others' next collective fails and says that process 1 exited.
  ``hang``: process 1 stops itself with SIGSTOP after its first step (alive but silent);
    only jax.distributed's heartbeat can stop the others.

``JSCALER_TEST_PLAN`` (a ``--plan`` expression) replaces the plan of every mode.

A JscalerError is printed as ``mp_worker: error: ...`` with exit status 2, as the CLI does.
A process still running after ``STACKS_AFTER`` seconds prints every thread's Python stack
(and goes on), so a test that gives up on a hung process shows where it hung.
"""

import faulthandler
import os
import signal
import sys

STACKS_AFTER = 200  # s: before test_faults' 240 s wait for a first step


def main(mode: str, steps: int) -> int:
    faulthandler.dump_traceback_later(STACKS_AFTER, exit=False)
    from jscaler.setup import enable_compilation_cache, init_distributed

    if not init_distributed():
        print("mp_worker: not in a multi-process run (no JSCALER_COORDINATOR)", file=sys.stderr)
        return 3
    enable_compilation_cache()
    import jax
    import optax

    import jscaler
    import models
    from spaces import megatron, zero

    me = jax.process_index()
    spec = models.get("gpt-tiny")
    plan = megatron(tp=2) if mode == "disagree" and me == 1 else "dp"
    plan = zero(stage=3) if mode == "restore" else plan
    if expr := os.environ.get("JSCALER_TEST_PLAN"):  # e.g. a pipeline across the processes
        from spaces.parse import parse_plan

        plan = parse_plan(expr)
    batch_size = 2 * jax.device_count()
    victim = {"die": (1, signal.SIGKILL), "die0": (0, signal.SIGKILL), "hang": (1, signal.SIGSTOP)}
    try:
        trainer = jscaler.parallelize(
            spec.init(0), spec.loss, optax.sgd(0.1), spec.batch(batch_size, 0), plan=plan
        )
        first = trainer.restore(os.environ["JSCALER_TEST_CKPT"]) if mode == "restore" else 0
        for step in range(first, first + steps):
            batch = spec.batch(batch_size, step)
            if mode == "local":  # only this process's rows leave this process's loader
                rows = batch_size // jax.process_count()
                mine = jax.tree_util.tree_map(lambda x, r=rows: x[me * r : (me + 1) * r], batch)
                batch = trainer.global_batch(mine)
            metrics = trainer.step(batch)
            print(f"process {me} step {step} loss {float(metrics['loss']):.6f}", flush=True)
            if mode in victim and victim[mode][0] == me:
                os.kill(os.getpid(), victim[mode][1])
            if mode == "quit" and me == 1:
                print("mp_worker: process 1 gives up", file=sys.stderr, flush=True)
                return 2
    except jscaler.JscalerError as e:
        print(f"mp_worker: error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3))
