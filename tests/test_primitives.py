"""Plans written by hand with the three primitives, and broken plans with clear errors."""

import jax
import pytest
from jax.sharding import PartitionSpec as P

import jscaler
import models
from jscaler import (
    MeshSpec,
    Plan,
    SubOp,
    decouple,
    op_assign,
    op_order,
    op_trans,
    recompute,
    replicate,
    split,
)
from jscaler.plan import assign_mesh, split_classes, split_ops
from jscaler.report import explain

from parity import assert_parity, leaves


def traced(name, microbatch=None):
    spec = models.get(name)
    return jscaler.trace(spec.loss, spec.init(0), spec.batch(microbatch or spec.batch_size, 0))


def batch_axis(graph):
    return next((t, 0) for t in graph.inputs if graph.tensors[t].role == "batch")


def by_piece(plan, subs):
    """Assign piece i of every split to device i."""
    for s in subs:
        plan = op_assign(plan, s, s.path[-1])
    return plan


def hand_dp(graph, n=8):
    plan = Plan.create(graph, MeshSpec.create(dp=n), name="hand dp")
    plan, subs = op_trans(plan, graph, split(batch_axis(graph)), n)
    return by_piece(plan, subs)


@pytest.mark.parametrize("model", ["mlp-tiny", "convnet-tiny"])
def test_hand_written_data_parallel(model):
    plan = jscaler.validate(hand_dp(traced(model)))
    trainer = assert_parity(model, plan)
    assert all(s.spec == P() for s in leaves(trainer.shardings()))


def test_hand_written_megatron_mlp_and_attention():
    """Column/row TP of block 0's attention and MLP by hand; everything else replicated."""
    g = traced("gpt-tiny")
    plan = Plan.create(g, MeshSpec.create(tp=8), name="hand tp")
    params = {t.name: t.id for t in g.params()}
    done = set()
    for region, weight in (("blocks/0/attn", "q_proj"), ("blocks/0/mlp", "gate_proj")):
        sub = g.select(region)
        seed = (params[f"{region}/{weight}/kernel"], 1)  # the column weight's output axis
        plan, subs = op_trans(plan, sub, split(seed), 8)
        plan = by_piece(plan, subs)
        done |= {o.id for o in sub.ops}
    rest = g.subgraph([o for o in g.ops if o.id not in done])
    plan, subs = op_trans(plan, rest, replicate(), 8)
    plan = by_piece(plan, subs)
    trainer = assert_parity("gpt-tiny", jscaler.validate(plan))
    s = dict(zip(params, (x.spec for x in leaves(trainer.shardings()))))
    assert s["blocks/0/attn/q_proj/kernel"] == P(None, "tp")
    assert s["blocks/0/attn/o_proj/kernel"] == P("tp")
    assert s["blocks/0/mlp/down_proj/kernel"] == P("tp")
    assert s["blocks/1/attn/q_proj/kernel"] == P()


def test_hand_written_zero3_by_decoupling_params():
    g = traced("mlp-tiny")
    plan = Plan.create(g, MeshSpec.create(dp=8))
    for p in g.params():
        axis = max(range(len(p.shape)), key=lambda a: p.shape[a])
        if p.shape[axis] % 8:
            continue
        plan, (ident,) = op_trans(plan, p.id, decouple())
        plan, subs = op_trans(plan, ident, split("abcd"[axis]), 8)
        plan = by_piece(plan, subs)
    identities = set(plan.pgraph.identity_of.values())
    rest = plan.pgraph.graph.subgraph([o for o in plan.pgraph.graph.ops if o.id not in identities])
    plan, subs = op_trans(plan, rest, split(batch_axis(g)), 8)
    plan = by_piece(plan, subs)
    trainer = assert_parity("mlp-tiny", jscaler.validate(plan))
    specs = [s.spec for s in leaves(trainer.shardings())]
    assert specs.count(P()) == 0 and P("dp") in specs  # every param stored split


def test_recompute_of_a_subgraph_keeps_parity_and_remats():
    g = traced("gpt-tiny")
    plan = hand_dp(g)
    plan, _ = op_trans(plan, g.select("blocks/1"), recompute())
    plan = jscaler.validate(plan)
    assert plan.is_recomputed(g.select("blocks/1/mlp").ops[0].id)
    trainer = assert_parity("gpt-tiny", plan)
    low = trainer.program.low
    spec = models.get("gpt-tiny")
    leaves_ = [*trainer.state.params, *trainer.state.model_state]
    batch = jax.tree_util.tree_leaves(spec.batch(8, 0))
    grad_jaxpr = jax.make_jaxpr(jax.grad(lambda *a: low.forward(*a)[0]))(*leaves_, *batch)
    assert "remat" in str(grad_jaxpr) or "checkpoint" in str(grad_jaxpr)


