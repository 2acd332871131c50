"""Primitives jscaler refuses, each with the reason and what to do instead.

Every primitive JAX defines is either planned (a dim rule in ``rules_*.py``, a call
inlined, or a composite whose annotation comes from its body: :mod:`jscaler.ir.control`)
or listed here. :func:`classify` says which; ``tests/test_primitive_coverage.py`` holds
every primitive JAX defines and every one its public functions reach to that, so a new
JAX primitive fails that test by name. A user meets a refusal as an
:class:`~jscaler.errors.UnsupportedOpError` naming the op and its module path.
"""

from __future__ import annotations

from dataclasses import dataclass

from jscaler.ir.control import COMPOSITES, INLINE
from jscaler.ir.registry import rule_for

__all__ = ["REFUSED", "Refusal", "Support", "classify"]


@dataclass(frozen=True)
class Refusal:
    """Why a primitive cannot be planned, and the fix."""

    reason: str
    fix: str


_COLLECTIVE = Refusal(
    "a collective over named mesh axes only exists inside shard_map or pmap, which run "
    "per-device code; jscaler plans the whole step and inserts its own collectives",
    "write the loss without shard_map/pmap/collectives: the plan chooses the split and the "
    "collectives (a manual region: jscaler.Region)",
)
_STATE = Refusal(
    "mutable array references (jax.new_ref, Pallas/state refs) are effects jscaler cannot "
    "split or reorder",
    "compute with values (x = x.at[i].set(v)) instead of refs inside the loss",
)
_INTERNAL = Refusal(
    "an internal primitive of JAX's transformations (autodiff, batching, staging) that "
    "does not appear in a traced forward loss",
    "report the model that produced it: jscaler should learn it",
)
_SHAPE_POLY = Refusal(
    "shape-polymorphic export: jscaler plans for concrete shapes",
    "call the original function with concrete shapes instead of a jax.export artifact",
)
_CUDNN = Refusal(
    "a cuDNN/GPU-only kernel whose inside jscaler cannot see",
    "use the XLA implementation (jax.nn.dot_product_attention(..., implementation='xla'), "
    "plain matmuls) or declare its dims with jscaler.register_op",
)
_KERNEL = Refusal(
    "a Pallas kernel-language primitive, which only exists inside a pallas_call body",
    "it cannot appear in a loss outside a kernel; declare the kernel's dims with "
    "jscaler.register_op('pallas_call', fn)",
)
_EFFECT = Refusal(
    "an ordered side effect (token, IO callback) that must run once, in order; a split "
    "plan runs ops on many devices and reorders them",
    "move side effects out of the loss (log values it returns) or use jax.debug.print, "
    "which jscaler keeps",
)

