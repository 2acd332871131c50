"""parallelize() and Trainer: micro-batches, model state, random bits, inputs, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jscaler
import models
from jscaler.runtime.reference import compare, reference_steps, trainer_steps
from models import gpt
from spaces import megatron

from parity import assert_parity


def test_microbatches_accumulate_to_the_full_batch_step():
    assert_parity("mlp-tiny", "dp", microbatches=2)
    assert_parity("gpt-tiny", megatron(tp=2, dp=2), devices=4, microbatches=2)


class Norm(nnx.Module):
    """BatchNorm (a BatchStat collection updated in place) + dropout (RNG state)."""

    def __init__(self, rngs):
        self.lin = nnx.Linear(8, 16, use_bias=False, rngs=rngs)  # BN cancels a bias: grad 0
        self.bn = nnx.BatchNorm(16, rngs=rngs)
        self.drop = nnx.Dropout(0.25, rngs=rngs)
        self.out = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(jax.nn.relu(self.bn(self.lin(x)))))


def norm_loss(model, batch):
    return jnp.mean((model(batch["x"])[:, 0] - batch["y"]) ** 2)


def norm_batches():
    k = jax.random.split(jax.random.key(3), 3)
    return [
        {"x": jax.random.normal(k[i], (16, 8)), "y": jnp.sin(jnp.arange(16.0) + i)}
        for i in range(3)
    ]


def test_batch_stats_and_rng_state_are_carried_and_random_bits_match():
    """Dropout draws the same bits split 8 ways as on one device (partitionable threefry);
    BatchNorm's statistics over the split batch equal the whole batch's."""
    make = lambda: Norm(nnx.Rngs(0, dropout=1))  # noqa: E731
    batches = norm_batches()
    want = reference_steps(make(), norm_loss, optax.sgd(0.1), batches)
    trainer = jscaler.parallelize(make(), norm_loss, optax.sgd(0.1), batches[0], devices=8)
    got = trainer_steps(trainer, batches)
    mm = compare(got, want)
    assert mm.ok, "\n".join(mm.lines)
    ref = make()
    for i, b in enumerate(batches):  # the model's own calls, at each step's parameters
        if i:
            nnx.update(ref, want[i - 1][2])
        ref(b["x"])
    trained = trainer.model
    np.testing.assert_allclose(trained.bn.mean[...], ref.bn.mean[...], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(trained.bn.var[...], ref.bn.var[...], rtol=1e-5, atol=1e-7)


def test_callers_arrays_are_not_donated_or_changed():
    spec = models.get("mlp-tiny")
    params = spec.init(0)
    before = jax.tree_util.tree_map(np.array, params)
    trainer = jscaler.parallelize(params, spec.loss, optax.sgd(0.5), spec.batch(16, 0))
    batch = spec.batch(16, 1)
    trainer.step(batch)
    trainer.step(batch)
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(before)):
        np.testing.assert_array_equal(np.asarray(a), b)  # still readable, unchanged
    assert not all(
        np.array_equal(a, b)
        for a, b in zip(
            jax.tree_util.tree_leaves(trainer.params), jax.tree_util.tree_leaves(before)
        )
    )
    jax.tree_util.tree_map(np.asarray, batch)  # the batch too


def test_devices_argument_forms():
    spec = models.get("mlp-tiny")
    args = (spec.init(0), spec.loss, optax.sgd(0.1), spec.batch(16, 0))
    assert jscaler.parallelize(*args, devices=2).plan.mesh.size == 2
    assert jscaler.parallelize(*args, devices=jax.devices()[4:]).plan.mesh.size == 4
    assert jscaler.parallelize(*args).plan.mesh.size == len(jax.devices())
    with pytest.raises(jscaler.PlanError, match="devices=9, but 8 devices exist"):
        jscaler.parallelize(*args, devices=9)


def test_adam_loss_falls_on_gpt_tiny_with_megatron():
    spec = models.get("gpt-tiny")
    trainer = jscaler.parallelize(
        spec.init(0), spec.loss, optax.adam(1e-2), spec.batch(8, 0), plan=megatron(tp=2, dp=4)
    )
    losses = [trainer.step(spec.batch(8, i))["loss"] for i in range(25)]
    assert losses[-1] < 0.7 * losses[0]


# ---- bad input ---------------------------------------------------------------------------


def test_batch_the_plan_cannot_split():
    spec = models.get("mlp-tiny")
    with pytest.raises(jscaler.PlanError, match="'batch/x' has 12 rows .* degree 8"):
        jscaler.parallelize(spec.init(0), spec.loss, optax.sgd(0.1), spec.batch(12, 0))
    with pytest.raises(jscaler.PlanError, match="split into 3 micro-batches"):
        jscaler.parallelize(
            spec.init(0), spec.loss, optax.sgd(0.1), spec.batch(16, 0), microbatches=3
        )


def test_step_with_another_batch_structure_is_a_clear_error():
    spec = models.get("mlp-tiny")
    trainer = jscaler.parallelize(spec.init(0), spec.loss, optax.sgd(0.1), spec.batch(16, 0))
    with pytest.raises(jscaler.PlanError, match="the batch has structure"):
        trainer.step({"other": spec.batch(16, 0)})


def test_unknown_plan_string():
    spec = models.get("mlp-tiny")
    with pytest.raises(jscaler.PlanError, match="neither 'dp', 'auto' nor a plan JSON file"):
        jscaler.parallelize(
            spec.init(0), spec.loss, optax.sgd(0.1), spec.batch(16, 0), plan="megatorn"
        )


def test_plan_json_path_runs(tmp_path):
    spec = models.get("gpt-tiny")
    model = spec.init(0)
    graph = jscaler.trace(spec.loss, model, spec.batch(8, 0))
    plan = megatron(tp=2)(graph, 8)
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    trainer = jscaler.parallelize(
        model, spec.loss, optax.sgd(0.1), spec.batch(8, 0), plan=str(path)
    )
    assert trainer.plan == plan


def test_gpt_with_dropout_traces_rng_ops():
    cfg = gpt.tiny().replace(dropout=0.1)
    model = gpt.GPT(cfg, rngs=nnx.Rngs(0))
    g = jscaler.trace(gpt.loss, model, gpt.synthetic_batch(cfg, 8))
    assert {"random_bits"} & {o.primitive for o in g.ops}
    assert g.coverage().ops == 1.0


# ---- inputs it refuses, each with a jscaler error naming what is wrong -----------------------

_PARAMS = {"w": jnp.ones((4, 4))}
_BATCH = {"x": jnp.ones((8, 4))}


def _loss(p, b):
    return (b["x"] @ p["w"]).mean()


def test_a_loss_returning_a_dict_is_a_trace_error_naming_its_keys():
    def loss(p, b):  # was an AttributeError from inside the trace
        return {"loss": _loss(p, b), "acc": 1.0}

    with pytest.raises(jscaler.TraceError, match=r"returned a dict with keys \['acc', 'loss'\]"):
        jscaler.parallelize(_PARAMS, loss, optax.sgd(0.1), _BATCH)


@pytest.mark.parametrize("optimizer", [object(), optax.sgd], ids=["object", "uncalled"])
def test_an_optimizer_that_is_not_optax_is_a_trace_error(optimizer):
    with pytest.raises(jscaler.TraceError, match="optax GradientTransformation") as err:
        jscaler.parallelize(_PARAMS, _loss, optimizer, _BATCH)
    assert ("optax.sgd(0.1), not optax.sgd" in str(err.value)) == callable(optimizer)


@pytest.mark.parametrize("text", ["{oops", '["a list"]', '{"format": 1}'])
def test_a_malformed_plan_file_is_a_plan_error_naming_the_file(tmp_path, text):
    path = tmp_path / "plan.json"
    path.write_text(text)
    with pytest.raises(jscaler.PlanError, match=f"plan file {path}"):
        jscaler.parallelize(_PARAMS, _loss, optax.sgd(0.1), _BATCH, plan=str(path))


def test_a_scalar_batch_leaf_is_named_and_explained():
    batch = {"x": jnp.ones((8, 4)), "scale": jnp.float32(2.0)}  # said "divisible by 1"
    with pytest.raises(jscaler.PlanError, match=r"batch leaf \['scale'\] is a scalar"):
        jscaler.parallelize(_PARAMS, lambda p, b: _loss(p, b) * b["scale"], optax.sgd(0.1), batch)


def test_zero_devices_is_refused_as_such():
    with pytest.raises(jscaler.PlanError, match="devices=0: a plan needs at least 1 device"):
        jscaler.parallelize(_PARAMS, _loss, optax.sgd(0.1), _BATCH, devices=0)


@pytest.mark.parametrize("name", ["ring", "ulysses"])
def test_sequence_spaces_name_their_own_degree(name):
    import spaces

    spec = models.get("gpt-tiny")
    with pytest.raises(jscaler.PlanError, match=rf"{name}\(sp=3\) needs .* divisible by sp=3"):
        jscaler.parallelize(
            spec.init(0), spec.loss, optax.sgd(0.1), spec.batch(8, 0), plan=getattr(spaces, name)(3)
        )


def test_a_batch_leaf_of_another_dtype_is_refused_by_name():
    """A new shape re-plans; a new dtype re-traced the model and failed inside flax."""
    spec = models.get("gpt-tiny")
    batch = spec.batch(8, 0)
    trainer = jscaler.parallelize(spec.init(0), spec.loss, optax.sgd(0.1), batch)
    floats = jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), batch)
    with pytest.raises(jscaler.PlanError, match=r"batch leaf \['\w+'\] has dtype float32; .*int32"):
        trainer.step(floats)
