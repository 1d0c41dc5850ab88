"""Copies of captured tensors made once per tensor version, so repeated calls reuse them.

A kernel reads a captured tensor as int32 / fp32 / bool on q's device. A tensor that already is one
is used as it is; otherwise its converted copy is kept (weakly, with the source's ``_version``) and
made again only after the source changes in place. Repeated calls then pass the same memory, which
is also what lets a mask_mod's block mask be cached by address and version.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

_COPIES: dict[tuple, tuple] = {}  # (id(source), dtype, device) -> (weakref to source, version, copy)


def stable_copy(t: Any, dtype: Any, device: Any = None, check: "Callable[[Any], None] | None" = None) -> Any:
    """``t`` as ``dtype`` on ``device`` (default: its own); ``check(t)`` runs before each new copy."""
    device = t.device if device is None else device
    if t.dtype == dtype and t.device == device:
        return t
    key = (id(t), dtype, str(device))
    hit = _COPIES.get(key)
    if hit is not None and hit[0]() is t and hit[1] == t._version:
        return hit[2]
    if check is not None:
        check(t)
    copy = t.detach().to(device=device, dtype=dtype)
    _COPIES[key] = (weakref.ref(t, lambda _ref, key=key: _COPIES.pop(key, None)), t._version, copy)
    return copy
