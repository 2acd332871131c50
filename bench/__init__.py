"""Benchmarks: plans side by side with the baselines users would write, in one run."""
