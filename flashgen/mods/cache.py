"""The per-function trace cache: a mod function is traced once, then only its values are read.

Keyed weakly by the function object (a dropped function frees its entry) and checked against its
code object (reassigning ``fn.__code__`` retraces). Each call binds the captured values of the
moment (:meth:`TracedMod.bind`); a trace made stale by a changed value kind is replaced.
"""
from __future__ import annotations

import weakref
from typing import Callable, NamedTuple

from .trace import trace
from .traced import ModArgs, StaleTrace, TracedMod

_TRACES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # fn -> {kind: (code, TracedMod)}
_COUNTS = {"hits": 0, "traces": 0}
#: (id(fn), kind) -> (weak reference to fn, its code, TracedMod): :func:`current`'s look-up on every call with a
#: mask_mod, cheaper than hashing the function into the weak dictionary; a retrace drops the entry
_CURRENT: dict = {}


class CacheInfo(NamedTuple):
    hits: int  # look-ups answered without tracing (eager calls through flashgen.mods.call_values look up nothing)
    traces: int  # traces run (first calls, changed code, stale values)
    functions: int  # functions held now


def traced(fn: Callable, kind: str) -> TracedMod:
    """``fn``'s TracedMod as a ``kind`` ("score"/"mask") mod, traced on first use only."""
    entry = _TRACES.get(fn, {}).get(kind) if _weakrefable(fn) else None
    if entry is not None and entry[0] is fn.__code__:
        _COUNTS["hits"] += 1
        return entry[1]
    return _retrace(fn, kind)


def prepare(fn: Callable, kind: str) -> tuple[TracedMod, ModArgs]:
    """The TracedMod and this call's captured values (what a kernel launch needs)."""
    mod = traced(fn, kind)
    try:
        return mod, mod.bind(fn)
    except StaleTrace:
        mod = _retrace(fn, kind)
        return mod, mod.bind(fn)


def current(fn: Callable, kind: str) -> TracedMod:
    """:func:`traced`, traced again where a value compiled in as a literal changed: a trace whose structure holds
    for the function now (its other values are read by :func:`prepare`)."""
    key = (id(fn), kind)
    entry = _CURRENT.get(key)
    if entry is None or entry[0]() is not fn or getattr(fn, "__code__", None) is not entry[1]:
        mod = traced(fn, kind)
        if _weakrefable(fn):
            def drop(ref, key=key) -> None:  # the function is gone: its entry, unless another took the key
                if _CURRENT.get(key, (None,))[0] is ref:
                    del _CURRENT[key]
            entry = _CURRENT[key] = (weakref.ref(fn, drop), fn.__code__, mod)
    else:
        mod = entry[2]
    if mod.static:
        try:
            mod.check_static(fn)
        except StaleTrace:
            mod = _retrace(fn, kind)
    return mod


def cache_info() -> CacheInfo:
    return CacheInfo(_COUNTS["hits"], _COUNTS["traces"], len(_TRACES))


def clear_cache() -> None:
    _TRACES.clear()
    _CURRENT.clear()
    _COUNTS.update(hits=0, traces=0)


def _retrace(fn: Callable, kind: str) -> TracedMod:
    mod = trace(fn, kind)
    _COUNTS["traces"] += 1
    _CURRENT.pop((id(fn), kind), None)
    if _weakrefable(fn):
        _TRACES.setdefault(fn, {})[kind] = (fn.__code__, mod)
    return mod


def _weakrefable(fn) -> bool:
    try:
        weakref.ref(fn)
    except TypeError:
        return False
    return hasattr(fn, "__code__")
