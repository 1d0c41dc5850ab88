"""A mask_mod's diagonal conjuncts: the part of it the kernels' built-in causal / window rule runs.

A mask_mod that is a conjunction (``&``, ``torch.logical_and``, nested) keeps key j for query i where every
conjunct keeps it. A conjunct that compares two integer expressions built from ``q_idx``, ``kv_idx`` and literal
integers with ``+``, ``-`` and unary ``-`` alone, whose difference is ``(q_idx - kv_idx) + c``, bounds the
diagonal distance ``d = q_idx - kv_idx``:

    q_idx >= kv_idx, kv_idx <= q_idx, q_idx - kv_idx >= 0     ->  d >= 0
    q_idx - kv_idx <= W, kv_idx >= q_idx - W, kv_idx + W >= q_idx  ->  d <= W
    kv_idx - q_idx <= R, ~(kv_idx > q_idx + R)                 ->  d >= -R

(``==`` gives both bounds, ``!=`` none). The built-in rule, top-left aligned, keeps j for i where
``i - left <= j <= i + right``, that is ``-right <= d <= left``, a negative size meaning unbounded: a bound
``d >= lo`` runs as ``right = -lo`` where ``lo <= 0``, a bound ``d <= hi`` as ``left = hi`` where ``hi >= 0``.
Bounds the rule cannot hold (``q_idx > kv_idx``: ``d >= 1``) and every other conjunct stay in the mask_mod.

Only literals of the function's code count: a captured number is a run-time value (a Scalar node), never a
bound. A number kept as a literal because the code needed it as a Python value is part of the trace's key
(a new value retraces, and the split is derived again from the new trace).

Exactness: the mask_mod computes its two sides in int32; the split applies only where neither side (nor any
part of one) can leave int32 over the call's index ranges (:meth:`Diagonal.exact_for`), so the comparison is
the one the built-in rule makes, and window sizes and lengths stay below 2^30 so the built-in rule's own
sums (``i + right + 1``, a block's last row plus ``right``) stay in int32 too.
"""
from __future__ import annotations

import functools
from typing import Optional

import attrs

from .expr import BOOL, INT, INT32_MAX, INT32_MIN, Arg, Binary, Const, Unary

#: the longest sequence and the largest window size a split serves (the built-in rule's sums stay in int32)
LIMIT = 2**30
#: a comparison's bounds on d = q_idx - kv_idx for ``(q_idx - kv_idx) op k``: (lo, hi) as functions of k
_BOUNDS = {"ge": lambda k: (k, None), "gt": lambda k: (k + 1, None), "le": lambda k: (None, k),
           "lt": lambda k: (None, k - 1), "eq": lambda k: (k, k)}
_MIRROR = {"ge": "le", "gt": "lt", "le": "ge", "lt": "gt", "eq": "eq", "ne": "ne"}
_NEGATE = {"ge": "lt", "gt": "le", "le": "gt", "lt": "ge", "eq": "ne", "ne": "eq"}

Form = tuple  # (a, b, c): the value a * q_idx + b * kv_idx + c


@attrs.frozen
class Diagonal:
    """A mask_mod split into bounds on ``d = q_idx - kv_idx`` and the rest of its conjunction.

    ``lo`` / ``hi``: d >= lo / d <= hi (None: unbounded; lo <= 0 <= hi); ``rest``: the other conjuncts in
    their order as one conjunction (None: none); ``max_seq``: the longest seq_q / seq_k for which every
    int32 value the diagonal conjuncts compute is exact (:meth:`exact_for`)."""

    lo: Optional[int]
    hi: Optional[int]
    rest: object
    max_seq: int

    @functools.cached_property  # read on every call that runs the split
    def window(self) -> tuple[int, int]:
        """The built-in rule's top-left ``(left, right)`` of the bounds (-1: unbounded)."""
        return (-1 if self.hi is None else self.hi), (-1 if self.lo is None else -self.lo)

    def exact_for(self, seq_q: int, seq_k: int) -> bool:
        """Whether the split keeps what the mask_mod keeps for these lengths (see the module docstring)."""
        return max(seq_q, seq_k) <= self.max_seq


def conjuncts(root) -> list:
    """The operands of a (nested) bool conjunction, left to right; ``[root]`` for anything else."""
    if isinstance(root, Binary) and root.op == "and" and root.dtype == BOOL:
        return conjuncts(root.a) + conjuncts(root.b)
    return [root]


