"""score_mod / mask_mod functions named on the command line: ``FILE.py:NAME`` or ``package.module:NAME``.

``NAME`` is the function itself (FlexAttention's signature: five arguments for a score_mod, four for a
mask_mod) or a factory every argument of which has a default (``examples/mods.py:softcap``: called, it
returns the function). A spec stays a string until a process needs the function (:func:`load`), so worker
processes receive specs, not closures.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any, Callable

from .errors import ModError

#: the number of arguments of each kind's function
ARITY = {"score": 5, "mask": 4}


@functools.lru_cache(maxsize=64)
def load(spec: str, kind: str) -> Callable:
    """The ``kind`` ("score" or "mask") function ``spec`` names; ModError says what is wrong with it."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise ModError(f"--{kind}-mod {spec!r}: expected FILE.py:NAME or package.module:NAME")
    obj = getattr(_module(where, spec, kind), name, None)
    if obj is None:
        raise ModError(f"--{kind}-mod {spec!r}: {where} has no {name!r}")
    return _function(obj, spec, kind)


def _module(where: str, spec: str, kind: str) -> Any:
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise ModError(f"--{kind}-mod {spec!r}: no file {where}")
        module_name = "flashgen_mods_" + hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
        loader_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[module_name] = module  # torch.compile and inspect look functions' modules up by name
        try:
            loader_spec.loader.exec_module(module)
        except Exception as exc:
            del sys.modules[module_name]
            raise ModError(f"--{kind}-mod {spec!r}: importing {where} failed: {type(exc).__name__}: {exc}") from None
        return module
    try:
        return importlib.import_module(where)
    except ImportError as exc:
        raise ModError(f"--{kind}-mod {spec!r}: cannot import {where}: {exc}") from None


def _required(fn: Callable) -> "int | None":
    """How many arguments ``fn`` needs (None: its signature cannot be read)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    return sum(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


def _function(obj: Any, spec: str, kind: str) -> Callable:
    """``obj`` if it takes ``kind``'s arguments, else what it returns when called without any."""
    if not callable(obj):
        raise ModError(f"--{kind}-mod {spec!r}: {type(obj).__name__} is not a function")
    need = _required(obj)
    if need == 0:  # a factory with defaults
        obj = obj()
        need = _required(obj) if callable(obj) else None
    if need != ARITY[kind]:
        raise ModError(f"--{kind}-mod {spec!r}: a {kind}_mod takes {ARITY[kind]} arguments "
                       f"({'score, ' if kind == 'score' else ''}b, h, q_idx, kv_idx); got "
                       f"{'a ' + type(obj).__name__ if need is None else f'a function of {need}'}")
    return obj


def kernel_mods(score: "str | None", mask: "str | None") -> Any:
    """The KernelMods of the functions two specs name (None without either)."""
    from .kernel_mods import prepare_mods

    return prepare_mods(load(score, "score") if score else None, load(mask, "mask") if mask else None)[0]