def test_plan_json_round_trip_and_hash():
    g = traced("mlp-tiny")
    plan = hand_dp(g)
    plan, (a, b) = op_trans(plan, SubOp(g.ops[0].id, (0,)), split("a"), 2)
    plan = op_assign(op_assign(plan, a, 0), b, 1)
    plan, _ = op_trans(plan, g.subgraph(g.ops[:3]), recompute())
    plan, (ident,) = op_trans(plan, g.params()[0].id, decouple())
    plan, subs = op_trans(plan, ident, replicate(), 8)
    plan = by_piece(plan, subs)
    plan = op_order(plan, SubOp(g.ops[1].id, (2,)), SubOp(g.ops[1].id, (3,)))
    again = Plan.from_json(plan.to_json(), g)
    assert again == plan and hash(again) == hash(plan)
    assert again.to_json() == plan.to_json()
    assert plan != hand_dp(g)
    assert "hand dp" in explain(plan) and "replicate x8" in explain(plan)


def test_a_plan_for_another_graph_names_the_differing_param():
    plan = hand_dp(traced("mlp-tiny"))
    other = traced("mlp-tiny", microbatch=8)  # same params, another batch shape
    with pytest.raises(jscaler.PlanError, match="different graph"):
        Plan.from_json(plan.to_json(), other)
    from models import mlp

    spec = models.get("mlp-tiny")
    narrower = mlp.init(mlp.MLPConfig(hidden=(32, 64)), 0)  # a working model, other shapes
    with pytest.raises(
        jscaler.PlanError,
        match=r"param 'layers/0/b' has shape \[64\] in the plan and "
        r"\[32\] in the model",
    ):
        jscaler.parallelize(
            narrower, spec.loss, __import__("optax").sgd(0.1), spec.batch(16, 0), plan=plan
        )


# ---- broken plans ------------------------------------------------------------------------


def test_cycle_through_op_order_names_module_paths():
    g = traced("gpt-tiny")
    plan = hand_dp(g)
    q = g.select("blocks/0/attn/q_proj").ops[0]
    down = g.select("blocks/0/mlp/down_proj").ops[0]
    plan = op_order(plan, SubOp(down.id, (0,)), SubOp(q.id, (0,)))  # down needs q first
    with pytest.raises(jscaler.CycleError) as e:
        jscaler.validate(plan)
    msg = str(e.value)
    assert "blocks/0/mlp/down_proj" in msg and "blocks/0/attn/q_proj" in msg
    assert "op_order" in msg


def test_missing_piece_is_a_coverage_error():
    g = traced("mlp-tiny")
    plan = Plan.create(g, MeshSpec.create(dp=2))
    plan, subs = op_trans(plan, g, split(batch_axis(g)), 2)
    for s in subs:
        if not (s.op == g.ops[0].id and s.path == (1,)):
            plan = op_assign(plan, s, s.path[-1])
    with pytest.raises(jscaler.CoverageError, match=r"produced on no device.*op_assign"):
        jscaler.validate(plan)


def test_split_that_does_not_divide_names_op_dim_and_size():
    g = traced("gpt-tiny")
    plan = Plan.create(g, MeshSpec.create(tp=8))
    q = g.select("blocks/0/attn/q_proj").ops[0]
    with pytest.raises(jscaler.SplitError) as e:
        op_trans(plan, q, split("a"), 3)
    msg = str(e.value)
    assert "blocks/0/attn/q_proj" in msg and "'a' has size 8" in msg and "pad" in msg
    softmax_max = next(o for o in g.select("blocks/0/attn").ops if o.primitive == "reduce_max")
    assert str(softmax_max.annotation) == "a b c d^ -> a b c"
    with pytest.raises(jscaler.SplitError, match="'d' is marked '\\^'"):
        op_trans(plan, softmax_max, split("d"), 2)


def test_unknown_device_and_wrong_device_count():
    g = traced("mlp-tiny")
    plan = Plan.create(g, MeshSpec.create(dp=8))
    with pytest.raises(jscaler.AssignmentError, match="device 8 .* does not exist"):
        op_assign(plan, g.ops[0].id, 8)
    spec = models.get("mlp-tiny")
    with pytest.raises(jscaler.AssignmentError, match="needs 8 devices .* but 4 were given"):
        jscaler.parallelize(
            spec.init(0),
            spec.loss,
            __import__("optax").sgd(0.1),
            spec.batch(16, 0),
            devices=4,
            plan=hand_dp(g),
        )


