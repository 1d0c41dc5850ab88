"""Where a mod's int -> float conversion of index arithmetic can leave the per-score work.

A score_mod such as ALiBi converts an index difference to fp32 for every score. The GPU converts on the
same quarter-rate unit as the softmax's exponential, so one conversion per score doubles that unit's work.
The kernels walk a fragment's scores as a base index plus a compile-time offset (``kv_idx = kv_base +
kv_off``), so a conversion of an *affine* index expression ``A = R + kq q_idx + kk kv_idx`` (``R`` free of
the indices, ``kq`` and ``kk`` literal ints) splits into

    float(A) == float(A at the bases) + float(kq q_off + kk kv_off)

whose first term the compiler hoists out of the loop over a row's scores and whose second is a constant:
one add per score. Both terms and their sum are integers of at most 2^24 in magnitude, so every step is
exact and the split equals the plain conversion bit for bit. The bounds come from interval arithmetic over
the DAG, given ``q_idx`` and ``kv_idx`` in ``[0, INDEX_LIMIT)`` (kernels with split conversions refuse
longer sequences) and ``b`` and ``h`` in ``[0, 2^16)`` (the grid's limits); loads and captured numbers are
unbounded.
"""
from __future__ import annotations

from typing import Optional

from .expr import BOOL, FLOAT, INT, Arg, Binary, Cast, Const, Unary, Where, postorder

#: the sequence length up to which a kernel's split conversions are exact
INDEX_LIMIT = 2**22
#: every int of magnitude at most EXACT is an fp32 value
EXACT = 2**24
#: the largest offset (``q_off``, ``kv_off``) a kernel passes: one block's span
MAX_OFFSET = 2**10
INDICES = ("q_idx", "kv_idx")
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


def reads_indices(root) -> dict:
    """Every node of ``root``'s DAG -> whether its value depends on ``q_idx`` or ``kv_idx``."""
    out: dict = {}
    for n in postorder(root):
        out[n] = (isinstance(n, Arg) and n.name in INDICES) or any(out[o] for o in n.operands)
    return out


def _affine(n, forms: dict, reads: dict) -> "tuple[int, int] | None":
    """``n``'s literal coefficients (kq, kk) on q_idx and kv_idx if it is affine in them, else None."""
    if not reads[n]:
        return 0, 0
    if isinstance(n, Arg):
        return (1, 0) if n.name == "q_idx" else (0, 1)
    if isinstance(n, Unary) and n.op == "neg" and forms.get(n.x) is not None:
        return -forms[n.x][0], -forms[n.x][1]
    if not isinstance(n, Binary) or n.dtype != INT:
        return None
    a, b = forms.get(n.a), forms.get(n.b)
    if a is None or b is None:
        return None
    if n.op in ("add", "sub"):
        sign = 1 if n.op == "add" else -1
        return a[0] + sign * b[0], a[1] + sign * b[1]
    if n.op == "mul":
        for form, other in ((a, n.b), (b, n.a)):
            if isinstance(other, Const):
                return form[0] * other.value, form[1] * other.value
    return None


def split_casts(root) -> dict:
    """The int -> fp32 casts of ``root`` that split exactly (module docstring): cast -> (kq, kk)."""
    ranges, reads = int_ranges(root), reads_indices(root)
    forms: dict = {}
    out = {}
    for n in postorder(root):
        if n.dtype == INT:
            forms[n] = _affine(n, forms, reads)
        if not (isinstance(n, Cast) and n.x.dtype == INT and n.dtype == FLOAT and reads[n.x]):
            continue
        form, bounds = forms.get(n.x), ranges.get(n.x)
        if form is None or bounds is None or not -EXACT <= bounds[0] <= bounds[1] <= EXACT:
            continue
        if (abs(form[0]) + abs(form[1])) * MAX_OFFSET <= EXACT:
            out[n] = form
    return out


def has_split_casts(roots) -> bool:
    """Whether any of these DAGs (a kernel's mods and derivative) converts by the split."""
    return any(split_casts(r) for r in roots if r is not None)