REFUSED: dict[str, Refusal] = {
    **dict.fromkeys(
        "psum pmax pmin ppermute all_gather all_to_all axis_index reduce_scatter pbroadcast "
        "psum_invariant all_gather_invariant all_gather_reduced unreduced_psum unreduced_pmax "
        "unreduced_pmin unreduced_reduce_scatter ragged_all_to_all psend precv preduced "
        "pbroadcast_dynamic pvary vary_unreduced_cast reduced_vary_cast all_gather_start "
        "all_gather_done all_gather_reduced_start all_to_all_start all_to_all_done "
        "ppermute_start ppermute_done psum_done psum_invariant_start reduce_scatter_start "
        "reduce_scatter_done pmax_scatter pmin_scatter pxor".split(),
        _COLLECTIVE,
    ),
    **dict.fromkeys(
        "get swap addupdate run_state new_ref empty_ref free_ref freeze broadcast_to pin "
        "unpin create_linear accum_grad_in_ref with_memory_space_constraint stage".split(),
        _STATE,
    ),
    **dict.fromkeys(
        "custom_lin custom_jvp_call_jaxpr remat_opt unreachable call_hi_primitive_linearized "
        "eval_jaxpr dce_sink".split(),
        _INTERNAL,
    ),
    **dict.fromkeys("shape_assertion dim_as_value dimension_size".split(), _SHAPE_POLY),
    **dict.fromkeys(
        "cudnn_fusion scaled_matmul scaled_matmul_wrapper dot_product_attention_fwd "
        "dot_product_attention_bwd dot_product_attention_fwd_wrapper "
        "dot_product_attention_bwd_wrapper dot_product_attention_fp8_fwd "
        "dot_product_attention_fp8_bwd dot_product_attention_fp8_fwd_wrapper "
        "dot_product_attention_fp8_bwd_wrapper".split(),
        _CUDNN,
    ),
    **dict.fromkeys("io_callback create_token after_all".split(), _EFFECT),
    **dict.fromkeys(
        "delay get_global masked_load masked_swap mpmd_map multiple_of num_programs "
        "program_id reciprocal run_scoped semaphore_read semaphore_signal "
        "semaphore_wait".split(),
        _KERNEL,
    ),
    "call_exported": Refusal(
        "a jax.export artifact is compiled StableHLO, opaque to jscaler",
        "call the original Python function in the loss",
    ),
    "ffi_call": Refusal(
        "a foreign-function (FFI) kernel is opaque to jscaler",
        "declare which dims of its operands may be split with jscaler.register_op('ffi_call', "
        "fn) (fn sees the eqn; eqn.params['target_name'] tells kernels apart), or call a "
        "plain-JAX reference implementation",
    ),
    "custom_partitioning": Refusal(
        "custom_partitioning supplies its own GSPMD sharding rule, which jscaler's plan "
        "replaces; its partitioned body cannot be re-planned",
        "call the function's plain-JAX body in the loss (jscaler plans its layout)",
    ),
    "check": Refusal(
        "checkify's checks are effects that need checkify.checkify around the whole step",
        "check values outside the loss, or return them as outputs",
    ),
    "debug_callback": Refusal(
        "a host callback with effects inside the loss",
        "use jax.debug.print (kept) or move the callback out of the loss",
    ),
    "inspect_sharding": Refusal(
        "jax.debug.inspect_array_sharding shows GSPMD's sharding, which the plan replaces",
        "remove it and read the plan's layouts with jscaler.report.explain(plan) or "
        "jscaler inspect",
    ),
    "global_array_to_host_local_array": Refusal(
        "multihost_utils conversions move data between processes outside the step",
        "convert the batch before calling the step (Trainer.global_batch does it)",
    ),
    "host_local_array_to_global_array": Refusal(
        "multihost_utils conversions move data between processes outside the step",
        "convert the batch before calling the step (Trainer.global_batch does it)",
    ),
    "shard_map": Refusal(
        "a shard_map is per-device code on a mesh of its own: jscaler plans the whole step "
        "and cannot re-plan inside it",
        "write the computation without shard_map (the plan chooses the split and the collectives)",
    ),
    "pallas_call": Refusal(
        "a Pallas kernel is opaque to jscaler",
        "declare which dims of its inputs and outputs may be split (the kernel must be "
        "correct on any slice of them) with jscaler.register_op('pallas_call', fn) (fn sees "
        "the eqn, eqn.params['name'] tells kernels apart), or call its plain-JAX reference",
    ),
}


@dataclass(frozen=True)
class Support:
    """How jscaler handles one primitive: ``kind`` is ``rule`` (a dim rule), ``inlined``
    (a nested jit whose body is traced through), ``composite`` (annotated from its body),
    ``refused`` (``reason``/``fix`` say why) or ``unknown``."""

    kind: str
    reason: str = ""
    fix: str = ""


def classify(name: str) -> Support:
    """How jscaler handles the primitive called ``name``."""
    if name in INLINE:
        return Support("inlined")
    if name in COMPOSITES:
        return Support("composite")
    if rule_for(name) is not None:
        return Support("rule")
    if name in REFUSED:
        return Support("refused", REFUSED[name].reason, REFUSED[name].fix)
    return Support("unknown")
