"""Reports on plans and schedules: readable tables, drawn and written timelines.

Owns: :func:`explain` (a plan as a table of what it does to each module's ops),
:func:`plot` / :func:`figure` (a pipeline schedule's simulated timeline as an image) and
the timeline writers of a trainer's step (Chrome trace or PNG) and
:func:`write_memory_breakdown` (memory per device as stacked bars). The only package of jscaler
that imports matplotlib; nothing in the engine imports it.
"""

from jscaler.report.explain import describe_tree as describe_tree
from jscaler.report.explain import explain as explain
from jscaler.report.memory import write_memory_breakdown as write_memory_breakdown
from jscaler.report.plot import figure as figure
from jscaler.report.plot import plot as plot
from jscaler.report.timeline import write_pipeline_timeline as write_pipeline_timeline
from jscaler.report.timeline import write_spmd_timeline as write_spmd_timeline
