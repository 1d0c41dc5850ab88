"""The expression objects a traced mod is made of: a DAG of frozen, hashable values.

Three dtypes, the ones the kernel computes in: ``bool``, ``int32`` (every integer: FlexAttention's
index tensors are int64 in PyTorch, the kernel's indices are int) and ``fp32`` (every float: the
kernel's scores are fp32). Promotion follows torch's category rule for these cases: the result of
mixing two operands is the higher category of bool < int32 < fp32, Python numbers included (an
int tensor times a Python float is fp32; an fp32 tensor plus a Python int is fp32).

The constructors (:func:`binary`, :func:`unary`, :func:`where`, :func:`cast`, :func:`load`) insert
every implicit promotion as an explicit :class:`Cast`, so each operation's operands share one dtype
and both back ends (C++ and numpy) apply exactly the same conversions. They raise :class:`OpError`
for operations torch rejects or the kernel cannot do; the tracer adds which function did it.
"""
from __future__ import annotations

import math
from typing import Union

import attrs
import numpy as np

BOOL, INT, FLOAT = "bool", "int32", "fp32"
DTYPES = (BOOL, INT, FLOAT)
_CATEGORY = {BOOL: 0, INT: 1, FLOAT: 2}
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


class OpError(Exception):
    """An operation flashgen cannot compile; the tracer turns it into a ModError naming the function."""


def promote(*dtypes: str) -> str:
    """torch's result category of mixing these dtypes (bool < int32 < fp32)."""
    return max(dtypes, key=_CATEGORY.__getitem__)


@attrs.frozen(cache_hash=True)
class Arg:
    """One of the mod's own arguments: ``score`` (fp32) or ``b``, ``h``, ``q_idx``, ``kv_idx`` (int32)."""

    name: str
    dtype: str
    operands = ()


@attrs.frozen(cache_hash=True)
class Const:
    """A literal of the function's code. ``text`` is exact and total: ``float.hex`` of the fp32
    value (so -0.0 and NaN are values like any other), ``str`` of an int, ``True``/``False``."""

    text: str
    dtype: str
    operands = ()

    @property
    def value(self) -> Union[bool, int, float]:
        if self.dtype == FLOAT:
            return float.fromhex(self.text)
        return self.text == "True" if self.dtype == BOOL else int(self.text)


def const(value, dtype: str) -> Const:
    """The literal ``value`` as ``dtype`` (floats rounded to fp32, ints checked to fit int32)."""
    if dtype == FLOAT:
        return Const(float(np.float32(value)).hex(), FLOAT)
    if dtype == BOOL:
        return Const(str(bool(value)), BOOL)
    if isinstance(value, float) and not value.is_integer():
        raise OpError(f"the float {value!r} cannot be an int32 constant")
    v = int(value)
    if not INT32_MIN <= v <= INT32_MAX:
        raise OpError(f"the integer {v} does not fit the kernel's int32 arithmetic")
    return Const(str(v), INT)


@attrs.frozen(cache_hash=True)
class Scalar:
    """A captured Python number (or 0-d tensor) passed to the kernel as a named run-time argument,
    so a new value does not change the kernel."""

    name: str
    dtype: str
    operands = ()


@attrs.frozen(cache_hash=True)
class Buffer:
    """A captured tensor passed to the kernel as a pointer plus one stride per dimension; its
    sizes are not part of the kernel (the mod must index it in range, as in FlexAttention)."""

    name: str
    dtype: str
    rank: int


@attrs.frozen(cache_hash=True)
class Load:
    """``buffer[index...]``: one element of a captured tensor at int32 expression indices."""

    buffer: Buffer
    index: tuple
    dtype: str

    @property
    def operands(self) -> tuple:
        return self.index


@attrs.frozen(cache_hash=True)
class Cast:
    """A conversion as torch does it: float -> int truncates, anything -> bool is ``!= 0``."""

    x: object
    dtype: str

    @property
    def operands(self) -> tuple:
        return (self.x,)


@attrs.frozen(cache_hash=True)
class Unary:
    op: str
    x: object
    dtype: str

    @property
    def operands(self) -> tuple:
        return (self.x,)


