"""Module paths for flax.nnx: name the ops each module's call emits after its path.

linen records module names in jax's name stack by itself; nnx does not. While tracing, we
wrap the ``__call__`` of every module class in the model so that a call of the module at
``blocks/0/attn`` runs under that name stack. The name is the module's whole path, not
its name relative to the caller, so a module called from elsewhere (a shared embedding
used as the LM head) is still named where it lives.
"""

from __future__ import annotations

import contextlib
import functools
import threading

from flax import nnx
from jax._src import source_info_util

__all__ = ["module_paths", "module_scopes"]

_active = threading.local()


def module_paths(model) -> dict[int, str]:
    """``id(module) -> 'a/b/0/c'`` for every nnx Module inside ``model`` (root: '')."""
    paths: dict[int, str] = {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module):
            paths.setdefault(id(node), "/".join(str(p) for p in path))
    return paths


@contextlib.contextmanager
def module_scopes(model):
    """Within this context, calling a module of ``model`` names its ops by its path."""
    paths = module_paths(model)
    owners = {}
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module):
            for cls in type(node).__mro__:
                if "__call__" in cls.__dict__:
                    owners[cls] = cls.__dict__["__call__"]
                    break
    previous = getattr(_active, "paths", None)
    _active.paths = paths
    try:
        for cls, call in owners.items():
            cls.__call__ = _scoped(call)
        yield paths
    finally:
        for cls, call in owners.items():
            cls.__call__ = call
        _active.paths = previous


def _scoped(call):
    @functools.wraps(call)
    def wrapper(self, *args, **kwargs):
        paths = getattr(_active, "paths", None) or {}
        path = paths.get(id(self))
        if not path or str(source_info_util.current_name_stack()) == path:
            return call(self, *args, **kwargs)
        with source_info_util.reset_name_stack(), source_info_util.extend_name_stack(path):
            return call(self, *args, **kwargs)

    wrapper.__jscaler_scoped__ = True
    return wrapper
