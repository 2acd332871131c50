"""trace(): module paths, select/layers, coverage, and as_fn() parity with the original loss.

Parity tolerance: as_fn re-binds the same primitives in the same order, so under jit the
loss and every gradient leaf agree to |a-b| <= 1e-6*|b| + 1e-7*max|b| in fp32 (XLA may fuse
the inlined program differently from the nested-jit original).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.extend.core import Primitive

import jscaler
import models
from jscaler import TraceError, UnsupportedOpError
from jscaler.ir import unroll
from jscaler.runtime.reference import ATOL, RTOL

MODELS = ["gpt-tiny", "convnet-tiny", "mlp-tiny"]


def assert_close(a, b, what):
    for (path, x), y in zip(
        jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_leaves(b), strict=True
    ):
        x, y = np.asarray(x), np.asarray(y)
        # fp32's gradient tolerance (jscaler.runtime.reference): jax's softmax and
        # logsumexp are traced inline, so their gradients are autodiff's of the same
        # values, not their custom_jvp rules' (jax >= 0.12.1), a few ulps apart
        tol = RTOL * np.abs(y) + ATOL["grad"] * np.max(np.abs(y))
        assert np.all(np.abs(x - y) <= tol), f"{what} {jax.tree_util.keystr(path)} differs"


@pytest.fixture(scope="module", params=MODELS)
def traced(request):
    spec = models.get(request.param)
    model, batch = spec.init(0), spec.batch(spec.batch_size, 0)
    return spec, model, batch, jscaler.trace(spec.loss, model, batch)


def value_and_grad(spec, fn, model, batch):
    if spec.kind == "nnx":
        return nnx.jit(nnx.value_and_grad(fn))(model, batch)
    return jax.jit(jax.value_and_grad(fn))(model, batch)


def test_as_fn_matches_the_original_loss_and_grads(traced):
    spec, model, batch, graph = traced
    loss, grads = value_and_grad(spec, spec.loss, model, batch)
    loss2, grads2 = value_and_grad(spec, graph.as_fn(), model, batch)
    assert_close(loss2, loss, "loss")
    assert_close(grads2, grads, "grad")


def test_every_op_is_annotated(traced):
    _, _, _, graph = traced
    assert graph.coverage() == jscaler.Coverage(ops=1.0, flops=1.0)
    assert graph.flops > 0


def test_annotations_keep_their_promises_on_real_values(traced):
    _, model, batch, graph = traced
    assert jscaler.check_annotations(graph, model, batch) > len(graph.ops) // 2


def test_params_are_named_by_their_path(traced):
    spec, _, _, graph = traced
    names = {t.name for t in graph.params()}
    expected = {
        "gpt-tiny": "blocks/0/attn/q_proj/kernel",
        "convnet-tiny": "fc1/kernel",
        "mlp-tiny": None,
    }[spec.name]
    if expected:
        assert expected in names
    assert all(t.role == "batch" for t in graph.tensors.values() if t.name.startswith("batch/"))


def gpt_graph():
    spec = models.get("gpt-tiny")
    model = spec.init(0)
    return jscaler.trace(spec.loss, model, spec.batch(8, 0))


def test_gpt_ops_carry_nnx_module_paths():
    graph = gpt_graph()
    paths = {o.path for o in graph.ops}
    for p in ("embed", "blocks/0/attn/q_proj", "blocks/3/mlp/down_proj", "lm_head", "norm_f"):
        assert p in paths
    dots = [o for o in graph.ops if o.primitive == "dot_general"]
    assert {o.path for o in dots} >= {f"blocks/{i}/attn/{n}_proj" for i in range(4) for n in "qkvo"}


def test_select_and_layers():
    graph = gpt_graph()
    attn = graph.select("blocks/*/attn/*")
    assert attn.ops and all(o.path.split("/")[2] == "attn" for o in attn.ops)
    assert {o.path.split("/")[3] for o in attn.ops} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    whole_attn = graph.select("blocks/1/attn")
    assert len(whole_attn) > len(graph.select("blocks/1/attn/*"))  # includes softmax etc.
    assert not graph.select("nothing/here").ops
    layers = graph.layers()
    assert [layer.name for layer in layers] == [f"blocks/{i}" for i in range(4)]
    sizes = {len(layer.graph) for layer in layers}
    assert len(sizes) == 1  # repeated: the same op count each
    first = layers[0].graph
    assert set(first.inputs) - {t for o in first.ops for t in o.outputs}  # has boundary inputs


def test_layers_group_parallel_lists():
    class Model(nnx.Module):
        def __init__(self, rngs):
            self.attns = nnx.List([nnx.Linear(8, 8, rngs=rngs) for _ in range(3)])
            self.mlps = nnx.List([nnx.Linear(8, 8, rngs=rngs) for _ in range(3)])

        def __call__(self, x):
            for a, m in zip(self.attns, self.mlps):
                x = m(jnp.tanh(a(x)))
            return x

    model = Model(nnx.Rngs(0))
    g = jscaler.trace(lambda m, b: m(b).sum(), model, jnp.ones((2, 8)))
    assert [layer.name for layer in g.layers()] == [f"attns/{i}+mlps/{i}" for i in range(3)]
    assert [layer.index for layer in g.layers()] == [0, 1, 2]


class ScanMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(8)(x)

        class Block(nn.Module):
            @nn.compact
            def __call__(self, c, _):
                return nn.tanh(nn.Dense(8)(c)) + c, None

        scan = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
        x, _ = scan(name="layers")(x, None)
        return nn.remat(nn.Dense)(4)(x)


@jax.custom_vjp
def odd_sin(x):
    return jnp.sin(x)


odd_sin.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (2.0 * g,))  # a deliberately odd grad


def scan_setup():
    m = ScanMLP()
    batch = {"x": jax.random.normal(jax.random.key(1), (4, 6)), "y": jnp.ones((4, 4))}
    params = m.init(jax.random.key(0), batch["x"])

    def loss(p, b):
        return jnp.mean((odd_sin(m.apply(p, b["x"])) - b["y"]) ** 2)

    return params, batch, loss


def test_linen_scan_remat_and_custom_vjp():
    params, batch, loss = scan_setup()
    g = jscaler.trace(loss, params, batch)
    kinds = {o.primitive: o.kind for o in g.ops}
    # nn.scan over stacked layers: its body's ops are graph ops, one iteration's
    assert "scan" not in kinds and kinds["remat2"] == "call"
    assert kinds["custom_vjp_call"] == "call"  # kept whole, so its custom grad survives
    looped = [o for o in g.ops if o.loop is not None]
    assert {o.primitive for o in looped} >= {"scan_carry", "scan_slice", "scan_final"}
    assert {o.loop.length for o in looped} == {3}
    assert {o.path for o in looped} >= {"ScanMLP/layers/Dense_0"}
    carry = next(o for o in looped if o.primitive == "scan_carry")
    assert carry.annotation.inputs[0][0][0] in carry.annotation.splittable()  # the batch
    l1, g1 = jax.jit(jax.value_and_grad(loss))(params, batch)
    l2, g2 = jax.jit(jax.value_and_grad(g.as_fn()))(params, batch)
    assert_close(l2, l1, "loss")
    assert_close(g2, g1, "grad")


def rnn_setup():
    """A scan over time whose stacked input is data, not layers: it stays a loop op."""
    params = {"w": jax.random.normal(jax.random.key(0), (6, 6)) * 0.3}
    batch = {"x": jax.random.normal(jax.random.key(1), (3, 4, 6))}

    def loss(p, b):
        def step(h, x):
            with jax.named_scope("cell"):
                return jnp.tanh(h @ p["w"] + x), None

        h, _ = jax.lax.scan(step, jnp.zeros((4, 6)), b["x"])
        return jnp.mean(h**2)

    return params, batch, loss


def test_unroll_expands_a_scan_into_layers():
    params, batch, loss = rnn_setup()
    g = jscaler.trace(loss, params, batch)
    loop = next(o for o in g.ops if o.kind == "loop")
    assert loop.loop is None  # a scan over data is not exposed
    u = unroll(g, loop)
    assert not [o for o in u.ops if o.kind == "loop"]
    assert len(u.layers()) == 3
    assert u.coverage().ops == 1.0
    assert u.flops == pytest.approx(g.flops)
    l1, g1 = jax.jit(jax.value_and_grad(loss))(params, batch)
    l2, g2 = jax.jit(jax.value_and_grad(u.as_fn()))(params, batch)
    assert_close(l2, l1, "loss")
    assert_close(g2, g1, "grad")
    assert jscaler.check_annotations(u, params, batch) > 0
    with pytest.raises(TraceError, match="expands loop ops"):
        unroll(u, u.ops[0])


def test_nnx_state_updates_are_carried():
    class Counter(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(4, 4, rngs=rngs)
            self.calls = nnx.Variable(jnp.zeros((), jnp.int32))

        def __call__(self, x):
            self.calls[...] = self.calls[...] + 1
            return self.lin(x)

    model = Counter(nnx.Rngs(0))
    g = jscaler.trace(lambda m, b: m(b).sum(), model, jnp.ones((2, 4)))
    assert {t.role for t in g.tensors.values() if t.name == "calls"} == {"state"}
    fn = g.as_fn()
    fn(model, jnp.ones((2, 4)))
    fn(model, jnp.ones((2, 4)))
    assert int(model.calls[...]) == 2


# ---- errors ------------------------------------------------------------------------------

my_op_p = Primitive("my_scale")
my_op_p.def_impl(lambda x: 3.0 * x)
my_op_p.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))


def test_unannotated_primitive_names_its_module_path_and_the_fix():
    class Inner(nnx.Module):
        def __call__(self, x):
            return my_op_p.bind(x)

    class Outer(nnx.Module):
        def __init__(self):
            self.block = Inner()

        def __call__(self, x):
            return self.block(x).sum()

    with pytest.raises(UnsupportedOpError) as e:
        jscaler.trace(lambda m, b: m(b), Outer(), jnp.ones((2, 3)))
    msg = str(e.value)
    assert "'my_scale'" in msg and "'block'" in msg and "jscaler.register_op" in msg
    g = jscaler.trace(lambda m, b: m(b), Outer(), jnp.ones((2, 3)), strict=False)
    assert g.coverage().ops < 1.0 and [o.primitive for o in g.unannotated()] == ["my_scale"]
    jscaler.register_op(my_op_p, "a b -> a b")
    try:
        g = jscaler.trace(lambda m, b: m(b), Outer(), jnp.ones((2, 3)))
        assert g.coverage().ops == 1.0
    finally:
        from jscaler.ir.registry import unregister_op

        unregister_op("my_scale")


def test_loss_must_be_a_float_scalar():
    with pytest.raises(TraceError, match="scalar float loss"):
        jscaler.trace(lambda p, b: p["w"] * b, {"w": jnp.ones(3)}, jnp.ones(3))


def test_as_fn_rejects_a_different_params_structure():
    g = jscaler.trace(lambda p, b: (p["w"] * b).sum(), {"w": jnp.ones(3)}, jnp.ones(3))
    with pytest.raises(TypeError, match="different structure"):
        g.as_fn()({"v": jnp.ones(3)}, jnp.ones(3))


def test_nnx_state_as_params_names_ops_by_module():
    """A loss over an nnx State (rebuilt with nnx.merge inside) names ops by the module
    that holds their parameters, as a traced nnx Module does, not '<root>'."""
    from flax import nnx

    from models import gpt

    cfg = gpt.tiny()
    graphdef, state = nnx.split(gpt.GPT(cfg, rngs=nnx.Rngs(0)))
    batch = gpt.synthetic_batch(cfg, 8, 0)
    graph = jscaler.trace(lambda s, b: gpt.loss(nnx.merge(graphdef, s), b), state, batch)
    paths = {o.path for o in graph.ops}
    assert {"blocks/0/attn/q_proj", "blocks/1/mlp/down_proj", "embed"} <= paths
    assert sum(o.path == "" for o in graph.ops) < 0.1 * len(graph.ops)
    assert [(layer.name, layer.index) for layer in graph.layers()][:2] == [
        ("blocks/0", 0),
        ("blocks/1", 1),
    ]


def test_haiku_separators_are_not_in_names():
    """Haiku's 'mlp/~/linear_0' keys name params as op paths do: without the '~'."""
    graph = jscaler.trace(
        lambda p, b: (b["x"] @ p["mlp/~/linear_0"]["w"]).sum(),
        {"mlp/~/linear_0": {"w": jnp.ones((4, 2))}},
        {"x": jnp.ones((8, 4))},
    )
    names = {graph.tensors[t].name for t in graph.inputs}
    assert "mlp/linear_0/w" in names


def test_a_ragged_dot_counts_each_rows_own_group():
    """A dropless MoE's grouped matmul: each row meets one group's matrix, so its FLOPs are
    a dense dot's over one group, forward and in both gradients (it counted none)."""
    rows, k, n, groups = 48, 16, 8, 4
    sizes = jnp.array([12, 12, 12, 12], jnp.int32)

    def loss(p, batch):
        return jax.lax.ragged_dot(batch["x"], p["w"], sizes).sum()

    params = {"w": jnp.ones((groups, k, n))}
    g = jscaler.trace(loss, params, {"x": jnp.ones((rows, k))})
    (op,) = [o for o in g.ops if o.primitive == "ragged_dot_general"]
    assert op.flops == 2 * rows * k * n
    # its weight gradient contracts the ragged rows into one output per group
    jaxpr = jax.make_jaxpr(jax.grad(lambda w: loss({"w": w}, {"x": jnp.ones((rows, k))})))(
        params["w"]
    )
    from jscaler.ir.flops import op_flops

    grads = [e for e in jaxpr.eqns if e.primitive.name == "ragged_dot_general"][1:]
    assert grads and [op_flops(e) for e in grads] == [2 * rows * k * n] * len(grads)