def linear(node) -> "tuple[Form, list[Form]] | None":
    """``node``'s form ``(a, b, c)`` and the forms of it and every part of it (what the kernel computes on the
    way), where it is built from q_idx, kv_idx and int literals with add, sub and neg; else None."""
    if isinstance(node, Arg) and node.name in ("q_idx", "kv_idx"):
        form = (1, 0, 0) if node.name == "q_idx" else (0, 1, 0)
        return form, [form]
    if isinstance(node, Const) and node.dtype == INT:
        form = (0, 0, node.value)
        return form, [form]
    if isinstance(node, Unary) and node.op == "neg" and node.dtype == INT:
        inner = linear(node.x)
        if inner is None:
            return None
        form = tuple(-x for x in inner[0])
        return form, inner[1] + [form]
    if isinstance(node, Binary) and node.op in ("add", "sub") and node.dtype == INT:
        a, b = linear(node.a), linear(node.b)
        if a is None or b is None:
            return None
        sign = 1 if node.op == "add" else -1
        form = tuple(x + sign * y for x, y in zip(a[0], b[0]))
        return form, a[1] + b[1] + [form]
    return None


def bounds(conjunct) -> "tuple[Optional[int], Optional[int], list[Form]] | None":
    """``(lo, hi, forms)`` where ``conjunct`` is ``lo <= q_idx - kv_idx <= hi`` (either None: unbounded side) and
    ``forms`` the values it computes; None for any other conjunct (``!=`` included)."""
    op, node = None, conjunct
    if isinstance(node, Unary) and node.op == "not" and node.dtype == BOOL:
        op, node = "negate", node.x
    if not (isinstance(node, Binary) and node.op in _MIRROR and node.a.dtype == INT):
        return None
    cmp = _NEGATE[node.op] if op == "negate" else node.op
    sides = linear(node.a), linear(node.b)
    if None in sides:
        return None
    (a, b, c) = (x - y for x, y in zip(sides[0][0], sides[1][0]))  # a q + b kv + c  cmp  0
    if (a, b) == (-1, 1):
        cmp, c = _MIRROR[cmp], -c  # (q - kv) - c  mirrored-cmp  0
    elif (a, b) != (1, -1):
        return None
    if cmp == "ne":
        return None
    lo, hi = _BOUNDS[cmp](-c)
    return lo, hi, sides[0][1] + sides[1][1]


def _max_seq(forms: list) -> int:
    """The longest seq_q / seq_k (at most LIMIT) over which each form stays in int32 (0: none)."""
    longest = LIMIT
    for a, b, c in forms:
        if not INT32_MIN <= c <= INT32_MAX:
            return 0
        up, down = max(a, 0) + max(b, 0), min(a, 0) + min(b, 0)  # per unit of the largest index
        if up:
            longest = min(longest, (INT32_MAX - c) // up + 1)
        if down:
            longest = min(longest, (c - INT32_MIN) // -down + 1)
    return max(longest, 0)


def split(root) -> "Diagonal | None":
    """``root`` (a mask_mod's bool DAG) as bounds on q_idx - kv_idx the built-in rule runs, and the rest; None
    where no conjunct is such a bound (the mask_mod stays as it is)."""
    lo, hi, forms, rest, found = None, None, [], [], False
    for node in conjuncts(root):
        found_bounds = bounds(node)
        if found_bounds is None:
            if not (isinstance(node, Const) and node.value is True):
                rest.append(node)
            continue
        c_lo, c_hi, c_forms = found_bounds
        usable = (c_lo is None or -LIMIT < c_lo <= 0) and (c_hi is None or 0 <= c_hi < LIMIT)
        if not usable:  # d >= 1 (q_idx > kv_idx), d <= -1, or a size past LIMIT: the rule cannot hold it
            rest.append(node)
            continue
        found = True
        lo = c_lo if lo is None or (c_lo is not None and c_lo > lo) else lo
        hi = c_hi if hi is None or (c_hi is not None and c_hi < hi) else hi
        forms += c_forms
    if not found:
        return None
    remainder = None
    for node in rest:
        remainder = node if remainder is None else Binary("and", remainder, node, BOOL)
    return Diagonal(lo, hi, remainder, _max_seq(forms))


def combine(diagonal: tuple[int, int], call: tuple[int, int]) -> tuple[int, int]:
    """The ``(left, right)`` keeping what both top-left windows keep (a negative size: unbounded)."""
    def tighter(x: int, y: int) -> int:
        if x < 0:
            return -1 if y < 0 else y
        return x if y < 0 else min(x, y)

    return tighter(diagonal[0], call[0]), tighter(diagonal[1], call[1])

