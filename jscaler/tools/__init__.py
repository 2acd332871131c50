"""Developer tools for the jscaler source tree (not part of the engine's API)."""
