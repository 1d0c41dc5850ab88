"""Turn counters of an ordered reduction: a CTA waits until a global counter reaches its rank, adds,
and passes the turn on. PTX ISA 9.7.9.8 (``ld.acquire.gpu``), 9.7.13.6 (``red.relaxed.gpu.add``),
9.7.13.4 (``fence.acq_rel.gpu``); the release/acquire pairing is the memory model's (section 8).

The acquire load of the waiting thread reads the value written by the releasing thread's ``red``
after its fence, so everything the releasing CTA wrote before its barrier and fence (its ``red.add``
of the reduced values) happens before what the waiting CTA does after its own barrier.
"""
from __future__ import annotations


def helpers() -> str:
    """``turn_wait(p, value)``: spin until ``*p == value`` (acquire); ``turn_pass(p)``: ``*p += 1`` (release)."""
    return r'''// turn counters (ordered reductions): one thread spins until *p == value; its later reads see what came before the release
__device__ __forceinline__ void turn_wait(const int* p, int value) {
    int now;
    do {
        asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(now) : "l"(p) : "memory");
    } while (now != value);
}
// *p += 1 after a fence: a release at gpu scope of this thread's writes and, through a CTA barrier before it, its CTA's
__device__ __forceinline__ void turn_pass(int* p) {
    asm volatile("fence.acq_rel.gpu;\n\tred.relaxed.gpu.global.add.s32 [%0], 1;\n" :: "l"(p) : "memory");
}'''
