"""``red.global.add.f32`` (PTX ISA 9.7.13.6): an fp32 reduction into global memory, no value returned."""
from __future__ import annotations

from ...dsl.atoms.copy import CopyAtom


def helpers(atom: CopyAtom) -> str:
    """``red_add_f32(float* p, float v)``: ``*p += v`` atomically (relaxed, gpu scope); and
    ``red_add_f32x2(p, a, b)``: ``p[0] += a, p[1] += b`` (8-byte aligned ``p``), one vector
    reduction on sm_90 (``red.global.add.v2.f32``, PTX 8.1), two scalar ones before; ``red_add_f32x4(p, a, b,
    c, d)`` the same for four values (16-byte aligned ``p``, ``red.global.add.v4.f32``)."""
    if atom.family != "red_add_f32":
        raise ValueError(f"{atom} is not a red.global.add.f32 atom")
    return r'''// red.global.add.f32: *p += v in global memory, atomically, without returning the old value.
__device__ __forceinline__ void red_add_f32(float* p, float v) {
    asm volatile("red.global.add.f32 [%0], %1;\n" :: "l"(p), "f"(v) : "memory");
}
// p[0] += a, p[1] += b (p 8-byte aligned): on sm_90 one vector reduction fills the lanes' 32-byte
// sectors (a row's four lanes x 8 bytes) where scalar ones leave each half empty
__device__ __forceinline__ void red_add_f32x2(float* p, float a, float b) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" :: "l"(p), "f"(a), "f"(b) : "memory");
#else
    red_add_f32(p, a);
    red_add_f32(p + 1, b);
#endif
}
// p[0..3] += a, b, c, d (p 16-byte aligned): one vector reduction on sm_90
__device__ __forceinline__ void red_add_f32x4(float* p, float a, float b, float c, float d) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" :: "l"(p), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
#else
    red_add_f32x2(p, a, b);
    red_add_f32x2(p + 2, c, d);
#endif
}'''
