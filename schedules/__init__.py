"""Pipeline schedules as plain Python functions returning a :class:`jscaler.Schedule`.

``SCHEDULES`` maps the names the command line accepts (``--schedule one_f_one_b``) to them.
"""

from jscaler.search import register_schedule
from schedules.classic import gpipe, interleaved_1f1b, one_f_one_b, zero_bubble
from schedules.interlaced import interlaced, interlaced_head
from schedules.tables import table4_1f1b, table7_3f1b
from schedules.three_f_one_b import three_f_one_b

SCHEDULES = {
    "gpipe": gpipe,
    "one_f_one_b": one_f_one_b,
    "interleaved_1f1b": interleaved_1f1b,
    "zero_bubble": zero_bubble,
    "three_f_one_b": three_f_one_b,
    "interlaced": interlaced,
    "interlaced_head": interlaced_head,
    "table4_1f1b": table4_1f1b,
    "table7_3f1b": table7_3f1b,
}

# the schedules plan="auto" tries on every pipeline it plans, beside 1F1B
for _name in ("gpipe", "interleaved_1f1b", "zero_bubble"):
    register_schedule(_name, SCHEDULES[_name])

__all__ = [
    "SCHEDULES",
    "gpipe",
    "interlaced",
    "interlaced_head",
    "interleaved_1f1b",
    "one_f_one_b",
    "table4_1f1b",
    "table7_3f1b",
    "three_f_one_b",
    "zero_bubble",
]
