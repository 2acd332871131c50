"""The public JAX surface and the primitives it lowers to.

jscaler can plan any op it has a dim rule for. Which primitives reach a user's graph is
decided by JAX, not by us: a new jax release may lower ``a, b = x`` to a new primitive
(jax 0.12's ``unstack``). This module finds them the way a user's model would: it walks
every public callable of ``jax.numpy`` (and its ``linalg`` and ``fft``), ``jax.lax``,
``jax.nn``, ``jax.random`` and ``jax.scipy.special`` with small example inputs under
``jax.make_jaxpr`` and collects every primitive the jaxprs hold, sub-jaxprs included.
It also lists every primitive object JAX defines (``jax.lax``'s ``*_p`` and the
primitives of JAX's own modules), reached or not.

``tests/test_primitive_coverage.py`` holds each to a rule or to a refusal with a reason
(:mod:`jscaler.ir.refusals`), so a new primitive fails that test by name, not a user's
model. ``python -m jscaler.ir.surface`` prints the counts.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import jax
import jax.extend.core
import jax.numpy as jnp

__all__ = ["Walk", "defined_primitives", "jaxpr_primitives", "walk_public_surface"]

MODULES = {
    "jax.numpy": jnp,
    "jax.numpy.linalg": jnp.linalg,
    "jax.numpy.fft": jnp.fft,
    "jax.lax": jax.lax,
    "jax.nn": jax.nn,
    "jax.nn.initializers": jax.nn.initializers,
    "jax.random": jax.random,
    "jax.scipy.special": jax.scipy.special,
}

# public names that are not functions of arrays (dtypes, config, tracing helpers)
_SKIP = {
    "jax.numpy": {"printoptions", "set_printoptions", "get_printoptions", "load", "save",
                  "savez", "fromfile", "fromiter", "frombuffer", "fromfunction",
                  "fromstring", "from_dlpack", "vectorize", "frompyfunc", "piecewise",
                  "dtype", "iinfo", "finfo", "promote_types", "result_type", "can_cast",
                  "issubdtype", "isdtype", "ndim", "shape", "size", "isscalar",
                  "iterable", "broadcast_shapes"},
    "jax.lax": {"stop_gradient"},  # reached anyway; the rest are tried
}  # fmt: skip


@dataclass
class Walk:
    """What :func:`walk_public_surface` found.

    Attributes:
      primitives: primitive name -> the public functions (``module.name``) that reach it.
      walked: public callables traced with at least one example.
      failed: public callables no example fitted, with the last error's first line.
      examples: (public name, callable, arguments) of every example that traced.
    """

    primitives: dict[str, set[str]] = field(default_factory=dict)
    walked: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    examples: list[tuple[str, Callable, tuple]] = field(default_factory=list)


def jaxpr_primitives(jaxpr) -> Iterator[str]:
    """Every primitive name in a (closed) jaxpr and its sub-jaxprs."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        yield eqn.primitive.name
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from jaxpr_primitives(sub)


def defined_primitives() -> dict[str, str]:
    """Every primitive object JAX defines: name -> the module that holds it.

    Looks in every module under ``jax`` once ``jax.extend.core.primitives``, Pallas and
    ``xla_metadata`` are loaded (``jax.lax``'s ``*_p``, ``jax._src``: where they live)."""
    from jax.extend.core import Primitive

    # load the modules that define primitives a model may use, so the answer does not
    # depend on what happened to be imported before
    for name in ("jax.extend.core.primitives", "jax.experimental.pallas",
                 "jax.experimental.xla_metadata"):  # fmt: skip
        try:
            importlib.import_module(name)
        except ImportError:  # pragma: no cover - an optional module of another jax
            pass

    found: dict[str, str] = {}
    for name, mod in sorted(sys.modules.items()):
        # jax.experimental's own modules (sparse, jax2tf) load only when imported: not
        # counted, so the answer does not depend on what a test imported first
        if mod is None or not (name == "jax" or name.startswith("jax.")):
            continue
        if name.startswith("jax.experimental."):
            continue
        try:
            items = list(vars(mod).items())
        except TypeError:
            continue
        for _, v in items:
            if isinstance(v, Primitive):
                found.setdefault(v.name, name)
    return found


