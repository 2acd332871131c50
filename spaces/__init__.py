"""Search spaces written with jscaler's public API.

A space is a callable ``space(graph, n_devices) -> Plan``. ``SPACES`` maps the names the
command line accepts (``--plan "megatron(tp=2, dp=4)"``) to the functions making them.
"""

from jscaler.search import register_candidates
from spaces.alphafold import alphafold_3f1b
from spaces.baselines import alpa_like, deepspeed, megatron_3d
from spaces.coshard import coshard
from spaces.dap import dap
from spaces.dp import dp
from spaces.expert import expert
from spaces.interlaced import interlaced
from spaces.megatron import megatron
from spaces.sequence import ring, ulysses, usp
from spaces.zero import zero

SPACES = {
    "alpa_like": alpa_like,
    "alphafold_3f1b": alphafold_3f1b,
    "coshard": coshard,
    "dap": dap,
    "deepspeed": deepspeed,
    "dp": dp,
    "expert": expert,
    "interlaced": interlaced,
    "megatron": megatron,
    "megatron_3d": megatron_3d,
    "ring": ring,
    "ulysses": ulysses,
    "usp": usp,
    "zero": zero,
}

# every space's settings are candidates of plan="auto" (jscaler.search.register_candidates)
from spaces.grid import candidates as _candidates  # noqa: E402  (grid reads SPACES)

register_candidates(_candidates)

__all__ = [
    "SPACES",
    "alpa_like",
    "alphafold_3f1b",
    "coshard",
    "dap",
    "deepspeed",
    "dp",
    "expert",
    "interlaced",
    "megatron",
    "megatron_3d",
    "ring",
    "ulysses",
    "usp",
    "zero",
]
