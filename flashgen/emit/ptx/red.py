"""``red.global.add.f32`` (PTX ISA 9.7.13.6): an fp32 reduction into global memory, no value returned."""
from __future__ import annotations

from ...dsl.atoms.copy import CopyAtom


def helpers(atom: CopyAtom) -> str:
    """``red_add_f32(float* p, float v)``: ``*p += v`` atomically (relaxed, gpu scope)."""
    if atom.family != "red_add_f32":
        raise ValueError(f"{atom} is not a red.global.add.f32 atom")
    return r'''// red.global.add.f32: *p += v in global memory, atomically, without returning the old value.
__device__ __forceinline__ void red_add_f32(float* p, float v) {
    asm volatile("red.global.add.f32 [%0], %1;\n" :: "l"(p), "f"(v) : "memory");
}'''
