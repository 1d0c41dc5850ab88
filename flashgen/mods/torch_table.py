"""The torch functions and tensor methods a mod may call, by name, and the nodes they build.

One table serves ``torch.exp(x)``, ``x.exp()`` and ``Tensor.__add__`` reached through
``__torch_function__``; a reflected dunder (``__radd__``) swaps its operands. A name not in the
table raises an OpError listing what is supported.
"""
from __future__ import annotations

import torch

from .expr import BOOL, FLOAT, INT, OpError, binary, cast, const, unary, where

BINARY = {"add": "add", "sub": "sub", "subtract": "sub", "mul": "mul", "multiply": "mul", "div": "truediv",
          "divide": "truediv", "true_divide": "truediv", "truediv": "truediv", "floor_divide": "floordiv",
          "floordiv": "floordiv", "remainder": "mod", "mod": "mod", "lt": "lt", "less": "lt", "le": "le",
          "less_equal": "le", "gt": "gt", "greater": "gt", "ge": "ge", "greater_equal": "ge", "eq": "eq",
          "ne": "ne", "not_equal": "ne", "bitwise_and": "and", "and": "and", "bitwise_or": "or", "or": "or",
          "bitwise_xor": "xor", "xor": "xor", "minimum": "minimum", "maximum": "maximum"}
LOGICAL = {"logical_and": "and", "logical_or": "or", "logical_xor": "xor"}
UNARY = {"neg": "neg", "negative": "neg", "abs": "abs", "absolute": "abs", "exp": "exp", "exp2": "exp2", "log": "log",
         "tanh": "tanh", "sqrt": "sqrt", "bitwise_not": "not", "invert": "not"}
CASTS = {"float": FLOAT, "double": FLOAT, "int": INT, "long": INT, "bool": BOOL}
#: torch dtypes a mod may cast to, as the kernel computes them (fp64 math runs in fp32 there)
TO_DTYPE = {torch.float32: FLOAT, torch.float64: FLOAT, torch.int32: INT, torch.int64: INT, torch.bool: BOOL}
TORCH_DTYPE = {FLOAT: torch.float32, INT: torch.int32, BOOL: torch.bool}
SUPPORTED = ("+ - * / // % unary- abs & | ^ ~ < <= > >= == != ** (integer powers 0-4, 0.5) torch.where torch.exp "
             "torch.exp2 torch.log torch.tanh torch.sqrt torch.abs torch.sign torch.square torch.minimum/maximum (torch.min/max of "
             "two values) torch.clamp torch.logical_and/or/xor/not .float() .int() .long() .bool() .to(dtype), "
             "x.new_ones(()) / .new_zeros(()) / .new_full((), v), torch.zeros_like / ones_like / full_like, "
             "captured_tensor[index expressions]")
#: torch.min / torch.max of two values (a reduction over a dim otherwise) are the elementwise minimum / maximum
TWO_VALUE = {"min": "minimum", "max": "maximum"}
#: x ** e for these Python exponents: products of x (torch computes x * x for 2), or sqrt for 0.5
POWERS = (0, 1, 2, 3, 4, 0.5)
#: torch.zeros_like(x) and friends: the constant, of x's dtype (the mod sees one value at a time)
LIKE_CONSTANT = {"zeros_like": 0, "ones_like": 1, "full_like": None}
#: ``x.new_ones(())`` and friends: a 0-d constant (FlexAttention's ``and_masks`` / ``or_masks`` start from one)
NEW_CONSTANT = {"new_ones": 1, "new_zeros": 0, "new_full": None}


def kernel_dtype(dtype: torch.dtype, what: str) -> str:
    """The kernel dtype holding a captured tensor's values (narrow ints and floats widen)."""
    if dtype == torch.bool:
        return BOOL
    if dtype in (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64):
        return INT
    if dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        return FLOAT
    raise OpError(f"{what} has dtype {dtype}; flashgen passes bool, integer and float tensors")


def _name_of(func) -> str:
    name = getattr(func, "__name__", repr(func))
    if getattr(torch, name, None) is func:
        return f"torch.{name}"
    return f"Tensor.{name}"


def _strip(name: str) -> tuple[str, bool]:
    """'__radd__' -> ('add', True); '__add__' -> ('add', False); 'add' -> ('add', False)."""
    if name.startswith("__") and name.endswith("__"):
        core = name[2:-2]
        if core.startswith("r") and core[1:] in BINARY:
            return core[1:], True
        return core, False
    return name, False


def _apply(tracer, name: str, args: tuple, kwargs: dict, shown: str):
    if name == "getitem":
        return tracer.index(*args)
    lift = tracer.lift
    if name in BINARY and len(args) == 2 and not kwargs:
        return binary(BINARY[name], lift(args[0]), lift(args[1]))
    if name == "div" and kwargs.get("rounding_mode") == "floor":
        return binary("floordiv", lift(args[0]), lift(args[1]))
    if name in LOGICAL:
        return binary(LOGICAL[name], cast(lift(args[0]), BOOL), cast(lift(args[1]), BOOL))
    if name == "logical_not":
        return unary("not", cast(lift(args[0]), BOOL))
    if name in UNARY and len(args) == 1 and not kwargs:
        return unary(UNARY[name], lift(args[0]))
    if name == "where" and len(args) == 3:
        return where(*(lift(a) for a in args))
    if name in ("clamp", "clip"):
        return _clamp(lift, args, kwargs)
    if name in CASTS and len(args) == 1:
        return cast(lift(args[0]), CASTS[name])
    if name == "to":
        return _to(lift, args, kwargs)
    if name in NEW_CONSTANT:
        return _new_constant(lift, name, args, kwargs)
    if name in LIKE_CONSTANT:
        return _like_constant(lift, name, args, kwargs)
    if name in TWO_VALUE and len(args) == 2 and not kwargs and not isinstance(args[1], (int, float)):
        return binary(TWO_VALUE[name], lift(args[0]), lift(args[1]))
    if name in TWO_VALUE:
        raise OpError(f"torch.{name}(x, ...) as a reduction (over a dim); the mod sees one value at a time: "
                      f"torch.{TWO_VALUE[name]}(a, b) or torch.clamp take two values")
    if name in ("pow", "square") and not kwargs:
        return power(lift(args[0]), 2 if name == "square" else args[1])
    if name == "sign" and len(args) == 1 and not kwargs:
        return _sign(lift(args[0]))
    raise OpError(f"{shown}, which flashgen cannot compile; supported: {SUPPORTED}")


