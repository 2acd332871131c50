"""Checkpoints: save and restore across plans and device counts, resume equals an
uninterrupted run, damaged checkpoints, pipelines. Saves killed midway, flipped bytes and
full or read-only disks: tests/test_faults.py."""

import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jscaler
import models
from jscaler.runtime.checkpoint import latest_step
from models import gpt, mlp
from spaces import megatron, zero

CFG = gpt.tiny()


def gpt_batch(step):
    return gpt.synthetic_batch(CFG, 8, seed=step)


def gpt_trainer(plan, devices=8, microbatches=1):
    return jscaler.parallelize(
        gpt.GPT(CFG, rngs=nnx.Rngs(0)),
        gpt.loss,
        optax.adam(1e-2),
        gpt_batch(0),
        devices=devices,
        plan=plan,
        microbatches=microbatches,
    )


def mlp_trainer(cfg=None):
    cfg = cfg or mlp.tiny()
    spec = models.get("mlp-tiny")
    return jscaler.parallelize(mlp.init(cfg, 0), spec.loss, optax.sgd(0.1), spec.batch(16, 0))


def mlp_batch(step):
    return models.get("mlp-tiny").batch(16, step)


def host(tree):
    return [np.asarray(jax.device_get(x)) for x in jax.tree_util.tree_leaves(tree)]


def assert_same(a, b):
    a, b = host(a), host(b)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def test_saved_under_megatron_on_8_restores_under_zero3_on_4(tmp_path):
    a = gpt_trainer(megatron(tp=4, dp=2))
    for s in range(2):
        a.step(gpt_batch(s))
    a.save(tmp_path)
    b = gpt_trainer(zero(stage=3), devices=4)
    assert b.restore(tmp_path) == 2 and b.step_count == 2
    assert_same(b.params, a.params)
    assert_same(b.state.opt_state, a.state.opt_state)  # adam's count, mu and nu
    on = {d for x in jax.tree_util.tree_leaves(b.state.opt_state) for d in x.devices()}
    assert on == set(jax.devices()[:4])
    for s in range(2, 4):
        want, got = a.step(gpt_batch(s))["loss"], b.step(gpt_batch(s))["loss"]
        np.testing.assert_allclose(got, want, rtol=1e-5)


class NormNet(nnx.Module):
    """BatchNorm statistics and a dropout RNG key and counter: model state to carry over."""

    def __init__(self, rngs):
        self.lin = nnx.Linear(8, 16, rngs=rngs)
        self.bn = nnx.BatchNorm(16, rngs=rngs)
        self.drop = nnx.Dropout(0.25, rngs=rngs)
        self.out = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(jax.nn.relu(self.bn(self.lin(x)))))


def norm_loss(model, batch):
    return jnp.mean((model(batch["x"])[:, 0] - batch["y"]) ** 2)


def norm_batch(step):
    x = jax.random.normal(jax.random.key(step), (16, 8))
    return {"x": x, "y": jnp.sin(x.sum(1))}


def test_resumed_run_follows_the_uninterrupted_one(tmp_path):
    def make():
        model = NormNet(nnx.Rngs(0, dropout=1))
        return jscaler.parallelize(model, norm_loss, optax.adam(1e-2), norm_batch(0), devices=8)

    a = make()
    losses = [a.step(norm_batch(s))["loss"] for s in range(2)]
    a.save(tmp_path)
    losses += [a.step(norm_batch(s))["loss"] for s in range(2, 5)]

    b = make()
    assert b.restore(tmp_path) == 2
    resumed = losses[:2] + [b.step(norm_batch(s))["loss"] for s in range(2, 5)]
    np.testing.assert_allclose(resumed, losses, rtol=1e-5)
    assert_same(nnx.state(b.model, nnx.BatchStat), nnx.state(a.model, nnx.BatchStat))


