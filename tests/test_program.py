"""The runtime's one way through: Programs per batch signature, the TrainState pytree, the
one relayout, and checkpoints read and written through the state."""

import dataclasses
import inspect

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import jscaler
import models
from jscaler.runtime import checkpoint
from jscaler.runtime.pipeline import PipelineProgram
from jscaler.runtime.program import Program
from jscaler.runtime.spmd import SpmdProgram
from jscaler.runtime.state import TrainState, relayout
from spaces import megatron, zero


def protocol_members(proto) -> set[str]:
    return {
        n
        for n, v in vars(proto).items()
        if not n.startswith("_") and (callable(v) or isinstance(v, property))
    }


@pytest.mark.parametrize("cls", [SpmdProgram, PipelineProgram])
def test_both_programs_implement_every_method_of_the_protocol(cls):
    members = protocol_members(Program)
    assert {"step", "eval", "value_and_grad", "compiled", "comm_table", "estimate"} <= members
    for name in members:
        mine = getattr(cls, name, None)
        assert callable(mine), f"{cls.__name__} lacks {name}"
        want = list(inspect.signature(getattr(Program, name)).parameters)
        assert list(inspect.signature(mine).parameters) == want, (cls.__name__, name)


def mlp():
    spec = models.get("mlp-tiny")
    return spec, spec.init(0), spec.batch(16, 0)


def test_train_state_is_a_frozen_pytree_whose_step_is_a_leaf():
    spec, params, batch = mlp()
    trainer = jscaler.parallelize(params, spec.loss, optax.sgd(0.1), batch, devices=8)
    state = trainer.state
    assert isinstance(state, jscaler.TrainState) and state.step == 0
    leaves = jax.tree_util.tree_leaves(state)
    assert len(leaves) == len(state.params) + len(state.model_state) + 1  # sgd: no arrays
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.step = 3
    trainer.step(batch)
    assert trainer.state.step == 1 == trainer.step_count and state.step == 0


def test_relayout_moves_every_array_and_keeps_what_is_already_there():
    spec, params, batch = mlp()
    trainer = jscaler.parallelize(params, spec.loss, optax.sgd(0.1, momentum=0.9), batch,
                                  devices=8, plan=zero(stage=3))  # fmt: skip
    state = trainer.state.replace(step=5)
    same = relayout(state, trainer.program.shardings())
    assert all(a is b for a, b in zip(same.params, state.params))
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    rep = NamedSharding(mesh, PartitionSpec())
    target = jax.tree_util.tree_map(lambda _: rep, state.replace(step=None))
    moved = relayout(state, target.replace(step=None))
    assert moved.step == 5
    for a, b in zip(jax.tree_util.tree_leaves(moved), jax.tree_util.tree_leaves(state)):
        if isinstance(a, jax.Array):
            assert a.sharding == rep
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_new_batch_signature_gets_its_own_program_and_the_state_follows():
    spec, params, batch = mlp()
    trainer = jscaler.parallelize(params, spec.loss, optax.sgd(0.1), batch, devices=8,
                                  plan=megatron(tp=2, dp=4))  # fmt: skip
    first = trainer.program
    trainer.step(spec.batch(8, 1))
    assert trainer.program is not first and len(trainer.planner.programs) == 2
    assert trainer.planner.builds == 2
    for x, s in zip(trainer.state.params, trainer.program.shardings().params):
        assert x.sharding == s
    trainer.step(batch)
    assert trainer.program is first and trainer.planner.builds == 2


def test_checkpoint_functions_save_and_restore_a_train_state(tmp_path):
    spec, params, batch = mlp()
    trainer = jscaler.parallelize(params, spec.loss, optax.adam(1e-3), batch, devices=8)
    trainer.step(batch)
    sh = trainer.program.shardings()
    g = trainer.graph
    names = checkpoint.Names(
        tuple(g.tensors[t].name for t in g.inputs if g.tensors[t].role == "param"), (), "dp"
    )
    path = checkpoint.save(tmp_path, trainer.state, sh, names)
    assert path.name == "1"
    back = checkpoint.restore(tmp_path, trainer.state, sh, names)
    assert isinstance(back, TrainState) and back.step == 1
    for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(trainer.state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    wrong = dataclasses.replace(names, params=("other",) + names.params[1:])
    with pytest.raises(jscaler.CheckpointError, match="'other'"):
        checkpoint.restore(tmp_path, trainer.state, sh, wrong)