def _examples(kind: str) -> list[tuple]:
    """Argument tuples to try for a callable, most specific first."""
    f = jnp.linspace(0.1, 0.9, 16, dtype=jnp.float32).reshape(4, 4)
    v = jnp.linspace(0.1, 0.9, 4, dtype=jnp.float32)
    i = jnp.arange(16, dtype=jnp.int32).reshape(4, 4) % 3 + 1
    u = jnp.arange(16, dtype=jnp.uint32).reshape(4, 4)
    b = (jnp.arange(16).reshape(4, 4) % 2).astype(bool)
    c = f.astype(jnp.complex64)
    if kind == "random":
        key, old = jax.random.key(0), jax.random.PRNGKey(0)
        return [(key,), (key, (4, 4)), (key, f), (key, v), (key, 0.5, (4, 4)), (key, f, f),
                (key, 2.0, (4,)), (key, 4), (key, v, (4,)), (old,), (old, (4, 4)), (key, 0),
                (key, 2, (4,)), (key, 5, v), (key, f, (4, 4)), (key, 1, 5, (4,)),
                (key, 0.2, 0.5), (key, v, f + jnp.eye(4))]  # fmt: skip
    unary = [(f,), (i,), (b,), (c,), (u,), (v,)]
    binary = [(f, f), (i, i), (b, b), (u, u), (f, 0), (f, 1), (i, 1), (f, 2), (f, (1, 0)),
              (f, v), (f, (2, 2)), (v, 2), (f, i), (f, 0.5)]  # fmt: skip
    ternary = [(f, f, f), (b, f, f), (i, i, i), (f, 0, 2), (f, 1, 1), (f, 2, 1), (f, v, v),
               (f, f, 0), (f, 2, 0), (v, v, v), (i, 1, 1), (f, 1, 0)]  # fmt: skip
    static = [(), (4,), ((4, 4),), (4, 4), (4, jnp.float32), ((4, 4), 1.0), (0, 4), (0, 4, 1)]
    return unary + binary + ternary + static + [(f, f, f, f), (f, f, f, f, f), (f, 1, 1, 1)]


def _arity_fits(fn, args) -> bool:
    try:
        inspect.signature(fn).bind(*args)
    except (TypeError, ValueError):
        return False
    return True


def _try(fn, args, walk: Walk, name: str) -> bool:
    """Traces ``fn(*args)`` with array leaves abstract; records its primitives."""
    arrays = [k for k, a in enumerate(args) if isinstance(a, jax.Array)]

    def call(*xs):
        full = list(args)
        for k, x in zip(arrays, xs):
            full[k] = x
        out = fn(*full)
        if callable(out) and not isinstance(out, jax.Array):  # an initializer factory
            out = out(jax.random.key(0), (4, 4), jnp.float32)
        return out

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            closed = jax.make_jaxpr(call)(*[args[k] for k in arrays])
    except Exception as e:  # noqa: BLE001 - an example that does not fit is expected
        walk.failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        return False
    for p in jaxpr_primitives(closed):
        walk.primitives.setdefault(p, set()).add(name)
    walk.examples.append((name, call, tuple(args[k] for k in arrays)))
    return True


def _public_callables(mod_name: str, mod) -> Iterator[tuple[str, Callable]]:
    skip = _SKIP.get(mod_name, set())
    for attr in sorted(getattr(mod, "__all__", None) or dir(mod)):
        if attr.startswith("_") or attr in skip:
            continue
        obj = getattr(mod, attr, None)
        if inspect.ismodule(obj) or inspect.isclass(obj) or not callable(obj):
            continue
        if isinstance(obj, jax.extend.core.Primitive):
            continue  # listed by defined_primitives
        yield f"{mod_name}.{attr}", obj


