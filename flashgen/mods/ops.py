"""What each operation computes, in C++ and in numpy, side by side: the one semantic table.

Contract of both columns, per result dtype (operands already share one dtype, see expr.py):

* fp32 ``+ - * /`` round once per operation. The C++ calls ``fg_fadd`` etc., which use
  ``__fadd_rn``-style intrinsics on the device so nvcc cannot contract ``a * b + c`` into an FMA;
  numpy rounds each fp32 operation too, so the two are bitwise equal. ``sqrt`` is correctly rounded
  on both (nvcc's default ``-prec-sqrt=true``); ``exp``/``log``/``tanh`` are the math libraries'
  (CUDA: at most 2, 1 and 2 ulp; glibc and numpy: about 1), so these differ by a few ulp.
* int32 ``//`` and ``%`` floor as Python and torch do (C truncates: ``-7 / 2`` is -3 in C, -4 here),
  through ``fg_floordiv``/``fg_floormod``. Division by zero is undefined in the kernel.
* ``minimum``/``maximum`` on floats propagate NaN as torch does (plain fminf/fmaxf would drop it).
* ``& | ^ ~`` are logical on bool and bitwise on int32, as torch's operators are.
"""
from __future__ import annotations

import numpy as np

from .expr import BOOL, FLOAT, INT

#: C++ helpers the rendered functions call; guarded so several mods share one translation unit
HELPERS = r"""#ifndef FLASHGEN_MODS_HELPERS
#define FLASHGEN_MODS_HELPERS
#include <cmath>
// fp32 operations rounded one at a time (no FMA contraction), as the numpy evaluator rounds them
#ifdef __CUDA_ARCH__
__host__ __device__ __forceinline__ float fg_fadd(float a, float b) { return __fadd_rn(a, b); }
__host__ __device__ __forceinline__ float fg_fsub(float a, float b) { return __fsub_rn(a, b); }
__host__ __device__ __forceinline__ float fg_fmul(float a, float b) { return __fmul_rn(a, b); }
__host__ __device__ __forceinline__ float fg_fdiv(float a, float b) { return __fdiv_rn(a, b); }
#else
__host__ __device__ __forceinline__ float fg_fadd(float a, float b) { return a + b; }
__host__ __device__ __forceinline__ float fg_fsub(float a, float b) { return a - b; }
__host__ __device__ __forceinline__ float fg_fmul(float a, float b) { return a * b; }
__host__ __device__ __forceinline__ float fg_fdiv(float a, float b) { return a / b; }
#endif
// Python's and torch's floor division and modulo (C truncates toward zero)
__host__ __device__ __forceinline__ int fg_floordiv(int a, int b) { const int q = a / b; return (q * b != a && ((a < 0) != (b < 0))) ? q - 1 : q; }
__host__ __device__ __forceinline__ int fg_floormod(int a, int b) { const int r = a % b; return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r; }
// torch.minimum / torch.maximum: NaN if either operand is NaN
__host__ __device__ __forceinline__ float fg_fmin(float a, float b) { return (a != a || b != b) ? a + b : fminf(a, b); }
__host__ __device__ __forceinline__ float fg_fmax(float a, float b) { return (a != a || b != b) ? a + b : fmaxf(a, b); }
#endif"""

_FLOAT_BINARY = {"add": "fg_fadd({a}, {b})", "sub": "fg_fsub({a}, {b})", "mul": "fg_fmul({a}, {b})",
                 "truediv": "fg_fdiv({a}, {b})", "minimum": "fg_fmin({a}, {b})", "maximum": "fg_fmax({a}, {b})"}
_INT_BINARY = {"add": "({a} + {b})", "sub": "({a} - {b})", "mul": "({a} * {b})",
               "floordiv": "fg_floordiv({a}, {b})", "mod": "fg_floormod({a}, {b})",
               "and": "({a} & {b})", "or": "({a} | {b})", "xor": "({a} ^ {b})",
               "minimum": "({a} < {b} ? {a} : {b})", "maximum": "({a} > {b} ? {a} : {b})"}
_BOOL_BINARY = {"and": "({a} && {b})", "or": "({a} || {b})", "xor": "({a} != {b})",
                "minimum": "({a} && {b})", "maximum": "({a} || {b})"}
_COMPARE = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}


def binary_cpp(op: str, operand_dtype: str, a: str, b: str) -> str:
    if op in _COMPARE:
        return f"({a} {_COMPARE[op]} {b})"
    table = {FLOAT: _FLOAT_BINARY, INT: _INT_BINARY, BOOL: _BOOL_BINARY}[operand_dtype]
    return table[op].format(a=a, b=b)


def unary_cpp(op: str, dtype: str, x: str) -> str:
    if op in ("exp", "log", "tanh", "sqrt"):
        return f"{op}f({x})"
    if op == "neg":
        return f"(-{x})"
    if op == "not":
        return f"(!{x})" if dtype == BOOL else f"(~{x})"
    return f"fabsf({x})" if dtype == FLOAT else f"({x} < 0 ? -{x} : {x})"


def cast_cpp(dtype: str, source_dtype: str, x: str) -> str:
    if dtype == BOOL:
        return f"({x} != {'0.0f' if source_dtype == FLOAT else '0'})"
    return f"((float){x})" if dtype == FLOAT else f"((int){x})"


NP_DTYPE = {BOOL: np.bool_, INT: np.int32, FLOAT: np.float32}

_NP_BINARY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "truediv": np.true_divide,
              "floordiv": np.floor_divide, "mod": np.remainder, "lt": np.less, "le": np.less_equal,
              "gt": np.greater, "ge": np.greater_equal, "eq": np.equal, "ne": np.not_equal,
              "minimum": np.minimum, "maximum": np.maximum}
_NP_BITWISE = {"and": (np.logical_and, np.bitwise_and), "or": (np.logical_or, np.bitwise_or),
               "xor": (np.logical_xor, np.bitwise_xor)}


def binary_np(op: str, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if op in _NP_BITWISE:
        logical, bitwise = _NP_BITWISE[op]
        return (logical if a.dtype == np.bool_ else bitwise)(a, b)
    return _NP_BINARY[op](a, b)


def unary_np(op: str, x: np.ndarray) -> np.ndarray:
    if op == "not":
        return np.logical_not(x) if x.dtype == np.bool_ else np.invert(x)
    fn = {"neg": np.negative, "abs": np.abs, "exp": np.exp, "log": np.log, "tanh": np.tanh, "sqrt": np.sqrt}[op]
    return fn(x)


def cast_np(dtype: str, x: np.ndarray) -> np.ndarray:
    if dtype == BOOL:
        return x != 0
    return x.astype(NP_DTYPE[dtype])