def test_partial_sums_reduce_as_the_plan_says():
    """A row-split matmul's partial sums: all-reduced when the consumer wants the whole
    tensor, reduce-scattered when the consumer is split along another axis."""
    spec = models.get("mlp-tiny")
    g = traced("mlp-tiny")
    params = {t.name: t.id for t in g.params()}
    row = next(o for o in g.ops if params["layers/1/w"] in o.tensor_inputs)
    first, after = g.ops[: g.ops.index(row) + 1], g.ops[g.ops.index(row) + 1 :]
    texts = {}
    for consumer in ("whole", "split"):
        plan = Plan.create(g, MeshSpec.create(tp=4))
        plan = split_classes(plan, [(params["layers/0/w"], 1)], 4, ops=first)
        seeds = [batch_axis(g)] if consumer == "split" else []
        plan = split_classes(plan, seeds, 4, ops=after)
        plan = assign_mesh(plan, ["tp"])
        trainer = assert_parity("mlp-tiny", jscaler.validate(plan), devices=4)
        texts[consumer] = trainer.hlo(spec.batch(16, 0))
    assert "reduce-scatter" in texts["split"]
    assert "reduce-scatter" not in texts["whole"] and "all-reduce" in texts["whole"]


def test_megatron_names_the_op_it_cannot_split():
    import jax.numpy as jnp
    import optax

    from spaces import megatron

    params = {"w0": jnp.ones((32, 12)), "w1": jnp.ones((12, 4))}

    def loss(p, b):
        return jnp.mean(jnp.tanh(b @ p["w0"]) @ p["w1"])

    with pytest.raises(jscaler.PlanError, match=r"cannot split .*'w0' has 12 features"):
        jscaler.parallelize(
            params, loss, optax.sgd(0.1), jnp.ones((8, 32)), devices=8, plan=megatron(tp=8, dp=1)
        )


def test_bulk_helpers_equal_the_primitives_one_op_at_a_time():
    g = traced("gpt-tiny")
    plan = Plan.create(g, MeshSpec.create(dp=2, tp=4))
    classes = jscaler.DimClasses(g)
    seed = batch_axis(g)
    one = plan
    for op in g.ops:  # the primitives, op by op
        dim = classes.dim_of(op, classes.of(*seed))
        for sub in one.sub_ops(op.id):
            one, _ = op_trans(one, sub, split(dim) if dim else replicate(), 2)
    bulk = split_classes(plan, [seed], 2, classes=classes)
    assert bulk == one
    dims = {op.id: classes.dim_of(op, classes.of(*seed)) for op in g.ops}
    assert split_ops(plan, dims, 2) == one
    # a dim that does not split n ways falls back to the next candidate, then replicates
    head, n, small, fine = next(
        (o, n, a, b)
        for o in g.ops
        if o.annotation
        for n in (3, 4, 5, 6, 8)
        for a in o.annotation.splittable()
        for b in o.annotation.splittable()
        if o.annotation.sizes[a] % n and o.annotation.sizes[b] % n == 0
        and o.annotation.kinds[b] == ""
    )  # fmt: skip
    leaf = split_ops(plan, {head.id: [small, fine]}, n).tree(head.id)
    assert (leaf.algo, leaf.dim) == ("split", fine)
    assert split_ops(plan, {head.id: [small]}, n).tree(head.id).algo == "replicate"
    with pytest.raises(jscaler.PlanError, match="no op 999999"):
        split_ops(plan, {999999: None}, 2)
    placed = assign_mesh(split_ops(one, {o.id: None for o in g.ops}, 4), ["dp", "tp"])
    for op in g.ops:
        for sub in one.sub_ops(op.id):
            for k in range(4):
                dev = plan.mesh.device_at({"dp": sub.path[0], "tp": k})
                assert placed.tree(op.id).at(sub.path + (k,)).device == dev
    # decouple many tensors at once: one identity each, as one at a time
    params = [p.id for p in g.params()][:3]
    many, subs = op_trans(plan, params, decouple())
    single = plan
    for p in params:
        single, _ = op_trans(single, p, decouple())
    assert many == single and [s.op for s in subs] == [many.pgraph.identity_of[p] for p in params]
    with pytest.raises(jscaler.PlanError, match="already decoupled"):
        op_trans(plan, [params[0], params[0]], decouple())
