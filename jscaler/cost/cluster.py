"""Cluster specs: what one device computes and holds, and how fast its links move data.

A :class:`Cluster` is a frozen description of identical devices grouped into nodes. Device
``d`` lives on node ``d // devices_per_node``; a collective whose group stays inside one
node runs over the intra-node links (NVLink), one that spans nodes over the inter-node
network (InfiniBand), whose per-device share is the node's network bandwidth divided by
its devices. Figures are vendors' peak numbers (dense, no sparsity); write your own
``Cluster(...)`` for other hardware, or ``dataclasses.replace(preset, ...)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from jscaler.errors import PlanError

__all__ = ["CLUSTERS", "Cluster", "Link", "get_cluster", "preset_of"]

GB = 1e9
TB = 1e12


@dataclass(frozen=True)
class Link:
    """A link level: per-device bandwidth (bytes/s, one direction) and per-hop latency (s)."""

    bandwidth: float
    latency: float


@dataclass(frozen=True)
class Cluster:
    """Identical devices, ``devices_per_node`` per node.

    Attributes:
      flops: peak FLOP/s per device by dtype name (``"fp32"``, ``"bf16"``, ``"fp16"``).
      memory_bandwidth: device memory bytes/s (the roofline's slope).
      memory: device memory in bytes (the capacity plans must fit).
      intra, inter: links inside a node and between nodes (per device).
      efficiency: the fraction of peak FLOP/s a model's matrix products reach, applied to
        the compute roof. 0.55 on the A100, H100 and H200 presets: in a profile of
        gpt-350m's step on an H200 its matmul kernels ran at 49% of the TF32 peak and
        57% of the bf16 one (an 8192-cubed product reaches 81%); 0.7 on the V100 presets
        (the paper table's model).
      combine_bytes: XLA's collective combiner threshold: the gradient reductions (and
        the ZeRO all-gathers after the update) of one kind over one group are merged into
        collectives of up to this many bytes, so their latency is paid once per bucket,
        not per tensor (``xla_gpu_all_reduce_combine_threshold_bytes``, 30 MiB).
      reduce_scatter: whether the backend runs a reduce-scatter as one collective that
        writes only each device's slice. XLA's CPU backend has none: it all-reduces the
        whole gradient and slices it, so a ZeRO reduction's output is as big as its input.
      native_ragged_dot: whether the backend runs ``ragged_dot`` as a grouped matmul.
        XLA does not, on CPU or GPU (jax 0.11 and 0.12): it lowers it as a dense dot over
        the groups, each row copied once per group with the other groups' rows masked,
        a buffer ``groups`` times the rows' size, and does ``groups`` times the useful
        FLOPs (see :func:`jscaler.cost.memory.ragged_expansions`). On an H200 a
        dropless MoE's ``[8192, 512] x [8, 512, 704]`` ragged_dot ran as one
        ``[8192, 4096] x [4096, 1408]`` product, its masked copies ``bf16[8, 8192, 704]``
        kept to the backward. False on every preset; True describes a backend with a
        grouped matmul kernel.
      fp32_matmul: the peak (a key of ``flops``) float32 matrix products run at under
        JAX's default matmul precision: ``"tf32"`` on NVIDIA GPUs from Ampere on, where
        XLA computes them in TF32 (an 8192-cubed float32 product ran at 409 TFLOP/s on
        an H200, 6.1x its fp32 peak: ``jscaler bench gpu``), unless
        ``jax_default_matmul_precision`` asks for more.
      fuses_elementwise: whether to model the backend's fusion of elementwise chains into
        one kernel (XLA's GPU backend): an intermediate of such a chain is neither moved
        through memory nor kept for the backward, which recomputes it from the chain's
        inputs (:func:`jscaler.cost.fusion.materialised`). On the A100, H100 and H200
        presets; the V100 ones keep the unfused model the paper's table was made with.
      kernel_seconds: what a kernel costs beyond its roofline time (its launch, filling
        and draining the device), charged per kernel the step launches
        (:func:`jscaler.cost.fusion.kernels`). A small model's step on a GPU is mostly
        this: gpt-small at batch 1 ran 2.93 ms on an H200 against 0.26 ms of roofline.
        8 us on the A100, H100 and H200 presets, from two batch sweeps on an H200
        (``jscaler bench gpu``: the steps' time not proportional to the batch, over
        their kernels: 8.6 us for gpt-small, 8.2 us for Hugging Face's GPT-2); 0 on the
        V100 presets (the paper table's model) and the CPU one.
      unaligned_matmul: the share of its roof (``peak * efficiency``) a matrix product
        reaches whose ``m``, ``n`` or ``k`` is not a multiple of 16 bytes
        (:func:`jscaler.cost.precision.aligned`): the tensor cores' fast kernels need it,
        and without it cuBLAS falls back to slower ones. 0.53 on the A100, H100 and H200
        presets: on an H200 float32 ``[8192, 768] x [768, 50257]`` (Hugging Face GPT-2's
        LM head) and ``[768, 30522]`` (BERT's) ran at 29% of the TF32 peak, 0.53 of the
        presets' 55%, where ``[768, 50304]`` and ``[768, 32000]`` ran at 71%. 1.0 on the
        V100 presets (the paper table's model) and the CPU one.
    """

    name: str
    devices_per_node: int
    flops: dict = field(hash=False)
    memory_bandwidth: float
    memory: float
    intra: Link
    inter: Link
    efficiency: float = 0.7
    combine_bytes: float = 30 * 2**20
    reduce_scatter: bool = True
    native_ragged_dot: bool = False
    fp32_matmul: str = "fp32"
    fuses_elementwise: bool = False
    kernel_seconds: float = 0.0
    unaligned_matmul: float = 1.0

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s computing in ``dtype`` (fp32: at :attr:`fp32_matmul`)."""
        if dtype == "fp32":
            dtype = self.fp32_matmul
        if dtype not in self.flops:
            raise PlanError(
                f"cluster {self.name!r} has no peak FLOP/s for {dtype!r}; it knows "
                f"{sorted(self.flops)}"
            )
        return self.flops[dtype]

    def node_of(self, device: int) -> int:
        return device // self.devices_per_node

    def link(self, group) -> Link:
        """The link a collective over ``group`` (device ids) runs on."""
        return self.intra if len({self.node_of(d) for d in group}) <= 1 else self.inter


def _v100(name: str, per_node: int, nvlink: float, ib_node: float) -> Cluster:
    return Cluster(
        name,
        per_node,
        {"fp32": 15.7 * TB, "fp16": 125 * TB, "bf16": 125 * TB},
        900 * GB,
        32 * 2**30,
        Link(nvlink, 5e-6),
        Link(ib_node / per_node, 10e-6),
    )


CLUSTERS = {
    # the paper's testbed: 16 V100-32GB per node on NVSwitch, 8 x 100 Gb/s InfiniBand
    "dgx2_v100": _v100("dgx2_v100", 16, 150 * GB, 8 * 12.5 * GB),
    # 8 V100 per node on a hybrid-cube NVLink mesh, 4 x 100 Gb/s InfiniBand
    "dgx1_v100": _v100("dgx1_v100", 8, 100 * GB, 4 * 12.5 * GB),
    "a100_80g": Cluster(
        "a100_80g",
        8,
        {"fp32": 19.5 * TB, "tf32": 156 * TB, "bf16": 312 * TB, "fp16": 312 * TB},
        2039 * GB,
        80 * 2**30,
        Link(300 * GB, 5e-6),
        Link(8 * 25 * GB / 8, 10e-6),  # 8 x 200 Gb/s HDR per node
        fp32_matmul="tf32",
        fuses_elementwise=True,
        kernel_seconds=8e-6,
        efficiency=0.55,
        unaligned_matmul=0.53,
    ),
    "h100_sxm": Cluster(
        "h100_sxm",
        8,
        {"fp32": 67 * TB, "tf32": 495 * TB, "bf16": 989 * TB, "fp16": 989 * TB},
        3350 * GB,
        80 * 2**30,
        Link(450 * GB, 4e-6),
        Link(8 * 50 * GB / 8, 8e-6),  # 8 x 400 Gb/s NDR per node
        fp32_matmul="tf32",
        fuses_elementwise=True,
        kernel_seconds=8e-6,
        efficiency=0.55,
        unaligned_matmul=0.53,
    ),
    # this machine: simulated CPU devices sharing 2 cores and 24 GiB, memcpy "links"
    "cpu": Cluster(
        "cpu",
        8,
        {"fp32": 50e9, "bf16": 25e9},
        10 * GB,
        24 * 2**30,
        Link(5 * GB, 20e-6),
        Link(1 * GB, 100e-6),
        efficiency=0.5,
        reduce_scatter=False,
    ),
}


# H200 SXM: the H100's compute and links with 141 GB of HBM3e at 4.8 TB/s
CLUSTERS["h200"] = replace(
    CLUSTERS["h100_sxm"], name="h200", memory_bandwidth=4800 * GB, memory=141 * GB
)


# device_kind substrings -> presets
_KINDS = [("H200", "h200"), ("H100", "h100_sxm"), ("A100", "a100_80g"), ("V100", "dgx2_v100")]


def preset_of(device) -> str | None:
    """The preset of a JAX device: ``"cpu"`` for a CPU, a GPU's by its ``device_kind``
    (H200, H100, A100, V100), None for another accelerator."""
    if device.platform == "cpu":
        return "cpu"
    return next((preset for key, preset in _KINDS if key in device.device_kind), None)


def get_cluster(cluster: str | Cluster) -> Cluster:
    """A preset by name, or the Cluster given."""
    if isinstance(cluster, Cluster):
        return cluster
    if cluster not in CLUSTERS:
        raise PlanError(f"unknown cluster {cluster!r}; presets: {sorted(CLUSTERS)}")
    return CLUSTERS[cluster]
