"""Search spaces written with jscaler's public API.

A space is a callable ``space(graph, n_devices) -> Plan``. ``SPACES`` maps the names the
command line accepts (``--plan "megatron(tp=2, dp=4)"``) to the functions making them.
"""

from spaces.coshard import coshard
from spaces.dp import dp
from spaces.interlaced import interlaced
from spaces.megatron import megatron
from spaces.sequence import ring, ulysses, usp
from spaces.zero import zero

SPACES = {
    "coshard": coshard,
    "dp": dp,
    "interlaced": interlaced,
    "megatron": megatron,
    "ring": ring,
    "ulysses": ulysses,
    "usp": usp,
    "zero": zero,
}

__all__ = ["SPACES", "coshard", "dp", "interlaced", "megatron", "ring", "ulysses", "usp", "zero"]
