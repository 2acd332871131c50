"""A run of ops as one function of the values it reads from outside it.

Both ways of rematerialising part of the forward use it: a recompute group
(:func:`jscaler.compile.lower.run_ops` under ``jax.checkpoint``) and a ZeRO-3 layer that
reshards after forward (:mod:`jscaler.compile.reshard`).
"""

from __future__ import annotations

from collections.abc import Callable

from jscaler.ir.graph import Op

__all__ = ["Segment"]


class Segment:
    """``ops`` as a function: ``segment(vals)`` runs them on the values of ``needed`` (the
    tensors they read that none of them makes) and returns the values of ``names``, the
    ``outputs`` they made (a manual region skips its insides), whose layouts ``layouts``
    records; :meth:`store` writes them into ``env``/``have`` as ``run_op`` would have.

    Args:
      ops: the ops, in order. have: the layouts of the values they read.
      run_op: ``run_op(low, op, env, have)`` runs one op.
      outputs: the tensors to return (default: every one the ops make).
    """

    def __init__(self, low, ops: list[Op], have: dict, run_op: Callable, outputs=None):
        produced = list(dict.fromkeys(t for o in ops for t in o.outputs))
        made = set(produced)
        self.needed = list(dict.fromkeys(t for o in ops for t in o.tensor_inputs if t not in made))
        self.outputs = produced if outputs is None else list(outputs)
        self.names: list[int] = []
        self.layouts: list = []
        self._low, self._ops, self._have, self._run_op = low, ops, have, run_op

    def __call__(self, vals) -> list:
        env = dict(zip(self.needed, vals))
        have = {t: self._have[t] for t in self.needed if t in self._have}
        for o in self._ops:
            self._run_op(self._low, o, env, have)
        self.names = [t for t in self.outputs if t in env]
        self.layouts = [have[t] for t in self.names]
        return [env[t] for t in self.names]

    def store(self, outs, env: dict, have: dict) -> None:
        """The returned values ``outs`` into ``env``, their layouts into ``have``."""
        env.update(zip(self.names, outs))
        have.update(zip(self.names, self.layouts))
