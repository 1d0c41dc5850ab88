"""``mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32`` (PTX ISA 9.7.14.5.8)."""
from __future__ import annotations

from ...dsl.atoms.mma import MMA_16x8x16


def helper(mma: MMA_16x8x16) -> str:
    """``mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1)``: d += a * b."""
    return f'''// {mma.name}: D(16x8, f32) += A(16x16, row) * B(16x8, col); fragments per PTX 9.7.14.5.8.
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {{
    asm("{mma.ptx} {{%0, %1, %2, %3}}, {{%4, %5, %6, %7}}, {{%8, %9}}, {{%0, %1, %2, %3}};\\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}}'''
