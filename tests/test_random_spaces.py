"""Every registered space (``spaces.SPACES``) with random knobs, on random device counts
and micro-batch counts: each trains equal to one device or raises a JscalerError, never
another exception. Knobs are drawn by name from the space's signature (a new space is
tested by being registered), sometimes with values no space accepts (0, 3, -1, 16, 1.5,
a wrong type), which must be JscalerErrors too.

New knobs every run (the seed is in pytest's header; see randomised.py). Plans per run:
``JSCALER_RANDOM_SPACE_EXAMPLES`` (default 150) on mlp-tiny and
``JSCALER_RANDOM_GPT_SPACE_EXAMPLES`` (default 24) on gpt-tiny.
"""

import functools
import inspect

import jax
import optax
import pytest
from hypothesis import given
from hypothesis import strategies as st
from randomised import Watch, examples, expect_error_or_parity, no_cache_writes, randomised, timed

import jscaler
import models
from jscaler.runtime.reference import reference_steps
from schedules import SCHEDULES
from spaces import SPACES

EXAMPLES = {
    "mlp-tiny": examples("JSCALER_RANDOM_SPACE_EXAMPLES", 150),
    "gpt-tiny": examples("JSCALER_RANDOM_GPT_SPACE_EXAMPLES", 24),
}
BAD_INTS = [0, 3, -1, 16, True, 2.0, "2"]
FRACTIONS = st.sampled_from([0, 0, 0.5, 1])
# knobs by parameter name: (strategy of good values given the device count, bad values);
# the others are drawn by their default's type (see knob())
KNOBS = {
    "stage": (lambda n: st.sampled_from([1, 2, 3]), [0, 4, "3"]),
    "zero": (lambda n: st.sampled_from([0, 0, 1, 2, 3]), [4, -1]),
    "pp": (lambda n: st.sampled_from([1, 1, 2, 2, 4]), BAD_INTS),
    "dp": (lambda n: st.none(), [1, 2, 4, 8, *BAD_INTS]),  # given, it must fit the rest
    "recompute": (lambda n: FRACTIONS, [1.5, -0.5, "all"]),
    "precision": (lambda n: st.just("fp32"), ["fp8", None]),
    "layers": (lambda n: st.sampled_from([None, 1, 2]), [0, -1]),
    "slicing": (lambda n: st.sampled_from(["even", "dp"]), ["uneven"]),
    "microbatches": (lambda n: st.sampled_from([1, 2, 4]), [0]),
    "time_limit": (lambda n: st.just(5.0), []),  # alpa_like's ILP: bounded
}


def knob_values(param: inspect.Parameter, n: int):
    """``(good, wrong)`` for one keyword of a space on ``n`` devices: a strategy of good
    values and a list of values that may be invalid, by name (KNOBS), else by the
    default's type."""
    default = param.default
    if param.name in KNOBS:
        good, wrong = KNOBS[param.name]
        return good(n), wrong
    if isinstance(default, bool):
        return st.booleans(), [None, "yes"]
    if isinstance(default, int):
        return st.sampled_from([d for d in (1, 2, 4, 8) if n % d == 0]), BAD_INTS
    if isinstance(default, float):
        return FRACTIONS, [-1.0]
    return st.just(default), []  # a string or a structured knob (alpa_like's mesh)


def knob(param: inspect.Parameter, n: int, bad: bool):
    """The strategy of one keyword of a space for ``n`` devices; with ``bad``, values no
    space accepts as well."""
    good, wrong = knob_values(param, n)
    return st.one_of(good, st.sampled_from(wrong)) if bad and wrong else good


@st.composite
def random_space(draw, n: int, bad: bool):
    """``(expression, space)``: a registered space with some of its knobs drawn for
    ``n`` devices (the rest at their defaults); ``bad``: some may be invalid."""
    name = draw(st.sampled_from(sorted(SPACES)), label="space")
    make = SPACES[name]
    kw = {}
    for p in inspect.signature(make).parameters.values():
        if draw(st.booleans(), label=f"set {p.name}"):
            kw[p.name] = draw(knob(p, n, bad), label=p.name)
    expr = f"{name}({', '.join(f'{k}={v!r}' for k, v in kw.items())})"
    return expr, make(**kw)


@functools.cache
def setup(name):
    spec = models.get(name)
    params = spec.init(0)
    batch = spec.batch(spec.batch_size, 0)
    ref = reference_steps(params, spec.loss, optax.sgd(0.1), [batch])
    return spec, batch, ref


@pytest.fixture(scope="module", autouse=True)
def programs_not_written_to_the_compilation_cache():
    yield from no_cache_writes()


@pytest.fixture
def clock(request):
    yield from timed(request)


def check_random_space(name, clock, data):
    with Watch(clock) as watch:
        watch.what = f"a random space on {name}"

        def build():
            bad = data.draw(st.integers(0, 3), label="bad knobs?") == 1  # 1 in 4
            n = data.draw(st.sampled_from([1, 2, 4, 8, 8]), label="devices")
            expr, space = data.draw(random_space(n, bad), label="space")
            m = data.draw(st.sampled_from([1, 2, 4, 3] if bad else [1, 2, 4]), label="microbatches")
            schedules = [None] * 4 + (sorted(SCHEDULES) if bad else [])
            schedule = data.draw(st.sampled_from(schedules), label="schedule")
            watch.what = f"{expr} on {n} devices, {m} micro-batches, schedule={schedule}, {name}"
            watch.plan, watch.label = expr, f"{expr.split('(')[0]}: "
            spec, batch, _ = setup(name)
            trainer = jscaler.parallelize(
                spec.init(0), spec.loss, optax.sgd(0.1), batch, devices=n, plan=space,
                microbatches=m, schedule=SCHEDULES.get(schedule),
            )  # fmt: skip
            watch.plan = trainer.plan
            return trainer

        spec, batch, ref = setup(name)
        expect_error_or_parity(watch, build, [batch], ref)
    if len(jax.live_arrays()) > 10_000:
        jax.clear_caches()


@randomised(EXAMPLES["mlp-tiny"])
@given(data=st.data())
def test_random_spaces_on_mlp_tiny(clock, data):
    check_random_space("mlp-tiny", clock, data)


@randomised(EXAMPLES["gpt-tiny"])
@given(data=st.data())
def test_random_spaces_on_gpt_tiny(clock, data):
    check_random_space("gpt-tiny", clock, data)


@pytest.mark.parametrize("name", sorted(SPACES))
def test_every_bad_knob_is_refused_by_name(name):
    """Each registered space, one knob at a time at each value the random test may draw
    as bad, on 1, 2 and 8 devices: the space builds a plan or raises a JscalerError that
    says what is wrong, never a TypeError from deep inside (an interlaced(pp='2') did)."""
    spec = models.get("mlp-tiny")
    graph = jscaler.trace(spec.loss, spec.init(0), spec.batch(spec.batch_size, 0))
    refused = 0
    for param in inspect.signature(SPACES[name]).parameters.values():
        for value in knob_values(param, 8)[1]:
            for n in (1, 2, 8):
                try:
                    SPACES[name](**{param.name: value})(graph, n)
                except jscaler.JscalerError as e:
                    assert str(e), f"{name}({param.name}={value!r}) on {n}: an empty message"
                    refused += 1
                except Exception as e:
                    raise AssertionError(
                        f"{name}({param.name}={value!r}) on {n} devices raised "
                        f"{type(e).__name__}, not a JscalerError: {e}"
                    ) from e
    assert refused > 0, f"{name}: no bad value was refused"
