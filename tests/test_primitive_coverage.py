"""Every primitive JAX's public functions lower to has a dim rule or a stated refusal.

Generated, not listed by hand: the walk traces every public callable of jax.numpy (and
its linalg, fft), jax.lax, jax.nn, jax.random and jax.scipy.special with example inputs
(jscaler.ir.surface) and every primitive object JAX defines is listed too. A new JAX
release that adds a primitive fails here by name, not in a user's model. Then the rules
are held to values: each op of each walked function is checked by check_annotations'
method (a '' dim's pieces depend only on their own pieces; '+' pieces add up).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jscaler
from jscaler.errors import AnnotationError
from jscaler.ir.check import check_fn
from jscaler.ir.refusals import classify
from jscaler.ir.surface import defined_primitives, walk_public_surface
from spaces import dp, zero

from parity import assert_matches_reference

# primitives the issue that started this file named; each must have a rule, not a refusal
REQUIRED = (
    "stack unstack tile approx_top_k ragged_dot_general sort cumsum cumprod cummax "
    "cumlogsumexp top_k clamp rem pow atan2 expm1 log1p erf_inv lgamma digamma nextafter "
    "population_count shift_left shift_right_logical shift_right_arithmetic "
    "reduce_precision reduce_and reduce_or reduce_xor argmin rng_bit_generator random_wrap "
    "random_unwrap random_split random_fold_in random_bits platform_index "
    "optimization_barrier copy_p copy split concatenate dynamic_slice gather scatter "
    "scatter-add name custom_jvp_call custom_vjp_call remat2 pjit while cond scan"
).split()


def test_the_public_surface_walk():
    """One walk of JAX's public functions (60-90 s), two checks of what it reached: every
    primitive is ruled or refused, and the rules hold on values. One test, since a fixture
    is built once per xdist worker (pytest-xdist's xdist_group does not group under pytest
    9: the node-id suffix it relies on is not applied)."""
    walk = walk_public_surface()
    every_primitive_is_ruled_or_refused(walk)
    rules_hold_on_values(walk)


def every_primitive_is_ruled_or_refused(walk):
    defined = defined_primitives()
    names = sorted(set(walk.primitives) | set(defined))
    support = {n: classify(n) for n in names}
    unknown = {n: sorted(walk.primitives.get(n, ()))[:3] or defined[n] for n in names
               if support[n].kind == "unknown"}  # fmt: skip
    assert not unknown, (
        f"primitives with neither a dim rule nor a refusal (primitive: public functions that "
        f"reach it, or the module defining it): {unknown}. Add a rule in jscaler/ir/rules_*.py "
        f"or a Refusal with a reason and a fix in jscaler/ir/refusals.py"
    )
    refused_reached = sorted(n for n in walk.primitives if support[n].kind == "refused")
    covered = [n for n in names if support[n].kind != "refused"]
    print(
        f"\n{len(walk.walked)} public functions walked ({len(walk.failed)} fitted no example), "
        f"{len(walk.primitives)} primitives reached, {len(defined)} defined by jax; "
        f"covered {len(covered)}, refused {len(names) - len(covered)} "
        f"(reached by public functions: {refused_reached})"
    )
    for n in names:
        if support[n].kind == "refused":
            assert support[n].reason and support[n].fix, n
    # the walk is only worth something while it reaches the surface
    assert len(walk.walked) >= 600 and len(walk.primitives) >= 150
    # what users reach only through collectives, tokens or internals is all that is refused
    assert set(refused_reached) <= {"psum", "pmax", "pmin", "axis_index", "create_token",
                                    "dce_sink", "after_all"}, refused_reached  # fmt: skip


@pytest.mark.parametrize("name", REQUIRED)
def test_required_primitive_has_a_rule(name):
    assert classify(name).kind in ("rule", "inlined", "composite"), name


def rules_hold_on_values(walk):
    """The first example of every walked function, each op's annotation checked on values
    (5765 promises, 2026-11-27). An example JAX itself cannot run (a shape it traced but
    cannot lower) is skipped; an annotation that breaks its promise fails."""
    seen: dict[str, int] = {}
    checked, skipped = 0, 0
    for name, fn, args in walk.examples:
        if seen.get(name, 0) >= 1:
            continue
        seen[name] = seen.get(name, 0) + 1
        try:
            checked += check_fn(fn, *args)
        except AnnotationError:
            raise
        except Exception:  # noqa: BLE001 - JAX refusing its own traced example
            skipped += 1
    print(f"\n{checked} (op, dim) promises checked on values; {skipped} examples JAX cannot run")
    assert checked > 5000 and skipped < 40


@pytest.mark.parametrize(
    "fn, args",
    [
        (lambda x: jnp.stack([x, 2 * x], axis=1), (np.ones((4, 6), np.float32),)),
        (lambda x: jnp.tile(x, (2, 1)), (np.ones((4, 6), np.float32),)),
        (lambda x: jax.lax.approx_max_k(x, 2), (np.arange(24.0, dtype=np.float32).reshape(4, 6),)),
        (lambda x: jax.lax.top_k(x.T, 2), (np.arange(24.0, dtype=np.float32).reshape(4, 6),)),
        (
            lambda x, w: jax.lax.ragged_dot(x, w, jnp.array([3, 5], jnp.int32)),
            (np.ones((8, 4), np.float32), np.ones((2, 4, 6), np.float32)),
        ),
        (lambda x: jax.lax.sort((x, -x), num_keys=1), (np.ones((4, 6), np.float32),)),
        (
            lambda x: jnp.linalg.cholesky(x @ x.mT + 4 * jnp.eye(4)),
            (np.ones((3, 4, 4), np.float32),),
        ),
        (
            lambda x: jnp.take_along_axis(x, jnp.argsort(x, axis=1), axis=1),
            (np.arange(24.0, dtype=np.float32).reshape(4, 6)[:, ::-1].copy(),),
        ),
    ],  # fmt: skip
    ids=[
        "stack",
        "tile",
        "approx_max_k",
        "top_k_axis0",
        "ragged_dot",
        "sort2",
        "cholesky",
        "take_along_axis",
    ],  # fmt: skip
)
def test_new_rules_split_what_they_say(fn, args):
    assert check_fn(fn, *args) >= 1


def _unstack_loss(p, b):
    w1, w2 = p["w"]  # jax 0.12: unstack
    k1, _ = jax.random.split(jax.random.key(0))  # unstack of keys
    noise = 0.0 * jax.random.normal(k1, b["x"].shape)
    h = jnp.stack([jnp.tanh(b["x"] @ w1), jnp.tanh(b["x"] @ w2)], axis=1)
    return jnp.mean((jnp.tile(h.sum(1), (1, 2))[:, :8] + noise[:, :8] - b["y"]) ** 2)


def test_unstack_stack_tile_train_like_one_device():
    k = jax.random.key(1)
    params = {"w": 0.3 * jax.random.normal(k, (2, 16, 16))}
    batch = {"x": jax.random.normal(k, (8, 16)), "y": jnp.zeros((8, 8))}
    graph = jscaler.trace(_unstack_loss, params, batch)
    prims = {o.primitive for o in graph.ops}
    assert {"unstack", "stack", "tile"} <= prims
    batches = [{"x": jax.random.normal(jax.random.key(s), (8, 16)), "y": batch["y"]}
               for s in range(3)]  # fmt: skip
    for plan in (dp(), zero(stage=3)):
        assert_matches_reference(params, _unstack_loss, batches, plan)


def _static_while(p, b):
    def body(c):
        i, h = c
        return i + 1, jnp.tanh(h @ p["w"])

    return jnp.mean(jax.lax.while_loop(lambda c: c[0] < 3, body, (0, b["x"]))[1] ** 2)


def _dynamic_while(p, b):
    def body(c):
        return c[0] + 1, jnp.tanh(c[1] @ p["w"])

    h = jax.lax.while_loop(lambda c: (c[0] < 3) & (c[1].sum() < 1e3), body, (0, b["x"]))[1]
    return jnp.mean(h**2)


def test_static_while_becomes_a_scan_and_trains():
    k = jax.random.key(2)
    params = {"w": 0.3 * jax.random.normal(k, (16, 16))}
    batch = {"x": jax.random.normal(k, (8, 16))}
    graph = jscaler.trace(_static_while, params, batch)
    assert [o.primitive for o in graph.ops if o.kind == "loop"] == ["scan"]
    with pytest.raises(ValueError, match="Reverse-mode"):  # what JAX alone does
        jax.grad(_static_while)(params, batch)
    tr = jscaler.parallelize(params, _static_while, optax.sgd(0.1), batch, plan=dp())
    before = float(tr.step(batch)["loss"])
    assert np.isfinite(before) and float(tr.step(batch)["loss"]) < before


def test_dynamic_while_under_grad_is_refused_at_trace_naming_it():
    params = {"w": jnp.ones((16, 16))}
    batch = {"x": jnp.ones((8, 16))}
    with pytest.raises(jscaler.UnsupportedOpError, match=r"while_loop at module path '<root>'"):
        jscaler.trace(_dynamic_while, params, batch)
    # a loop gradients do not reach is fine
    jscaler.trace(lambda p, b: _dynamic_while(jax.lax.stop_gradient(p), b) + p["w"].sum(),
                  params, batch)  # fmt: skip


def test_refused_primitive_says_why_and_what_to_do():
    from jax.experimental import io_callback

    def loss(p, b):
        y = io_callback(np.sin, jax.ShapeDtypeStruct((8, 3), jnp.float32), b["x"])
        return (y * p["w"]).sum()

    with pytest.raises(jscaler.UnsupportedOpError, match=r"'io_callback' at module path.*Fix:"):
        jscaler.trace(loss, {"w": jnp.ones(3)}, {"x": jnp.ones((8, 3))})


@jax.custom_vjp
def _scaled_tanh(x):
    return jnp.tanh(x)


_scaled_tanh.defvjp(lambda x: (jnp.tanh(x), x), lambda x, g: (g * (1 - jnp.tanh(x) ** 2),))


def _wrapped_loss(p, b):
    """What user code wraps its layers in: remat with a policy and named checkpoints, a
    custom_vjp, a jit with donated arguments, a cond, a platform switch."""
    from jax.ad_checkpoint import checkpoint_name

    policy = jax.checkpoint_policies.save_only_these_names("proj")

    @functools.partial(jax.checkpoint, policy=policy)
    def layer(x, w):
        return _scaled_tanh(checkpoint_name(x @ w, "proj"))

    @functools.partial(jax.jit, donate_argnums=0)
    def head(h, w):
        return h @ w

    h = layer(b["x"], p["w1"])
    h = jax.lax.cond(b["flag"].any(), lambda t: t * 2.0, lambda t: t + 1.0, h)
    h = jax.lax.platform_dependent(h, cpu=jnp.sin, default=jnp.cos)
    return jnp.mean((head(h, p["w2"]) - b["y"]) ** 2)


def test_remat_policies_custom_vjp_donated_jit_cond_train_like_one_device():
    k = jax.random.key(3)
    params = {"w1": 0.3 * jax.random.normal(k, (16, 32)), "w2": 0.3 * jax.random.normal(k, (32, 4))}
    batches = [
        {"x": jax.random.normal(jax.random.key(s), (8, 16)), "y": jnp.zeros((8, 4)),
         "flag": jnp.full((8,), s % 2 == 0)}
        for s in range(3)
    ]  # fmt: skip
    graph = jscaler.trace(_wrapped_loss, params, batches[0])
    assert graph.coverage().ops == 1.0
    assert {"remat2", "cond", "platform_index"} <= {o.primitive for o in graph.ops}
    assert_matches_reference(params, _wrapped_loss, batches, dp())
