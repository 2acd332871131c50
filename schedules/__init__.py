"""Placeholder: filled by the plans and pipeline issues."""
