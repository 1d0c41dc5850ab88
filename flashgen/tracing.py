"""What a ``torch.compile`` trace of ``compile("auto")`` uses: the kernel pick as a constant of the graph.

Every AutoAttention registers here under a number. While tracing, a call names its
AutoAttention and its shape by constants, and :func:`traced_pick` (marked with
``torch.compiler.assume_constant_result``) runs once, returning the launcher handle the
graph keeps. Marking a function imports torch._dynamo, which an eager start should not
pay for, so the mark is applied on first use, which happens while tracing.
"""
from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch

#: AutoAttention objects (anything with ``pick(device, dtype, d_head, seq_q, mask)``) by number.
AUTOS: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
_NUMBERS = itertools.count()


def register(auto: Any) -> int:
    """A number that names ``auto`` in traced calls."""
    number = next(_NUMBERS)
    AUTOS[number] = auto
    return number


def _pick(auto_id: int, device: torch.device, dtype: torch.dtype, d_head: int, seq_bucket: int, mask: str) -> int:
    """The launcher handle the AutoAttention numbered ``auto_id`` uses for a traced call's shape."""
    return AUTOS[auto_id].pick(device, dtype, d_head, seq_bucket, mask)._handle


def __getattr__(name: str):
    if name == "traced_pick":  # marked on first use (while tracing: torch._dynamo is loaded by then)
        marked = torch.compiler.assume_constant_result(_pick)
        globals()["traced_pick"] = marked
        return marked
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
