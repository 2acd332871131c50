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

import jax
from flax import nnx
from jax._src import source_info_util

__all__ = ["leaf_scopes", "module_classes", "module_paths", "module_scopes"]

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
    # nnx.scan and nnx.vmap call copies of a stacked module rebuilt from its state: a
    # module unknown by identity is named by its class, where one module has that class
    # (the stacked ``blocks`` and its ``blocks/attn``)
    by_class: dict[type, list[str]] = {}
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module):
            by_class.setdefault(type(node), []).append(paths[id(node)])
    single = {cls: ps[0] for cls, ps in by_class.items() if len(set(ps)) == 1}
    previous = getattr(_active, "paths", None), getattr(_active, "classes", None)
    _active.paths, _active.classes = paths, single
    try:
        for cls, call in owners.items():
            cls.__call__ = _scoped(call)
        yield paths
    finally:
        for cls, call in owners.items():
            cls.__call__ = call
        _active.paths, _active.classes = previous


def _path_of(module) -> str | None:
    found = (getattr(_active, "paths", None) or {}).get(id(module))
    if found is None:
        found = (getattr(_active, "classes", None) or {}).get(type(module))
    return found


def _scoped(call):
    return _named_by(call, _path_of)


def _named_by(call, path_of):
    """``call`` run under the name stack ``path_of(module)`` (unchanged when empty)."""

    @functools.wraps(call)
    def wrapper(self, *args, **kwargs):
        path = path_of(self)
        if not path or str(source_info_util.current_name_stack()) == path:
            return call(self, *args, **kwargs)
        with source_info_util.reset_name_stack(), source_info_util.extend_name_stack(path):
            return call(self, *args, **kwargs)

    wrapper.__jscaler_scoped__ = True
    return wrapper


def module_classes() -> list[type]:
    """Every module class loaded now whose instances a params pytree may rebuild inside
    a loss: flax.nnx's, and equinox's when equinox is imported."""
    import sys

    bases = [nnx.Module]
    eqx = sys.modules.get("equinox")
    if eqx is not None:
        bases.append(eqx.Module)
    found: dict[type, None] = {}
    todo = list(bases)
    while todo:
        cls = todo.pop()
        if cls not in found:
            found[cls] = None
            todo.extend(cls.__subclasses__())
    return list(found)


@contextlib.contextmanager
def leaf_scopes(leaf_names: dict[int, str], module_classes):
    """Within this context, a call of a module of one of ``module_classes`` names its ops
    after the parameters it holds: the longest common path of their parents.

    For models handed over as a params pytree, whose modules are rebuilt inside the loss
    (``nnx.merge(graphdef, state)``, ``eqx.combine(params, static)``): the rebuilt
    modules are new objects, but they hold the very arrays the trace passed in, whose
    names (``leaf_names``: ``id(array) -> 'blocks/0/attn/q/kernel'``) are known. A module
    holding no named array keeps its caller's name."""
    owners = {}
    for cls in module_classes:
        for base in cls.__mro__:
            if "__call__" in base.__dict__:
                owners.setdefault(base, base.__dict__["__call__"])
                break
    try:
        for cls, call in owners.items():
            if not getattr(call, "__jscaler_scoped__", False):
                cls.__call__ = _leaf_scoped(call, leaf_names)
        yield
    finally:
        for cls, call in owners.items():
            cls.__call__ = call


def _leaf_scoped(call, leaf_names):
    return _named_by(call, lambda module: _common_parent(leaf_names, _arrays_of(module)))


def _arrays_of(module) -> list:
    if isinstance(module, nnx.Module):
        return jax.tree_util.tree_leaves(nnx.state(module))
    return jax.tree_util.tree_leaves(module)


def _common_parent(leaf_names: dict[int, str], arrays) -> str:
    parents = [leaf_names[id(a)].split("/")[:-1] for a in arrays if id(a) in leaf_names]
    if not parents:
        return ""
    common = parents[0]
    for p in parents[1:]:
        k = 0
        while k < min(len(common), len(p)) and common[k] == p[k]:
            k += 1
        common = common[:k]
    return "/".join(common)