def test_pipeline_round_trip_continue_and_restore_without_pipeline(tmp_path):
    a = gpt_trainer(megatron(pp=2, dp=4), microbatches=2)
    a.step(gpt_batch(0))
    a.save(tmp_path)
    b = gpt_trainer(megatron(pp=2, dp=4), microbatches=2)
    assert b.restore(tmp_path) == 1 and b.step_count == 1
    assert_same(b.params, a.params)
    # the stages run on copies of the restored master parameters: same loss and gradients
    (la, ga), (lb, gb) = a.value_and_grad(gpt_batch(1)), b.value_and_grad(gpt_batch(1))
    assert la == lb
    assert_same(gb, ga)
    spmd = gpt_trainer(megatron(tp=2, dp=4))  # and into a single-program trainer
    assert spmd.restore(tmp_path) == 1
    assert_same(spmd.params, a.params)
    for s in range(1, 3):
        want, got = a.step(gpt_batch(s))["loss"], b.step(gpt_batch(s))["loss"]
        np.testing.assert_allclose(got, want, rtol=1e-5)
        if s == 1:
            np.testing.assert_allclose(spmd.step(gpt_batch(s))["loss"], want, rtol=1e-5)


# ---- damaged checkpoints ------------------------------------------------------------------


def array_files(step_dir: Path) -> list[Path]:
    """The files holding a step's array data (orbax's ``d`` folders)."""
    files = [f for f in (step_dir / "arrays").rglob("*") if f.is_file() and f.parent.name == "d"]
    assert files
    return files


def saved_mlp_steps(directory: Path, n: int) -> dict:
    """Trains mlp-tiny ``n`` steps, saving after each; step -> its parameters on the host."""
    trainer, saved = mlp_trainer(), {}
    for s in range(n):
        trainer.step(mlp_batch(s))
        trainer.save(directory)
        saved[trainer.step_count] = host(trainer.params)
    return saved


def truncate_arrays(step_dir: Path):
    for f in array_files(step_dir):
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


# tensorstore's reads still in flight when a damaged one fails call back into a closed loop
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_damaged_checkpoints_are_skipped_then_refused(tmp_path):
    saved = saved_mlp_steps(tmp_path, 3)
    truncate_arrays(tmp_path / "3")
    (meta,) = [f for f in (tmp_path / "2" / "jscaler").iterdir() if f.suffix != ".txt"]
    meta.write_text("{garbage")
    with pytest.warns(UserWarning, match="2: its metadata cannot be read"):
        assert latest_step(tmp_path) == 3  # only restore reads the arrays

    fresh = mlp_trainer()
    with pytest.warns(UserWarning) as caught:
        assert fresh.restore(tmp_path) == 1
    said = " | ".join(str(w.message) for w in caught)
    assert str(tmp_path / "3") in said and "arrays cannot be read" in said
    assert str(tmp_path / "2") in said and "metadata cannot be read" in said
    for x, y in zip(host(fresh.params), saved[1]):
        np.testing.assert_array_equal(x, y)

    with pytest.raises(jscaler.CheckpointError, match="step 3 .*arrays cannot be read"):
        fresh.restore(tmp_path, step=3)
    with pytest.raises(jscaler.CheckpointError, match=r"step 7 .*no such folder.*\[3, 1\]"):
        fresh.restore(tmp_path, step=7)
    for f in array_files(tmp_path / "1"):
        f.unlink()  # missing files
    with pytest.warns(UserWarning), pytest.raises(jscaler.CheckpointError) as err:
        fresh.restore(tmp_path)
    msg = str(err.value)
    assert f"no usable checkpoint in {tmp_path}" in msg
    for step, why in [(1, "arrays cannot"), (2, "metadata cannot"), (3, "arrays cannot")]:
        assert f"{tmp_path / str(step)}: its {why} be read" in msg
    with pytest.raises(jscaler.CheckpointError, match="no usable checkpoint"):
        fresh.restore(tmp_path / "nothing-here")


def test_array_files_that_read_back_other_values_are_found_not_restored(tmp_path):
    """Readable files, right sizes, wrong values (as 64 flipped bytes in an array file
    gave: one parameter restored off by 1e38): step 2's array files are replaced by step
    1's, and the checksums recorded at save catch it."""
    saved = saved_mlp_steps(tmp_path, 2)
    shutil.rmtree(tmp_path / "2" / "arrays")
    shutil.copytree(tmp_path / "1" / "arrays", tmp_path / "2" / "arrays")
    fresh = mlp_trainer()
    with pytest.warns(UserWarning, match=r"2: parameter 'layers/\d/[wb]' is damaged on disk"):
        assert fresh.restore(tmp_path) == 1
    for x, y in zip(host(fresh.params), saved[1]):
        np.testing.assert_array_equal(x, y)
    with pytest.raises(jscaler.CheckpointError, match="cannot restore step 2 .*damaged on disk"):
        fresh.restore(tmp_path, step=2)