@attrs.frozen(cache_hash=True)
class Binary:
    op: str
    a: object
    b: object
    dtype: str

    @property
    def operands(self) -> tuple:
        return (self.a, self.b)


@attrs.frozen(cache_hash=True)
class Where:
    """``torch.where(cond, a, b)``; both sides are evaluated, as torch evaluates both tensors."""

    cond: object
    a: object
    b: object
    dtype: str

    @property
    def operands(self) -> tuple:
        return (self.cond, self.a, self.b)


Expr = Union[Arg, Const, Scalar, Load, Cast, Unary, Binary, Where]

ARITH = ("add", "sub", "mul")
INT_ONLY = ("floordiv", "mod")
COMPARE = ("lt", "le", "gt", "ge", "eq", "ne")
BITWISE = ("and", "or", "xor")  # logical on bool, bitwise on int32 (torch's & | ^)
MINMAX = ("minimum", "maximum")
BINARY_OPS = ARITH + ("truediv",) + INT_ONLY + COMPARE + BITWISE + MINMAX
FLOAT_FUNCS = ("exp", "exp2", "log", "tanh", "sqrt")
UNARY_OPS = ("neg", "not", "abs") + FLOAT_FUNCS


def cast(x: Expr, dtype: str) -> Expr:
    """``x`` as ``dtype``; a constant is converted here (``Cast(Const)`` never appears)."""
    if x.dtype == dtype:
        return x
    if isinstance(x, Const):
        v = x.value
        if dtype == BOOL:
            return const(v != 0, BOOL)
        if dtype == INT:
            if isinstance(v, float) and not math.isfinite(v):
                raise OpError(f"casting the constant {v} to int32")
            return const(math.trunc(v), INT)
        return const(float(v), FLOAT)
    return Cast(x, dtype)


def binary(op: str, a: Expr, b: Expr) -> Expr:
    """``a op b`` with torch's promotion made explicit."""
    common = promote(a.dtype, b.dtype)
    if op == "truediv":
        common = FLOAT
    elif op in ARITH + INT_ONLY and common == BOOL:
        raise OpError(f"arithmetic '{op}' on two bool tensors (cast one with .int() first)")
    elif op in INT_ONLY and common == FLOAT:
        raise OpError(f"'{op}' on floats (flashgen compiles // and % on integers only)")
    elif op in BITWISE and common == FLOAT:
        raise OpError(f"bitwise '{op}' on a float tensor")
    a, b = cast(a, common), cast(b, common)
    return Binary(op, a, b, BOOL if op in COMPARE else common)


def unary(op: str, x: Expr) -> Expr:
    if op in FLOAT_FUNCS:
        return Unary(op, cast(x, FLOAT), FLOAT)
    if op == "not" and x.dtype == FLOAT:
        raise OpError("'~' (bitwise not) on a float tensor")
    if op in ("neg", "abs") and x.dtype == BOOL:
        raise OpError(f"'{op}' on a bool tensor (torch rejects it; use ~ for logical not)")
    return Unary(op, x, x.dtype)


def where(cond: Expr, a: Expr, b: Expr) -> Expr:
    if cond.dtype != BOOL:
        raise OpError(f"torch.where's condition must be bool, got {cond.dtype}")
    common = promote(a.dtype, b.dtype)
    return Where(cond, cast(a, common), cast(b, common), common)


def load(buffer: Buffer, index: tuple) -> Load:
    if len(index) != buffer.rank:
        raise OpError(f"indexing the {buffer.rank}-D tensor '{buffer.name}' with {len(index)} indices: "
                      "index every dimension with one integer expression")
    for i in index:
        if i.dtype != INT:
            raise OpError(f"indexing tensor '{buffer.name}' with a {i.dtype} index (indices must be integers)")
    return Load(buffer, tuple(index), buffer.dtype)


def postorder(root: Expr) -> list:
    """The DAG's distinct nodes, operands before users, in first-visit order (deterministic)."""
    seen, out, stack = set(), [], [(root, False)]
    while stack:
        node, done = stack.pop()
        if done:
            if node not in seen:
                seen.add(node)
                out.append(node)
            continue
        if node in seen:
            continue
        stack.append((node, True))
        stack.extend((o, False) for o in reversed(node.operands))
    return out
