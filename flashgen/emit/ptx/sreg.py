"""Special-register reads (PTX ISA 10, "Special Registers": ``%tid``) as values the compiler cannot hoist.

``threadIdx.x`` is a pure value: the compiler computes an index derived from it once and keeps it in a
register for the whole kernel, across every loop that uses it. A ``mov`` from ``%tid.x`` in a volatile
asm statement is a new value at each place it runs, so a step of a loop that derives its indices from it
recomputes them there (a few integer instructions) and holds them only while it runs.
"""
from __future__ import annotations


def helpers() -> str:
    """``fresh_tid()``: ``threadIdx.x``, read where it is called (never hoisted out of a loop, never merged
    with another read)."""
    return r'''// threadIdx.x read where it is called: what a loop's step derives from it is recomputed in the step rather
// than held in registers across the loop
__device__ __forceinline__ uint32_t fresh_tid() {
    uint32_t tid;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
    return tid;
}'''