def walk_public_surface(extra: dict[str, list[tuple]] | None = None) -> Walk:
    """Traces every public callable of :data:`MODULES` with example inputs.

    Each callable is tried with every example that fits its signature (all of them: a
    function reaches other primitives on ints than on floats); ``extra`` adds examples
    for callables whose parameters no generic example fits.
    """
    walk = Walk()
    extra = {**_lax_examples(), **_other_examples(), **(extra or {})}
    for mod_name, mod in MODULES.items():
        kind = "random" if mod_name == "jax.random" else "array"
        generic = _examples(kind)
        for name, fn in _public_callables(mod_name, mod):
            tries = list(extra.get(name, ())) + [a for a in generic if _arity_fits(fn, a)]
            tries = [(lambda a=a: a(), ()) if callable(a) else (fn, a) for a in tries]
            ok = False
            for target, args in tries:
                ok = _try(target, args, walk, name) or ok
            if ok:
                walk.walked.append(name)
                walk.failed.pop(name, None)
            elif name not in walk.failed:
                walk.failed[name] = "no example fits its signature"
    return walk


def _lax_examples() -> dict[str, list]:
    """Examples for ``jax.lax`` functions whose parameters are not arrays."""
    lax = jax.lax
    f = jnp.linspace(0.1, 0.9, 16, dtype=jnp.float32).reshape(4, 4)
    i = jnp.arange(16, dtype=jnp.int32).reshape(4, 4) % 4
    i0 = jnp.int32(1)
    x3 = jnp.ones((2, 4, 4), jnp.float32)
    g = jnp.ones((8, 4), jnp.float32)
    w = jnp.ones((2, 4, 3), jnp.float32)
    sizes = jnp.array([3, 5], jnp.int32)
    img = jnp.ones((1, 4, 4, 2), jnp.float32)
    ker = jnp.ones((3, 3, 2, 2), jnp.float32)
    dn = lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(0,),
                                    start_index_map=(0,))  # fmt: skip
    sdn = lax.ScatterDimensionNumbers(update_window_dims=(1,), inserted_window_dims=(0,),
                                      scatter_dims_to_operand_dims=(0,))  # fmt: skip
    idx = jnp.array([[0], [2]], jnp.int32)
    upd = jnp.ones((2, 4), jnp.float32)

    def body(c, x):
        return c + x, c * x

    def loop(k, c):
        return c + k

    return {
        "jax.lax.approx_max_k": [(f, 2)],
        "jax.lax.approx_min_k": [(f, 2)],
        "jax.lax.top_k": [(f, 2)],
        "jax.lax.reduce_precision": [(f, 5, 10)],
        "jax.lax.dynamic_slice": [(f, (i0, i0), (2, 2))],
        "jax.lax.dynamic_slice_in_dim": [(f, i0, 2, 1)],
        "jax.lax.dynamic_index_in_dim": [(f, i0, 0)],
        "jax.lax.dynamic_update_slice": [(f, jnp.ones((2, 2)), (i0, i0))],
        "jax.lax.dynamic_update_slice_in_dim": [(f, jnp.ones((4, 2)), i0, 1)],
        "jax.lax.dynamic_update_index_in_dim": [(f, jnp.ones((4,)), i0, 0)],
        "jax.lax.slice": [(f, (0, 1), (4, 3))],
        "jax.lax.slice_in_dim": [(f, 1, 3, 1, 1)],
        "jax.lax.index_in_dim": [(f, 1, 0)],
        "jax.lax.gather": [(f, idx, dn, (1, 4))],
        "jax.lax.scatter": [(f, idx, upd, sdn)],
        "jax.lax.scatter_add": [(f, idx, upd, sdn)],
        "jax.lax.scatter_sub": [(f, idx, upd, sdn)],
        "jax.lax.scatter_mul": [(f, idx, upd, sdn)],
        "jax.lax.scatter_min": [(f, idx, upd, sdn)],
        "jax.lax.scatter_max": [(f, idx, upd, sdn)],
        "jax.lax.scatter_apply": [(f, idx, jnp.exp, sdn, (1, 4))],
        "jax.lax.sort": [(f,), ((f, i), 0, 1)],
        "jax.lax.sort_key_val": [(f, i)],
        "jax.lax.cumsum": [(f, 1)],
        "jax.lax.cumprod": [(f, 1)],
        "jax.lax.cummax": [(f, 1)],
        "jax.lax.cummin": [(f, 1)],
        "jax.lax.cumlogsumexp": [(f, 1)],
        "jax.lax.argmax": [(f, 1, jnp.int32)],
        "jax.lax.argmin": [(f, 1, jnp.int32)],
        "jax.lax.reduce": [(f, 0.0, jax.lax.add, (1,))],
        "jax.lax.reduce_and": [(f > 0.5, (1,))],
        "jax.lax.reduce_or": [(f > 0.5, (1,))],
        "jax.lax.reduce_xor": [(f > 0.5, (1,))],
        "jax.lax.reduce_sum": [(f, (1,))],
        "jax.lax.reduce_max": [(f, (1,))],
        "jax.lax.reduce_min": [(f, (1,))],
        "jax.lax.reduce_prod": [(f, (1,))],
        "jax.lax.reduce_window": [(f, 0.0, jax.lax.add, (2, 2), (1, 1), "VALID")],
        "jax.lax.broadcast": [(f, (2,))],
        "jax.lax.broadcast_in_dim": [(f, (2, 4, 4), (1, 2))],
        "jax.lax.broadcast_to_rank": [(f, 3)],
        "jax.lax.reshape": [(f, (2, 8))],
        "jax.lax.transpose": [(f, (1, 0))],
        "jax.lax.rev": [(f, (0,))],
        "jax.lax.squeeze": [(f[None], (0,))],
        "jax.lax.expand_dims": [(f, (0,))],
        "jax.lax.pad": [(f, 0.0, ((1, 1, 0), (0, 0, 1)))],
        "jax.lax.concatenate": [((f, f, f), 0)],
        "jax.lax.split": [(f, (1, 3), 0)],
        "jax.lax.collapse": [(x3, 0, 2)],
        "jax.lax.iota": [(jnp.int32, 4)],
        "jax.lax.broadcasted_iota": [(jnp.int32, (4, 4), 1)],
        "jax.lax.full": [((4, 4), 1.0)],
        "jax.lax.full_like": [(f, 1.0)],
        "jax.lax.convert_element_type": [(f, jnp.bfloat16)],
        "jax.lax.bitcast_convert_type": [(f, jnp.int32), (f, jnp.int16)],
        "jax.lax.population_count": [(i,)],
        "jax.lax.clz": [(i,)],
        "jax.lax.shift_left": [(i, i)],
        "jax.lax.shift_right_logical": [(i, i)],
        "jax.lax.shift_right_arithmetic": [(i, i)],
        "jax.lax.integer_pow": [(f, 3)],
        "jax.lax.clamp": [(0.2, f, 0.7)],
        "jax.lax.select": [(f > 0.5, f, f)],
        "jax.lax.select_n": [(i % 2 == 0, f, f)],
        "jax.lax.dot": [(f, f)],
        "jax.lax.dot_general": [(f, f, (((1,), (0,)), ((), ())))],
        "jax.lax.batch_matmul": [(x3, x3)],
        "jax.lax.ragged_dot": [(g, w, sizes)],
        "jax.lax.ragged_dot_general": [
            (
                g,
                w,
                sizes,
                jax.lax.RaggedDotDimensionNumbers(
                    dot_dimension_numbers=(((1,), (1,)), ((), ())),
                    lhs_ragged_dimensions=(0,),
                    rhs_group_dimensions=(0,),
                ),
            )
        ],  # fmt: skip
        "jax.lax.conv": [(img.transpose(0, 3, 1, 2), ker.transpose(3, 2, 0, 1), (1, 1), "SAME")],
        "jax.lax.conv_general_dilated": [
            (img, ker, (1, 1), "SAME", None, None, ("NHWC", "HWIO", "NHWC"))
        ],
        "jax.lax.conv_with_general_padding": [
            (
                img.transpose(0, 3, 1, 2),
                ker.transpose(3, 2, 0, 1),
                (1, 1),
                ((1, 1), (1, 1)),
                None,
                None,
            )
        ],  # fmt: skip
        "jax.lax.conv_transpose": [(img, ker, (1, 1), "SAME", None, ("NHWC", "HWIO", "NHWC"))],
        "jax.lax.scan": [(body, jnp.zeros(4), f)],
        "jax.lax.fori_loop": [(0, 3, loop, f)],
        "jax.lax.while_loop": [(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 2), (0, f))],
        "jax.lax.cond": [(True, jnp.sin, jnp.cos, f)],
        "jax.lax.switch": [(i0, [jnp.sin, jnp.cos], f)],
        "jax.lax.map": [(jnp.sin, f)],
        "jax.lax.associative_scan": [(jnp.add, f)],
        "jax.lax.custom_root": [(lambda x: x - 0.5, f, lambda fn, x0: x0, lambda fn, y: y)],
        "jax.lax.custom_linear_solve": [(lambda x: 2.0 * x, f, lambda mv, b: b / 2.0)],
        "jax.lax.optimization_barrier": [((f, f),)],
        "jax.lax.platform_dependent": [
            (f,),
        ],
        "jax.lax.rng_bit_generator": [(jnp.zeros((4,), jnp.uint32), (4, 4))],
        "jax.lax.rng_uniform": [(0.0, 1.0, (4,))],
        "jax.lax.fft": [(f.astype(jnp.complex64), "FFT", (4,))],
        "jax.lax.tie_in": [(f, f)],
        "jax.lax.stop_gradient": [(f,)],
        "jax.lax.zeros_like_array": [(f,)],
        "jax.lax.polygamma": [(jnp.ones_like(f), f)],
        "jax.lax.igamma": [(f, f)],
        "jax.lax.random_gamma_grad": [(f, f)],
        "jax.lax.betainc": [(f, f, f)],
    }