def _clamp(lift, args: tuple, kwargs: dict):
    x, *bounds = args
    lo = bounds[0] if len(bounds) > 0 else kwargs.get("min")
    hi = bounds[1] if len(bounds) > 1 else kwargs.get("max")
    out = lift(x)
    if lo is not None:
        out = binary("maximum", out, lift(lo))
    if hi is not None:
        out = binary("minimum", out, lift(hi))
    return out


def _to(lift, args: tuple, kwargs: dict):
    dtype = kwargs.get("dtype", args[1] if len(args) > 1 else None)
    if dtype not in TO_DTYPE:
        raise OpError(f".to({dtype!r}); flashgen casts to torch.float32/float64 (computed in fp32), "
                      "torch.int32/int64 (int32) and torch.bool")
    return cast(lift(args[0]), TO_DTYPE[dtype])


def _new_constant(lift, name: str, args: tuple, kwargs: dict):
    """``x.new_ones(())`` / ``.new_zeros(())`` / ``.new_full((), value)``: the constant, of ``dtype`` (default x's)."""
    size = args[1] if len(args) > 1 else kwargs.get("size")
    value = NEW_CONSTANT[name]
    if value is None:
        value = args[2] if len(args) > 2 else kwargs.get("fill_value")
    if size not in ((), [], torch.Size([])) or not isinstance(value, (bool, int, float)):
        raise OpError(f"Tensor.{name}({size!r}, ...): flashgen makes 0-d constants (size ()) of a Python number")
    dtype = kwargs.get("dtype")
    out = lift(value)
    if dtype is None:
        return cast(out, lift(args[0]).dtype)
    if dtype not in TO_DTYPE:
        raise OpError(f"Tensor.{name}(..., dtype={dtype!r}); flashgen makes float32/float64, int32/int64 and bool constants")
    return cast(out, TO_DTYPE[dtype])


def power(x, e):
    """``x ** e`` for a Python exponent of :data:`POWERS`: x multiplied by itself (1 for 0, of x's dtype), or sqrt."""
    if isinstance(e, bool) or not isinstance(e, (int, float)) or e not in POWERS:
        raise OpError(f"x ** {e!r}; flashgen compiles the powers {', '.join(map(str, POWERS))} of a value "
                      "(exp(e * log(x)) for others)")
    if e == 0.5:
        return unary("sqrt", x)
    if e == 0:
        return cast(const(1, INT), x.dtype)
    out = x
    for _ in range(int(e) - 1):
        out = binary("mul", out, x)
    return out


def _sign(x):
    """torch.sign: 1, -1 or 0 (as x's dtype; 0 for 0 and for a float NaN's comparisons)."""
    one, zero = cast(const(1, INT), x.dtype), cast(const(0, INT), x.dtype)
    return where(binary("gt", x, zero), one, where(binary("lt", x, zero), unary("neg", one), zero))


def _like_constant(lift, name: str, args: tuple, kwargs: dict):
    """``torch.zeros_like(x)`` / ``ones_like(x)`` / ``full_like(x, v)``: the constant, of ``dtype`` (default x's)."""
    value = LIKE_CONSTANT[name]
    if value is None:
        value = args[1] if len(args) > 1 else kwargs.get("fill_value")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise OpError(f"torch.{name}(x, {value!r}): flashgen fills with a Python number")
    dtype = kwargs.get("dtype")
    if dtype is not None and dtype not in TO_DTYPE:
        raise OpError(f"torch.{name}(..., dtype={dtype!r}); flashgen makes float32/float64, int32/int64 and bool constants")
    return cast(lift(value), lift(args[0]).dtype if dtype is None else TO_DTYPE[dtype])


def call(tracer, func, args: tuple, kwargs: dict):
    """A torch function or tensor method reached through ``__torch_function__``."""
    name, reverse = _strip(getattr(func, "__name__", ""))
    if func is torch.Tensor.where:  # x.where(cond, y) is torch.where(cond, x, y)
        args = (args[1], args[0]) + tuple(args[2:])
    if reverse:
        args = (args[1], args[0]) + tuple(args[2:])
    return tracer.checked(_apply, tracer, name, tuple(args), kwargs, f"uses {_name_of(func)}")


def call_method(tracer, name: str, proxy, args: tuple, kwargs: dict):
    """``proxy.name(*args, **kwargs)``: the same table with the proxy first."""
    if name == "where" and args:
        return call(tracer, torch.Tensor.where, (proxy,) + tuple(args), kwargs)
    return tracer.checked(_apply, tracer, name, (proxy,) + tuple(args), kwargs, f"uses Tensor.{name}")
