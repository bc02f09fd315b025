"""Compiled functions kept by key, least recently used dropped (the GPU attention paths).

Each path keys its compiled functions by what its trace depends on (specs, sizes, shapes), so all
layers of a forward pass share one trace; `call_compiled` also keeps a trace from holding a
kernel's reference where the kernel's first launch could not be checked inside it.
"""

from __future__ import annotations

from collections import OrderedDict

import mlx.core as mx

from longctx.kernels import _prelude

_COMPILED_MAX = 8


def lookup(cache: OrderedDict, key):
    """The compiled function cached under `key` (now the most recently used), or None."""
    fn = cache.get(key)
    if fn is not None:
        cache.move_to_end(key)
    return fn


def remember(cache: OrderedDict, key, fn):
    """Cache `fn` under `key`, dropping the least recently used past _COMPILED_MAX; returns fn."""
    cache[key] = fn
    while len(cache) > _COMPILED_MAX:
        cache.popitem(last=False)
    return fn


def fresh(fn):
    """A maker of new function objects that call `fn`: MLX caches a compiled function's traces
    by the Python function's identity and drops them all when any compiled wrapper of it is
    freed, so every cached wrapper needs a function object of its own."""
    return lambda: lambda *args: fn(*args)


def call_compiled(cache: OrderedDict, key, make, eager, args: tuple):
    """`mx.compile(make())(*args)`, the compiled function cached under `key` (`make` returns a
    new function object each time: `fresh`).

    A kernel variant is checked on its first launch (`kernels._prelude.run`), which a trace
    cannot evaluate: a trace that met an unchecked variant holds its pure-MLX reference. Such a
    trace is dropped and `eager(*args)` runs instead (checking the variant), so the next call
    traces again with the kernel.
    """
    fn = lookup(cache, key)
    if fn is not None:
        return fn(*args)
    fn = mx.compile(make())
    before = _prelude.traced_references()
    out = fn(*args)
    if _prelude.traced_references() != before:
        return eager(*args)
    remember(cache, key, fn)
    return out


def executor_installed() -> bool:
    """A test or emulation executor runs the kernels: it must see every launch, not only those
    of a trace (`kernels._prelude.executor`)."""
    return _prelude.executor_installed()


def prefill_compiled(paths) -> bool:
    """Whether the prefill paths (the fused chunk's update, the dense GPU attention) run
    compiled under a cache's `paths` (`turbo.Paths`): its `compile` is not "0" and no executor is
    installed (unless it asks for `compile_under_executor`)."""
    return paths.compile != "0" and (paths.compile_under_executor or not executor_installed())