def _other_examples() -> dict[str, list]:
    """Examples for the rest: argument tuples, or thunks for keyword-only parameters and
    functions that need a static ``size=`` under tracing."""
    f = jnp.linspace(0.1, 0.9, 16, dtype=jnp.float32).reshape(4, 4)
    v = f[0]
    spd = f @ f.T + 4 * jnp.eye(4)
    i = jnp.arange(16, dtype=jnp.int32).reshape(4, 4) % 4
    q = jnp.ones((2, 4, 2, 8), jnp.float32)
    v3 = jnp.ones((4, 3), jnp.float32)
    key = jax.random.key(0)
    img = jnp.ones((1, 2, 4, 4), jnp.float32)
    sdn = jax.lax.ScatterDimensionNumbers(update_window_dims=(1,), inserted_window_dims=(0,),
                                          scatter_dims_to_operand_dims=(0,))  # fmt: skip
    idx = jnp.array([[0], [2]], jnp.int32)
    sized = {n: [lambda n=n: getattr(jnp, n)(f.ravel(), size=4)] for n in (
        "nonzero", "argwhere", "flatnonzero", "unique", "unique_all", "unique_counts",
        "unique_inverse", "unique_values")}  # fmt: skip
    sets = {n: [lambda n=n: getattr(jnp, n)(v, v[::-1], size=4)] for n in (
        "union1d", "setdiff1d", "setxor1d", "intersect1d")}  # fmt: skip
    return {
        **{f"jax.numpy.{n}": ex for n, ex in {**sized, **sets}.items()},
        "jax.numpy.convolve": [(v, v)],
        "jax.numpy.correlate": [(v, v)],
        "jax.numpy.cross": [(v3, v3)],
        "jax.numpy.linalg.cross": [(v3, v3)],
        "jax.numpy.linalg.outer": [(v, v)],
        "jax.numpy.linalg.multi_dot": [([f, f, f],)],
        "jax.numpy.reshape": [(f, (2, 8))],
        "jax.numpy.bincount": [lambda: jnp.bincount(i.ravel(), length=5)],
        "jax.numpy.extract": [lambda: jnp.extract(f > 0.5, f, size=4)],
        "jax.numpy.compress": [(v > 0.5, v)],
        "jax.numpy.choose": [(i % 2, [f, f])],
        "jax.numpy.apply_along_axis": [(jnp.sum, 1, f)],
        "jax.numpy.apply_over_axes": [(jnp.sum, f, (0,))],
        "jax.numpy.dsplit": [(jnp.ones((2, 2, 4)), 2)],
        "jax.numpy.polymul": [(v, v)],
        "jax.numpy.polydiv": [(v, v)],
        "jax.numpy.polyfit": [(v, v, 1)],
        "jax.numpy.ravel_multi_index": [((i[0], i[1]), (4, 4))],
        "jax.numpy.fill_diagonal": [lambda: jnp.fill_diagonal(f, 0.0, inplace=False)],
        "jax.numpy.put": [lambda: jnp.put(f, i[0], v, inplace=False)],
        "jax.numpy.place": [lambda: jnp.place(f, f > 0.5, v, inplace=False)],
        "jax.numpy.unpackbits": [(i.astype(jnp.uint8),)],
        "jax.lax.composite": [lambda: jax.lax.composite(lambda x: x * 2, name="t.double")(f)],
        "jax.lax.platform_dependent": [
            lambda: jax.lax.platform_dependent(f, cpu=jnp.sin, default=jnp.cos)
        ],
        "jax.lax.conv_general_dilated_patches": [(img, (2, 2), (1, 1), "VALID")],
        "jax.lax.index_take": [(f, (i[0],), (0,))],
        "jax.lax.scatter_apply": [
            lambda: jax.lax.scatter_apply(f, idx, jnp.exp, sdn, update_shape=(2, 4))
        ],
        "jax.random.randint": [(key, (4,), 0, 5)],
        "jax.random.triangular": [(key, 0.0, 0.5, 1.0, (4,))],
        "jax.random.key": [(0,)],
        "jax.random.PRNGKey": [(0,)],
        "jax.scipy.special.bessel_jn": [lambda: jax.scipy.special.bessel_jn(f, v=2)],
        "jax.numpy.stack": [((f, f), 1)],
        "jax.numpy.unstack": [(f,)],
        "jax.numpy.tile": [(f, (2, 3))],
        "jax.numpy.take": [(f, i[0], 0)],
        "jax.numpy.take_along_axis": [(f, i, 1)],
        "jax.numpy.put_along_axis": [(f, i, f, 1, False)],
        "jax.numpy.argsort": [(f,)],
        "jax.numpy.argpartition": [(f, 2)],
        "jax.numpy.partition": [(f, 2)],
        "jax.numpy.einsum": [("ij,jk->ik", f, f)],
        "jax.numpy.nonzero": [],
        "jax.numpy.linalg.cholesky": [(spd,)],
        "jax.numpy.linalg.eigh": [(spd,)],
        "jax.numpy.linalg.inv": [(spd,)],
        "jax.numpy.linalg.solve": [(spd, f)],
        "jax.numpy.linalg.det": [(spd,)],
        "jax.numpy.linalg.slogdet": [(spd,)],
        "jax.numpy.linalg.matrix_power": [(spd, 3)],
        "jax.nn.dot_product_attention": [(q, q, q)],
        "jax.nn.one_hot": [(i, 4)],
        "jax.scipy.special.logsumexp": [(f,)],
    }


def main() -> int:
    """Prints the walk's counts and each primitive with a public function reaching it."""
    from jscaler.ir.refusals import classify

    walk = walk_public_surface()
    defined = defined_primitives()
    names = sorted(set(walk.primitives) | set(defined))
    table = {n: classify(n) for n in names}
    ruled = [n for n in names if table[n].kind != "refused"]
    refused = [n for n in names if table[n].kind == "refused"]
    print(f"public callables walked: {len(walk.walked)} (no example fitted: {len(walk.failed)})")
    print(f"primitives reached by them: {len(walk.primitives)}; defined by jax: {len(defined)}")
    print(f"covered (a rule, inlined or composite): {len(ruled)}; refused: {len(refused)}")
    for n in refused:
        mark = "reached " if n in walk.primitives else "        "
        print(f"  refused {mark}{n}: {table[n].reason}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
