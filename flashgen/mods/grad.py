"""A score_mod's derivative with respect to its score, as another expression of the same DAG kind.

The backward pass needs ``d score_mod(x, b, h, q_idx, kv_idx) / dx`` at every kept score: the
gradient reaching the modded score is multiplied by it before it flows on to Q and K. It is built
here symbolically, node by node (the chain rule over the DAG, each node's derivative memoized), with
torch's conventions where a function has no derivative or a kink:

* integer and bool values (indices, loads, comparisons, casts to int or bool) carry none (0);
* ``abs`` has ``sign(x)`` (0 at 0), ``sqrt`` ``0.5 / sqrt(x)``;
* ``minimum`` / ``maximum`` send it to the chosen operand, half to each on a tie;
* ``where`` to the chosen side (both sides are evaluated, the other's derivative is not used).

Zero is tracked as ``None`` so that a bias (``score + table[...]``) has the constant derivative 1 and a
function of the indices alone 0, and the kernels can skip the multiply (:func:`derivative` returns
the simplified expression; :func:`reads_score` says whether it still depends on the score).
"""
from __future__ import annotations

import math

from .expr import FLOAT, Arg, Binary, Cast, Const, Expr, Unary, Where, binary, const, postorder, unary, where

_ZERO, _ONE, _HALF = const(0.0, FLOAT), const(1.0, FLOAT), const(0.5, FLOAT)


def _is(x: "Expr | None", value: float) -> bool:
    return isinstance(x, Const) and x.dtype == FLOAT and x.value == value


def _add(a, b):
    if a is None:
        return b
    return a if b is None else binary("add", a, b)


def _sub(a, b):
    if b is None:
        return a
    return unary("neg", b) if a is None else binary("sub", a, b)


def _mul(a, b):
    """``a * b`` where either may be the symbolic zero None (then None) or the constant one."""
    if a is None or b is None:
        return None
    if _is(a, 1.0):
        return b
    return a if _is(b, 1.0) else binary("mul", a, b)


def _div(a, b):
    return None if a is None else binary("truediv", a, b)


def _unary(node: Unary, dx):
    x = node.x
    if dx is None or node.op == "not":
        return None
    if node.op == "neg":
        return unary("neg", dx)
    if node.op == "abs":  # sign(x): torch's derivative, 0 at 0
        sign = where(binary("gt", x, _ZERO), _ONE, where(binary("lt", x, _ZERO), const(-1.0, FLOAT), _ZERO))
        return _mul(sign, dx)
    if node.op == "exp":
        return _mul(node, dx)
    if node.op == "exp2":  # 2^x ln 2
        return _mul(_mul(node, const(math.log(2.0), FLOAT)), dx)
    if node.op == "log":
        return _div(dx, x)
    if node.op == "tanh":
        return _mul(binary("sub", _ONE, binary("mul", node, node)), dx)
    if node.op == "sqrt":
        return _div(_mul(_HALF, dx), node)
    raise ValueError(f"no derivative rule for '{node.op}'")


def _binary(node: Binary, da, db):
    a, b, op = node.a, node.b, node.op
    if node.dtype != FLOAT:
        return None
    if op == "add":
        return _add(da, db)
    if op == "sub":
        return _sub(da, db)
    if op == "mul":
        return _add(_mul(da, b), _mul(a, db))
    if op == "truediv":  # (da - (a / b) db) / b
        return _div(_sub(da, _mul(node, db)), b)
    if op in ("minimum", "maximum"):
        pick_a = binary("lt" if op == "minimum" else "gt", a, b)
        tie = _mul(_add(da, db), _HALF)
        zero = lambda d: _ZERO if d is None else d  # noqa: E731
        if da is None and db is None:
            return None
        return where(pick_a, zero(da), where(binary("eq", a, b), zero(tie), zero(db)))
    raise ValueError(f"no derivative rule for '{op}' on floats")


def _node(node, d: dict):
    if isinstance(node, Arg):
        return _ONE if node.name == "score" else None
    if node.dtype != FLOAT or isinstance(node, Const):
        return None  # integers, bools, literals, captured numbers and tensors: no derivative
    if isinstance(node, Cast):  # an int or bool made float: constant in the score
        return None
    if isinstance(node, Unary):
        return _unary(node, d[node.x])
    if isinstance(node, Binary):
        return _binary(node, d[node.a], d[node.b])
    if isinstance(node, Where):
        da, db = d[node.a], d[node.b]
        if da is None and db is None:
            return None
        return where(node.cond, _ZERO if da is None else da, _ZERO if db is None else db)
    return None  # Scalar, Load: captured values (a tensor requiring grad is refused when bound)


def derivative(root: Expr) -> "Expr | None":
    """``d root / d score`` as an fp32 expression over the same arguments; None where it is 0 everywhere."""
    if root.dtype != FLOAT:
        raise ValueError(f"a score_mod returns a float score, this returns {root.dtype}")
    d: dict = {}
    for node in postorder(root):
        d[node] = _node(node, d)
    return d[root]


def reads_score(expr: "Expr | None") -> bool:
    """Whether ``expr`` depends on the score argument (else it is a function of the indices alone)."""
    return expr is not None and any(isinstance(n, Arg) and n.name == "score" for n in postorder(expr))


def is_one(expr: "Expr | None") -> bool:
    """Whether ``expr`` is the constant 1 (a score_mod that adds a bias: nothing to multiply)."""
    return _is(expr, 1.0)


__all__ = ["derivative", "is_one", "reads_score"]