def test_checksums_are_the_same_under_any_sharding_and_see_one_changed_word():
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jscaler.runtime.fingerprint import fingerprints

    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    x = jax.random.normal(jax.random.key(0), (16, 24))
    placed = [jax.device_put(x, NamedSharding(mesh, spec)) for spec in (P(), P("d"), P(None, "d"))]
    host_copy = np.asarray(x)
    sums = fingerprints([*placed, host_copy, x.astype(jnp.bfloat16), jax.random.key(3)])
    assert len(set(sums[:4])) == 1
    moved = host_copy.copy()
    moved[[0, 1]] = moved[[1, 0]]  # the same words in other places
    changed = host_copy.copy()
    changed[5, 7] = np.nextafter(changed[5, 7], np.inf)
    assert len({sums[0], *fingerprints([moved, changed])}) == 3


def test_a_checkpoint_directory_without_room_is_refused_up_front(tmp_path):
    from jscaler.runtime.checkpoint import check_directory

    assert check_directory(tmp_path / "new" / "ck", nbytes=1024) == tmp_path / "new" / "ck"
    assert (tmp_path / "new" / "ck").is_dir() and not list((tmp_path / "new" / "ck").iterdir())
    with pytest.raises(jscaler.CheckpointError, match=r"MB free and one checkpoint needs"):
        check_directory(tmp_path, nbytes=1 << 60)
    params = 4 * (32 * 64 + 64 + 64 * 64 + 64 + 64 * 8 + 8)  # SGD keeps no other state
    assert mlp_trainer().checkpoint_bytes() == int(params * 1.25) + (1 << 20)


def test_prune_keeps_the_newest_complete_steps_and_nothing_else_is_touched(tmp_path):
    from jscaler.runtime.checkpoint import prune

    saved_mlp_steps(tmp_path, 4)
    (tmp_path / "notes").mkdir()  # not a step: left alone
    assert [p.name for p in prune(tmp_path, 2)] == ["2", "1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["3", "4", "notes"]
    assert mlp_trainer().restore(tmp_path) == 4
    with pytest.raises(jscaler.CheckpointError, match="keep at least the newest"):
        prune(tmp_path, 0)


def test_a_background_save_holds_the_state_of_its_step_while_training_goes_on(tmp_path):
    trainer = gpt_trainer(megatron(tp=2, dp=4))
    trainer.step(gpt_batch(0))
    at_1 = host(trainer.state.params), host(trainer.state.opt_state)
    path = trainer.save(tmp_path, wait=False)  # returns with the arrays on the host
    for s in range(1, 4):  # donated buffers are overwritten meanwhile
        trainer.step(gpt_batch(s))
    assert trainer.wait_for_save() == path == tmp_path / "1"
    assert trainer.wait_for_save() is None
    fresh = gpt_trainer(zero(3))
    assert fresh.restore(tmp_path) == 1
    assert_same(fresh.state.params, at_1[0])
    assert_same(fresh.state.opt_state, at_1[1])


def test_a_model_of_other_shapes_is_refused_by_name(tmp_path):
    trainer = mlp_trainer()
    trainer.save(tmp_path)
    with pytest.raises(jscaler.CheckpointError, match="exists already"):
        trainer.save(tmp_path)
    other = mlp_trainer(mlp.MLPConfig(hidden=(64, 32)))
    with pytest.raises(jscaler.CheckpointError) as err:
        other.restore(tmp_path)
    msg = str(err.value)
    assert str(tmp_path / "0") in msg and "parameter 'layers/1/b'" in msg
    assert "float32[64] in the checkpoint and float32[32] here" in msg
    sgd_vs_adam = jscaler.parallelize(
        mlp.init(mlp.tiny(), 0), mlp.loss, optax.adam(0.1), mlp_batch(0)
    )
    with pytest.raises(jscaler.CheckpointError, match="optimizer state leaf"):
        sgd_vs_adam.restore(tmp_path)


def test_latest_step_of_an_empty_folder_is_none(tmp_path):
    assert latest_step(tmp_path) is None
    assert latest_step(tmp_path / "missing") is None
