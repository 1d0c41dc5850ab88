"""Softmax math and packing: ``ex2.approx.ftz.f32`` (PTX 9.7.4.10), ``cvt.rn.{f16x2,bf16x2}.f32`` (9.7.9.21)."""
from __future__ import annotations

from ...dsl.dtypes import DType


def helpers(dtype: DType) -> str:
    return f'''// 2^x with the SFU's approximate exp2 (flush-to-zero): the optimized softmax's exponential.
__device__ __forceinline__ float ex2_approx(float x) {{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\\n" : "=f"(y) : "f"(x));
    return y;
}}
// Two fp32 values -> one packed {dtype.ptx}x2 register (lo = first value), round to nearest even.
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {{
    uint32_t r;
    asm("cvt.rn.{dtype.ptx}x2.f32 %0, %1, %2;\\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}}'''
