"""Reading collectives from compiled HLO text."""

from jscaler.compile.hlo import collectives, summarize

HLO = """
HloModule jit_step
ENTRY %main {
  %p0 = f32[8,64]{1,0} parameter(0)
  %all-gather.1 = f32[64,64]{1,0} all-gather(%p0), channel_id=1, replica_groups=mesh['dp'=8] {'dp'}, dimensions={0}, metadata={op_name="jit(step)/jvp(blocks/0/attn/q_proj)/x"}
  %all-reduce.2 = f32[64,64]{1,0} all-reduce(%p0), channel_id=2, replica_groups=mesh['dp'=2,'tp'=4] {'tp'}, to_apply=%add
  %all-reduce.3 = (f32[64,64]{1,0}, bf16[16]{0}) all-reduce(%a, %b), channel_id=3, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %gte.0 = f32[64,64]{1,0} get-tuple-element(%all-reduce.3), index=0
  %gte.1 = bf16[16]{0} get-tuple-element(%all-reduce.3), index=1
  %dynamic-slice.4 = f32[8,64]{1,0} dynamic-slice(%gte.0, %i, %j), dynamic_slice_sizes={8,64}
  %use = bf16[16]{0} negate(%gte.1)
  %reduce-scatter.5 = f32[2,64]{1,0} reduce-scatter(%p0), channel_id=4, replica_groups=mesh['tp'=4] {'tp'}, dimensions={0}
}
"""  # noqa: E501


def test_kinds_bytes_axes_and_module_paths():
    cs = collectives(HLO)
    got = [(c.kind, c.bytes, c.axes, c.group) for c in cs]
    assert got == [
        ("all-gather", 64 * 64 * 4, ("dp",), 8),
        ("all-reduce", 64 * 64 * 4, ("tp",), 4),
        ("reduce-scatter", 64 * 64 * 4, (), 8),  # all-reduce read only through a 1/8 slice
        ("all-reduce", 16 * 2, (), 8),  # the other tuple element is read whole
        ("reduce-scatter", 2 * 64 * 4 * 4, ("tp",), 4),
    ]
    assert cs[0].op_name.endswith("blocks/0/attn/q_proj)/x")
    assert summarize(cs)["reduce-scatter"] == (2, 64 * 64 * 4 + 2 * 64 * 16)


FOLDED = """
HloModule jit_step
ENTRY %main {
  %a = f32[64,64]{1,0} parameter(0)
  %b = f32[16]{0} parameter(1)
  %all-reduce.1 = (f32[64,64]{1,0}, f32[16]{0}) all-reduce(%a, %b), channel_id=1, replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, to_apply=%add
  %gte.0 = f32[64,64]{1,0} get-tuple-element(%all-reduce.1), index=0
  %gte.1 = f32[16]{0} get-tuple-element(%all-reduce.1), index=1
  %all-reduce.2 = f32[64,64]{1,0} all-reduce(%gte.0), channel_id=2, replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}, to_apply=%add
  %use = f32[16]{0} negate(%gte.1)
  %all-reduce.3 = f32[16]{0} all-reduce(%use), channel_id=3, replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}, to_apply=%add
}
"""  # noqa: E501


def test_an_all_reduce_of_an_all_reduce_over_other_axes_is_one_over_both():
    """As the GPU compiler folds them (the CPU one does not): a contraction split over dp
    and sp is reduced once over dp x sp; an all-reduce read by anything else stays."""
    got = [(c.kind, c.bytes, c.axes, c.group) for c in collectives(FOLDED, (("dp", 2), ("sp", 4)))]
    assert got == [
        ("all-reduce", 16 * 4, ("sp",), 4),  # its reader is a negate: not folded
        ("all-reduce", 64 * 64 * 4, ("dp", "sp"), 8),
        ("all-reduce", 16 * 4, ("dp",), 2),
    ]
