"""jscaler's version, in a module of its own so the runtime can record it without
importing the package that imports the runtime."""

__version__ = "0.2.0"
