"""Moved to :mod:`jscaler.report.timeline` (matplotlib lives in ``jscaler.report`` only);
these names stay importable here until the trainers import them from there."""

from jscaler.report.timeline import write_pipeline_timeline as write_pipeline_timeline
from jscaler.report.timeline import write_spmd_timeline as write_spmd_timeline
