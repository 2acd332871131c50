"""Dim annotations: the text form, binding to shapes, and the rules of single primitives."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jscaler
from jscaler import Annotation, AnnotationError
from jscaler.ir.check import check_op


def ann_of(fn, *args, primitive=None):
    """The annotation of the (last, or named) op jscaler traces from ``fn(*args)``."""
    g = jscaler.trace(lambda p, b: jnp.sum(fn(*b)).astype(jnp.float32), {}, list(args))
    ops = [o for o in g.ops if primitive is None or o.primitive == primitive]
    return ops[-1 if primitive is None else 0]


def op_of(fn, *args, primitive):
    g = jscaler.trace(lambda p, b: jnp.sum(fn(*b)).astype(jnp.float32), {}, list(args))
    return next(o for o in g.ops if o.primitive == primitive)


# ---- text form ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    ["m k+, k+ n -> m n", "b (h d) -> b h d", "(), a b -> a b", "a^ b -> b", "a b -> a b, a b"],
)
def test_parse_format_round_trip(text):
    a = Annotation.parse(text)
    assert str(a) == text
    assert Annotation.parse(str(a)) == a
    assert hash(Annotation.parse(text)) == hash(a)


def test_parse_reads_groups_kinds_and_reductions():
    a = Annotation.parse("b (h d), k+ -> b h d")
    assert a.inputs == ((("b",), ("h", "d")), (("k",),))
    assert a.kinds == {"b": "", "h": "", "d": "", "k": "+"}
    assert a.is_reduction("k") and not a.is_reduction("b")
    assert a.splittable() == ("b", "h", "k")  # d is not first in its group


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("a b", "exactly one '->'"),
        ("a+ b -> a+ b", "'+' (partial sums) but appears in an output"),
        ("a b -> a^ b", "marked both"),
        ("(a b -> a b", "unclosed"),
        ("a $ -> a", "cannot read"),
    ],
)
def test_parse_errors_say_what_is_wrong(text, fragment):
    with pytest.raises(AnnotationError, match=re.escape(fragment)):
        Annotation.parse(text)


def test_bind_infers_group_sizes_and_checks_shapes():
    a = Annotation.parse("b (h d), h -> b h d").bind([(8, 12), (3,)], [(8, 3, 4)])
    assert dict(a.sizes) == {"b": 8, "h": 3, "d": 4}
    with pytest.raises(AnnotationError, match="should have size"):
        Annotation.parse("a b, b c -> a c").bind([(2, 3), (4, 5)], [(2, 5)])
    with pytest.raises(AnnotationError, match="rank 3"):
        Annotation.parse("a b -> a b").bind([(2, 3, 4)], [(2, 3)])
    with pytest.raises(AnnotationError, match="has 2 inputs"):
        Annotation.parse("a, a -> a").bind([(2,)], [(2,)])


# ---- rules of single primitives ----------------------------------------------------------

X = jnp.arange(24.0).reshape(2, 3, 4) / 7


def test_dot_general_batch_contract_free():
    o = op_of(
        lambda x, y: jnp.einsum("bik,bkj->bij", x, y),
        X,
        X.transpose(0, 2, 1) + 1,
        primitive="dot_general",
    )
    assert str(o.annotation) == "a b c+, a c+ d -> a b d"


def test_conv_features_partial_sums_spatial_not_split():
    img = jnp.ones((2, 8, 8, 4))
    ker = jnp.ones((3, 3, 4, 6))
    o = op_of(
        lambda x, w: lax.conv_general_dilated(
            x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        ),
        img,
        ker,
        primitive="conv_general_dilated",
    )
    a = o.annotation
    (n, h, w, ci), (kh, kw, ci2, co) = [[ax[0] for ax in t] for t in a.inputs]
    assert ci == ci2 and a.kinds[ci] == "+"
    assert a.kinds[n] == "" and a.kinds[co] == ""
    assert all(a.kinds[d] == "^" for d in (h, w, kh, kw))


def test_depthwise_conv_splits_by_group():
    img = jnp.ones((2, 8, 8, 4))
    ker = jnp.ones((3, 3, 1, 4))
    o = op_of(
        lambda x, w: lax.conv_general_dilated(
            x, w, (1, 1), "SAME", feature_group_count=4, dimension_numbers=("NHWC", "HWIO", "NHWC")
        ),
        img,
        ker,
        primitive="conv_general_dilated",
    )
    g = o.annotation.inputs[0][3][0]
    assert g in o.annotation.splittable()


@pytest.mark.parametrize(
    "src, dst, expected",
    [
        ((2, 12), (2, 3, 4), "a (b c) -> a b c"),
        ((2, 3, 4), (6, 4), "a b c -> (a b) c"),
        ((4,), (1, 4), "a -> b^ a"),
        ((6, 4), (4, 6), "a^ b^ -> c^ d^"),  # no common refinement
        ((6, 4), (2, 12), "(a b) c -> a (b c)"),
    ],
)
def test_reshape_groups(src, dst, expected):
    o = op_of(lambda x: x.reshape(dst), jnp.ones(src), primitive="reshape")
    assert str(o.annotation) == expected


def test_reduce_sum_is_partial_and_max_is_not():
    assert str(op_of(lambda x: x.sum(1), X, primitive="reduce_sum").annotation) == "a b+ c -> a c"
    assert str(op_of(lambda x: x.max(1), X, primitive="reduce_max").annotation) == "a b^ c -> a c"


def test_embedding_gather_splits_vocab_into_partial_sums():
    table = jnp.ones((16, 4))
    o = op_of(lambda t, i: t[i], table, jnp.array([[1, 2], [3, 4]]), primitive="gather")
    v, d = (ax[0] for ax in o.annotation.inputs[0])
    assert o.annotation.kinds[v] == "+" and o.annotation.kinds[d] == ""


def test_broadcast_slice_concat_transpose_cumsum():
    assert (
        str(
            op_of(
                lambda x: jnp.broadcast_to(x[:, None], (3, 5)),
                jnp.ones(3),
                primitive="broadcast_in_dim",
            ).annotation
        )
        == "a -> a b"
    )
    assert str(op_of(lambda x: x[:, 1:], X, primitive="slice").annotation) == "a b^ c -> a d^ c"
    assert (
        str(op_of(lambda x: jnp.concatenate([x, x], 1), X, primitive="concatenate").annotation)
        == "a b^ c, a d^ c -> a e^ c"
    )
    assert str(op_of(lambda x: x.T, X, primitive="transpose").annotation) == "a b c -> c b a"
    assert str(op_of(lambda x: jnp.cumsum(x, 1), X, primitive="cumsum").annotation) == (
        "a b^ c -> a b^ c"
    )


def test_elementwise_broadcasts_scalars_and_size_one_axes():
    o = op_of(lambda x, y: x + y, X, jnp.ones((1, 3, 1)), primitive="add")
    assert str(o.annotation) == "a b c, d^ b e^ -> a b c"
    o = op_of(lambda x: x * 2.0, X, primitive="mul")
    assert str(o.annotation) == "a b c, () -> a b c"


RULE_CASES = {
    "dot": (lambda x, y: x @ y, (jnp.arange(12.0).reshape(3, 4), jnp.arange(8.0).reshape(4, 2))),
    "conv": (
        lambda x, w: lax.conv_general_dilated(
            x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        ),
        (
            jnp.sin(jnp.arange(128.0)).reshape(2, 4, 4, 4),
            jnp.cos(jnp.arange(72.0)).reshape(3, 3, 4, 2),
        ),
    ),
    "pool": (
        lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID"),
        (jnp.sin(jnp.arange(64.0)).reshape(2, 4, 4, 2),),
    ),
    "gather": (
        lambda t, i: t[i],
        (jnp.sin(jnp.arange(32.0)).reshape(8, 4), jnp.array([[1, 7], [3, 4]])),
    ),
    "reshape": (lambda x: x.reshape(2, 2, 6), (jnp.sin(jnp.arange(24.0)).reshape(4, 6),)),
    "softmax": (lambda x: jax.nn.softmax(x, -1), (jnp.sin(jnp.arange(24.0)).reshape(4, 6),)),
    "cumsum": (lambda x: jnp.cumsum(x, 0), (jnp.sin(jnp.arange(24.0)).reshape(4, 6),)),
    "argmax": (lambda x: jnp.argmax(x, 1), (jnp.sin(jnp.arange(24.0)).reshape(4, 6),)),
    "scatter_add": (
        lambda x, i, u: x.at[i].add(u),
        (jnp.zeros((8, 4)), jnp.array([1, 1, 5]), jnp.ones((3, 4))),
    ),
    "dynamic_slice": (
        lambda x, i: lax.dynamic_slice_in_dim(x, i, 2, 1),
        (jnp.sin(jnp.arange(24.0)).reshape(4, 6), jnp.array(1)),
    ),
    "pad": (lambda x: jnp.pad(x, ((0, 0), (1, 2))), (jnp.ones((4, 6)),)),
    "iota": (lambda x: x + jnp.arange(6.0), (jnp.ones((4, 6)),)),
    "unary": (
        lambda x: (
            jnp.sign(x)
            + jax.scipy.special.erf(x)
            + jax.scipy.special.erfc(x)
            + jax.nn.sigmoid(x)
            + x**3
            + lax.rsqrt(x * x + 1)
            + jnp.isfinite(x)
            + jnp.tanh(x)
        ),
        (jnp.sin(jnp.arange(24.0)).reshape(4, 6),),
    ),
    "scalars": (lambda x, s: x * jnp.exp(s) + jnp.log(s + 2.0), (jnp.ones((4, 6)), jnp.array(0.5))),
    "depthwise_conv": (
        lambda x, w: lax.conv_general_dilated(
            x,
            w,
            (1, 1),
            "SAME",
            feature_group_count=4,
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
        ),
        (
            jnp.sin(jnp.arange(128.0)).reshape(2, 4, 4, 4),
            jnp.cos(jnp.arange(36.0)).reshape(3, 3, 1, 4),
        ),
    ),
    "avg_pool": (
        lambda x: lax.reduce_window(x, 0.0, lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID"),
        (jnp.sin(jnp.arange(64.0)).reshape(2, 4, 4, 2),),
    ),
    "max_pool_grad": (  # select_and_scatter_add, as the backward of max pooling emits it
        jax.grad(
            lambda x: lax.reduce_window(
                x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID"
            ).sum()
        ),
        (jnp.sin(jnp.arange(64.0)).reshape(2, 4, 4, 2),),
    ),
    "dynamic_update_slice": (
        lambda x, u: lax.dynamic_update_slice(x, u, (0, 2)),
        (jnp.sin(jnp.arange(24.0)).reshape(4, 6), jnp.ones((4, 2))),
    ),
    "squeeze_expand": (
        lambda x: jnp.squeeze(jnp.expand_dims(x, 1), 1)[:, None] * 2,
        (jnp.sin(jnp.arange(24.0)).reshape(4, 6),),
    ),
    "min_argmin": (
        lambda x: x.min(0) + jnp.argmin(x, 0),
        (jnp.sin(jnp.arange(24.0)).reshape(4, 6),),
    ),
    "random_dropout": (
        lambda x, k: jnp.where(jax.random.bernoulli(k, 0.5, x.shape), x, 0.0),
        (jnp.sin(jnp.arange(24.0)).reshape(4, 6), jax.random.key(0)),
    ),
    "cond": (
        lambda x, i: lax.cond(i > 0, lambda x: jnp.sin(x) * 2, lambda x: x + 1, x),
        (jnp.sin(jnp.arange(24.0)).reshape(4, 6), jnp.array(1)),
    ),
    "while": (
        lambda x: lax.while_loop(lambda c: c[1] < 3, lambda c: (c[0] * 1.5, c[1] + 1), (x, 0))[0],
        (jnp.sin(jnp.arange(24.0)).reshape(4, 6),),
    ),
    "transpose_matmul": (
        lambda x, w: (x.T @ w).T,
        (jnp.sin(jnp.arange(24.0)).reshape(4, 6), jnp.cos(jnp.arange(8.0)).reshape(4, 2)),
    ),
}


@pytest.mark.parametrize("case", sorted(RULE_CASES))
def test_every_rule_keeps_its_promises(case):
    fn, args = RULE_CASES[case]
    g = jscaler.trace(lambda p, b: jnp.sum(fn(*b)).astype(jnp.float32), {}, list(args))
    assert g.coverage() == jscaler.Coverage(1.0, 1.0)
    n = jscaler.check_annotations(g, {}, list(args))
    assert n > 0


def test_cond_and_while_compose_their_bodies():
    x = jnp.ones((4, 6))
    cond = op_of(
        lambda x, i: lax.cond(i > 0, jnp.sin, jnp.cos, x), x, jnp.array(1), primitive="cond"
    )
    assert str(cond.annotation) == "(), a b -> a b"
    loop = op_of(
        lambda x: lax.while_loop(lambda c: c[0].sum() < 9, lambda c: (c[0] * 1.5, c[1]), (x, 0))[0],
        x,
        primitive="while",
    )
    assert loop.annotation.splittable() == ()  # the condition reads the whole carry


def test_a_wrong_rule_is_caught():
    """check_op must fail for a rule that lies: cumsum is not splittable along its axis."""
    x = jnp.sin(jnp.arange(24.0)).reshape(4, 6)
    op = op_of(lambda x: jnp.cumsum(x, 0), x, primitive="cumsum")
    lying = Annotation.parse("a b -> a b").bind([(4, 6)], [(4, 6)])
    from dataclasses import replace

    with pytest.raises(AnnotationError, match="splits plainly"):
        check_op(replace(op, annotation=lying), [np.asarray(x)])
    lying_sum = Annotation.parse("a^ b+ -> a^").bind([(4, 6)], [(4,)])
    mx = op_of(lambda x: x.max(1), x, primitive="reduce_max")
    with pytest.raises(AnnotationError, match="do not add up"):
        check_op(replace(mx, annotation=lying_sum), [np.asarray(x)])
