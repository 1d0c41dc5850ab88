"""``cp.async.cg.shared.global`` (PTX ISA 9.7.9.25.3) and its commit/wait groups."""
from __future__ import annotations

from ...dsl.atoms.copy import CopyAtom


def helpers(atom: CopyAtom) -> str:
    """``cp_async_16(smem_addr, gmem_ptr)``, ``cp_async_commit()``, ``cp_async_wait<N>()``."""
    if atom.family != "cp_async" or atom.bytes_per_thread not in (4, 16):
        raise ValueError(f"{atom} is not a 4- or 16-byte cp.async atom")
    if atom.bytes_per_thread == 4:
        return r'''// cp.async.ca: 4 bytes global -> shared, zero-filled when !valid (PTX 9.7.9.25.3; .cg takes 16 only).
__device__ __forceinline__ void cp_async_4_zfill(uint32_t smem_addr, const void* gmem, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" :: "r"(smem_addr), "l"(gmem), "r"(valid ? 4 : 0) : "memory");
}'''
    return r'''// cp.async.cg: 16 bytes global -> shared, bypassing L1 (PTX 9.7.9.25.3).
__device__ __forceinline__ void cp_async_16(uint32_t smem_addr, const void* gmem) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(smem_addr), "l"(gmem) : "memory");
}
// Zero-filling form: copies 16 bytes when `valid`, else reads nothing and writes 16 zero bytes
// (src-size operand 0). Used for sequence tails and padding columns.
__device__ __forceinline__ void cp_async_16_zfill(uint32_t smem_addr, const void* gmem, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(smem_addr), "l"(gmem), "r"(valid ? 16 : 0) : "memory");
}
// Close the group of cp.async issued since the last commit.
__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// Wait until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory");
}'''
