"""Bounds of a mod's integer values, from the bounds of its index arguments: where an int becomes a float cheaply.

A score_mod such as ALiBi converts an index difference to fp32 for every score. The GPU's int -> float
conversion runs at a quarter of the fp32 multiply-add rate, as the exponential of the softmax does, so one
per score makes the attention around it a quarter slower. An int known to lie in ``[-2^22, 2^22)`` converts
exactly with two full-rate instructions instead (``fg_i2f_small``: its bits added to those of 1.5 * 2^23, then
1.5 * 2^23 subtracted). The bounds come from interval arithmetic over the DAG, given that ``q_idx`` and
``kv_idx`` lie in ``[0, INDEX_LIMIT)`` (kernels using the fast conversion refuse longer sequences) and ``b`` and
``h`` in ``[0, 2^16)`` (the grid's limits); loads and captured numbers are unbounded.
"""
from __future__ import annotations

from typing import Optional

from .expr import BOOL, FLOAT, INT, Arg, Binary, Cast, Const, Unary, Where, postorder

#: the sequence length up to which a kernel's fast int -> float conversions are exact
INDEX_LIMIT = 2**21
#: ``fg_i2f_small`` is exact on [-SMALL, SMALL)
SMALL = 2**22
_ARG = {"q_idx": (0, INDEX_LIMIT - 1), "kv_idx": (0, INDEX_LIMIT - 1), "b": (0, 2**16 - 1), "h": (0, 2**16 - 1)}

Range = Optional[tuple[int, int]]


def _binary(op: str, a: Range, b: Range, b_node) -> Range:
    if a is None or b is None:
        return None
    (a0, a1), (b0, b1) = a, b
    if op == "add":
        return a0 + b0, a1 + b1
    if op == "sub":
        return a0 - b1, a1 - b0
    if op == "mul":
        ends = (a0 * b0, a0 * b1, a1 * b0, a1 * b1)
        return min(ends), max(ends)
    if op in ("minimum", "maximum"):
        pick = min if op == "minimum" else max
        return pick(a0, b0), pick(a1, b1)
    if op in ("floordiv", "mod") and isinstance(b_node, Const) and b_node.value > 0:
        c = b_node.value
        return (a0 // c, a1 // c) if op == "floordiv" else (0, c - 1)
    return None


def _unary(op: str, x: Range) -> Range:
    if x is None:
        return None
    if op == "neg":
        return -x[1], -x[0]
    if op == "abs":
        return (0 if x[0] <= 0 <= x[1] else min(abs(x[0]), abs(x[1]))), max(abs(x[0]), abs(x[1]))
    return None


def int_ranges(root) -> dict:
    """Every int32 / bool node of ``root``'s DAG -> its (lo, hi) bounds (inclusive), or None where unbounded."""
    out: dict = {}
    for n in postorder(root):
        if n.dtype == BOOL:
            out[n] = (0, 1)
        elif n.dtype != INT:
            continue
        elif isinstance(n, Arg):
            out[n] = _ARG.get(n.name)
        elif isinstance(n, Const):
            out[n] = (n.value, n.value)
        elif isinstance(n, Binary):
            out[n] = _binary(n.op, out.get(n.a), out.get(n.b), n.b)
        elif isinstance(n, Unary):
            out[n] = _unary(n.op, out.get(n.x))
        elif isinstance(n, Where):
            a, b = out.get(n.a), out.get(n.b)
            out[n] = None if a is None or b is None else (min(a[0], b[0]), max(a[1], b[1]))
        elif isinstance(n, Cast) and n.x.dtype == BOOL:
            out[n] = (0, 1)
        else:
            out[n] = None  # loads, captured numbers, casts from float
    return out


def small(r: Range) -> bool:
    """Whether a value of these bounds converts exactly through ``fg_i2f_small``."""
    return r is not None and -SMALL <= r[0] and r[1] < SMALL


def fast_casts(root) -> frozenset:
    """The int -> fp32 casts of ``root`` whose operand is :func:`small`."""
    ranges = int_ranges(root)
    return frozenset(n for n in postorder(root)
                     if isinstance(n, Cast) and n.x.dtype == INT and n.dtype == FLOAT and small(ranges.get(n.x)))
