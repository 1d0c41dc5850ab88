"""What each operation computes, in C++ and in numpy, side by side: the one semantic table.

Contract of both columns, per result dtype (operands already share one dtype, see expr.py):

* fp32 on the host (the C++ compiled for the CPU) and in numpy: ``+ - * /`` round once per operation,
  ``sqrt`` correctly rounded, ``exp``/``log``/``tanh`` the math libraries' (about 1 ulp): the two agree
  bit for bit except exp/log/tanh (a few ulp).
* fp32 on the device is the kernels' fast arithmetic, as the softmax around it: nvcc may contract
  ``a * b + c`` into one FMA (one rounding instead of two), a product with a split index conversion
  (``fg_mul_split``, flashgen/mods/ranges.py) is one FMA, the kernels' scale folds into the score's one
  factor or divisor (``fg_scaled_mul`` / ``fg_scaled_div``), ``/`` multiplies by ``rcp.approx`` (2 ulp), ``exp`` and
  ``log`` are ``__expf``/``__logf`` (the ``ex2``/``lg2`` units: 2 + 1.2|x| ulp, 3 ulp), ``tanh`` is
  ``tanh.approx.f32`` (absolute error below 2^-10); ``sqrt`` stays correctly rounded. A mod in the
  precise library functions costs several times the attention around it (division and tanhf are
  dozens of instructions per score); these cost one or two.
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
// fp32 arithmetic: exactly rounded on the host; on the device the kernels' fast forms (FMA contraction,
// approximate division, exp, log and tanh: see flashgen/mods/ops.py)
__host__ __device__ __forceinline__ float fg_fadd(float a, float b) { return a + b; }
__host__ __device__ __forceinline__ float fg_fsub(float a, float b) { return a - b; }
__host__ __device__ __forceinline__ float fg_fmul(float a, float b) { return a * b; }
#ifdef __CUDA_ARCH__
// a times b's approximate reciprocal, which a divisor shared by the tile (softcap's cap) computes once: __fdividef
// rescales tiny divisors with one more (predicated) multiply per score
__host__ __device__ __forceinline__ float fg_fdiv(float a, float b) { float r; asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(b)); return a * r; }
__host__ __device__ __forceinline__ float fg_exp(float x) { return __expf(x); }
__host__ __device__ __forceinline__ float fg_exp2(float x) { float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }
__host__ __device__ __forceinline__ float fg_log(float x) { return __logf(x); }
__host__ __device__ __forceinline__ float fg_tanh(float x) { float y; asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }
#else
__host__ __device__ __forceinline__ float fg_fdiv(float a, float b) { return a / b; }
__host__ __device__ __forceinline__ float fg_exp(float x) { return expf(x); }
__host__ __device__ __forceinline__ float fg_exp2(float x) { return exp2f(x); }
__host__ __device__ __forceinline__ float fg_log(float x) { return logf(x); }
__host__ __device__ __forceinline__ float fg_tanh(float x) { return tanhf(x); }
#endif
// the score_mod's scaled score (score * scale) times u or over d: on the device the scale folds into u (scale * u
// hoisted: one multiply per score), on the host rounded as written
__host__ __device__ __forceinline__ float fg_scaled_mul(float score, float scale, float u) {
#ifdef __CUDA_ARCH__
    return score * (scale * u);
#else
    return score * scale * u;
#endif
}
__host__ __device__ __forceinline__ float fg_scaled_div(float score, float scale, float d) {
#ifdef __CUDA_ARCH__
    return score * fg_fdiv(scale, d);
#else
    return score * scale / d;
#endif
}
// u * float(A) for a split conversion float(A) = base + off (flashgen/mods/ranges.py): on the device one
// multiply-add per score with u * base hoisted, within an ulp of u * base of the product
__host__ __device__ __forceinline__ float fg_mul_split(float u, float base, float off) {
#ifdef __CUDA_ARCH__
    return fmaf(u, off, u * base);
#else
    return u * (base + off);
#endif
}
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
    if op in ("exp", "exp2", "log", "tanh"):
        return f"fg_{op}({x})"
    if op == "sqrt":
        return f"sqrtf({x})"
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
    fn = {"neg": np.negative, "abs": np.abs, "exp": np.exp, "exp2": np.exp2, "log": np.log, "tanh": np.tanh,
          "sqrt": np.sqrt}[op]
    return fn(x)


def cast_np(dtype: str, x: np.ndarray) -> np.ndarray:
    if dtype == BOOL:
        return x != 0
    return x.astype(NP_DTYPE[dtype])
