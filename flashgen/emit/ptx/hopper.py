"""Hopper (sm_90 / sm_90a) PTX: mbarrier, TMA (``cp.async.bulk.tensor``), proxy fence, wgmma, setmaxnreg.

Each builder returns one or more ``__device__ __forceinline__`` helpers. Shared-memory
operands are 32-bit shared-window addresses (``__cvta_generic_to_shared``). Everything
that orders memory is ``asm volatile`` with a ``"memory"`` clobber. ``wgmma`` and
``setmaxnreg`` need ``-gencode=arch=compute_90a,code=sm_90a``; the rest is plain sm_90.
"""
from __future__ import annotations

from ...dsl.atoms.hopper import WGMMA_64xNx16


def mbarrier_init() -> str:
    """``mbarrier.init.shared::cta.b64`` (PTX ISA "mbarrier.init")."""
    return r'''// mbarrier.init: phase 0, expecting `count` arrivals per phase (count in 1..2^20-1).
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(count) : "memory");
}'''


def mbarrier_arrive_expect_tx() -> str:
    """``mbarrier.arrive.expect_tx.shared::cta.b64`` (PTX ISA "mbarrier.expect_tx" / "mbarrier.arrive")."""
    return r'''// One arrival on `bar` after raising its pending transaction count by `tx_bytes`
// (the bytes the TMA loads completing on this phase will deliver).
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t tx_bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(bar), "r"(tx_bytes) : "memory");
}
// One plain arrival on `bar` (consumers releasing a stage).
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(bar) : "memory");
}'''


def mbarrier_wait() -> str:
    """``mbarrier.try_wait.parity.shared::cta.b64`` and a spin loop on it (PTX ISA "mbarrier.test_wait/try_wait")."""
    return r'''// True once the phase with parity `parity` (0/1) of `bar` has completed; may suspend for a
// system-dependent time before returning false.
__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
    uint32_t done;
    asm volatile("{\n"
                 ".reg .pred p;\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                 "selp.u32 %0, 1, 0, p;\n"
                 "}\n"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    return done != 0;
}
// Block until the phase of parity `parity` of `bar` completes.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    while (!mbar_try_wait(bar, parity)) {
    }
}'''


def tma_load_2d() -> str:
    """``cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes`` (PTX ISA "cp.async.bulk.tensor").

    ``tmap`` is the generic address of a ``const __grid_constant__ CUtensorMap`` kernel
    parameter; ``c0`` is the innermost (column) coordinate, ``c1`` the row, in elements.
    """
    return r'''// TMA: copy the box at (c0 = inner/column, c1 = row) of the tensor map `tmap` (generic address of a
// __grid_constant__ CUtensorMap) to shared `dst`; completion adds the box bytes to `bar`'s tx count.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const void* tmap, uint32_t bar, int32_t c0, int32_t c1) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n"
                 :: "r"(dst), "l"(reinterpret_cast<uint64_t>(tmap)), "r"(bar), "r"(c0), "r"(c1) : "memory");
}'''


def tma_load_4d() -> str:
    """``cp.async.bulk.tensor.4d`` (PTX ISA "cp.async.bulk.tensor"): coordinates innermost first.

    flashgen's attention tensors map as (d_head, seq, heads, batch), so one map per tensor
    clips boxes at each sequence's end (zero fill) whatever the strides between heads.
    """
    return r'''// TMA: copy the box at (c0 column, c1 row, c2 head, c3 batch) of the tensor map `tmap` to shared
// `dst`; completion adds the box bytes to `bar`'s transaction count. Out-of-bounds elements read as 0.
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const void* tmap, uint32_t bar, int32_t c0, int32_t c1, int32_t c2, int32_t c3) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], [%2];\n"
                 :: "r"(dst), "l"(reinterpret_cast<uint64_t>(tmap)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3) : "memory");
}'''



def bulk_load() -> str:
    """``cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes`` (PTX ISA "cp.async.bulk"): a
    contiguous copy without a tensor map (16-byte aligned source, destination and size)."""
    return r'''// Bulk copy: `bytes` contiguous bytes from global `src` to shared `dst` (all 16-byte aligned); completion
// adds the bytes to `bar`'s transaction count.
__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}'''


def bulk_reduce_add() -> str:
    """``cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32`` (PTX ISA "cp.reduce.async.bulk")."""
    return r'''// Bulk reduction: `bytes` contiguous fp32 values of shared `src` added into global `dst` (16-byte aligned,
// elementwise atomic); one bulk group of this thread (bulk_commit_group / bulk_wait_group*).
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, uint32_t src, uint32_t bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                 :: "l"(dst), "r"(src), "r"(bytes) : "memory");
}'''


def tma_store_4d() -> str:
    """``cp.async.bulk.tensor.4d.global.shared::cta.bulk_group`` and its bulk-group completion
    (PTX ISA "cp.async.bulk.tensor", "cp.async.bulk.commit_group", "cp.async.bulk.wait_group")."""
    return r'''// TMA store: copy shared `src` to the box at (c0 column, c1 row, c2 head, c3 batch) of `tmap`; rows
// past the tensor's end are not written. The shared bytes must be visible to the async proxy first.
__device__ __forceinline__ void tma_store_4d(const void* tmap, uint32_t src, int32_t c0, int32_t c1, int32_t c2, int32_t c3) {
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n"
                 :: "l"(reinterpret_cast<uint64_t>(tmap)), "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3) : "memory");
}
// This thread's TMA stores issued so far form one bulk group.
__device__ __forceinline__ void bulk_commit_group() {
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
// Wait until at most N of this thread's bulk groups have not yet read their shared sources
// (the bytes may be rewritten then; the global writes may still be in flight).
template <int N>
__device__ __forceinline__ void bulk_wait_group_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;\n" :: "n"(N) : "memory");
}
// Wait until at most N of this thread's bulk groups are pending, their writes done.
template <int N>
__device__ __forceinline__ void bulk_wait_group() {
    asm volatile("cp.async.bulk.wait_group %0;\n" :: "n"(N) : "memory");
}'''


def fence_mbarrier_init() -> str:
    """``fence.mbarrier_init.release.cluster`` (PTX ISA "membar/fence"): initialised barriers visible to the async proxy."""
    return r'''// Make mbarrier.init visible to the TMA unit (async proxy) before any copy completes on it.
__device__ __forceinline__ void fence_mbarrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}'''


def named_barrier() -> str:
    """``bar.sync`` / ``bar.arrive`` with an id and a thread count (PTX ISA "bar, barrier")."""
    return r'''// Named barriers (id 1..15; 0 is __syncthreads): `threads` arrivals complete a phase.
// Arrive and wait for the phase to complete:
__device__ __forceinline__ void named_bar_sync(uint32_t id, uint32_t threads) {
    asm volatile("bar.sync %0, %1;\n" :: "r"(id), "r"(threads) : "memory");
}
// Arrive without waiting (a producer signalling a consumer):
__device__ __forceinline__ void named_bar_arrive(uint32_t id, uint32_t threads) {
    asm volatile("bar.arrive %0, %1;\n" :: "r"(id), "r"(threads) : "memory");
}'''


def smem_descriptor() -> str:
    """The wgmma matrix descriptor built on the device (fields of :class:`SmemDescriptor`)."""
    return r'''// wgmma shared-memory matrix descriptor: start>>4 | LBO>>4 << 16 | SBO>>4 << 32 | mode << 62.
// A later start is `desc + (bytes >> 4)` (the start field cannot carry: shared memory < 256 KiB).
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lbo, uint32_t sbo, uint32_t mode) {
    return uint64_t((addr & 0x3FFFFu) >> 4) | uint64_t(lbo >> 4) << 16 | uint64_t(sbo >> 4) << 32 | uint64_t(mode) << 62;
}'''


def fence_proxy_async() -> str:
    """``fence.proxy.async.shared::cta`` and ``.global`` (PTX ISA "membar/fence", proxy fences)."""
    return r'''// Order this thread's generic-proxy shared-memory accesses before later async-proxy ones
// (wgmma / TMA reading what st.shared or stmatrix wrote). Follow with a barrier.
__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// The same between the proxies' global-memory accesses (bulk reductions ordered by generic-proxy turn counters).
__device__ __forceinline__ void fence_proxy_async_global() {
    asm volatile("fence.proxy.async.global;\n" ::: "memory");
}'''


def wgmma_sync() -> str:
    """``wgmma.fence``, ``wgmma.commit_group``, ``wgmma.wait_group`` (PTX ISA "wgmma.fence", "wgmma.commit_group", "wgmma.wait_group")."""
    return r'''// Before the first wgmma of a sequence, and whenever its accumulators/A registers were touched.
__device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
// Close the group of wgmma.mma_async issued since the last commit.
__device__ __forceinline__ void wgmma_commit_group() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Wait until at most N committed wgmma groups are pending.
template <int N>
__device__ __forceinline__ void wgmma_wait_group() {
    static_assert(N >= 0 && N <= 7, "wgmma.wait_group N must be in 0..7");
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory");
}
// Keep the compiler from moving accesses of an in-flight accumulator across this point.
template <int N>
__device__ __forceinline__ void wgmma_fence_operands(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
        asm volatile("" : "+f"(d[i]) :: "memory");
    }
}
// The same for A fragments in registers: they stay live (unmoved) until the wgmma reading them is waited on.
template <int N>
__device__ __forceinline__ void wgmma_fence_operands(uint32_t (&a)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
        asm volatile("" : "+r"(a[i][0]), "+r"(a[i][1]), "+r"(a[i][2]), "+r"(a[i][3]) :: "memory");
    }
}'''


def setmaxnreg() -> str:
    """``setmaxnreg.{inc,dec}.sync.aligned.u32 N`` (PTX ISA "setmaxnreg"): N in 24..256, multiple of 8."""
    return r'''// Warpgroup register reallocation: producers give registers back, consumers take them.
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
    static_assert(N >= 24 && N <= 256 && N % 8 == 0, "setmaxnreg N must be a multiple of 8 in 24..256");
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
    static_assert(N >= 24 && N <= 256 && N % 8 == 0, "setmaxnreg N must be a multiple of 8 in 24..256");
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(N));
}'''


def wgmma_helper_name(atom: WGMMA_64xNx16, trans_b: bool = False, trans_a: bool = False) -> str:
    return f"wgmma_m64n{atom.n}k16_{atom.dtype.ptx}_ss{'_ta' if trans_a else ''}{'_tb' if trans_b else ''}"


def wgmma(atom: WGMMA_64xNx16, trans_b: bool = False, trans_a: bool = False) -> str:
    """``wgmma.mma_async`` with A and B from shared-memory descriptors (PTX ISA "wgmma.mma_async").

    ``name(float (&d)[N/2], uint64_t desc_a, uint64_t desc_b, int scale_d)``: ``d = A*B + (scale_d ? d : 0)``;
    A is K-major (``imm-trans-a = 0``) or, with ``trans_a``, MN-major (1); B K-major (``imm-trans-b = 0``)
    or, with ``trans_b``, MN-major (1).
    Accumulator register i is at (row, col) ``atom.c_map(thread, i)``.
    """
    n = atom.c_regs
    d_ops = ", ".join(f"%{i}" for i in range(n))
    d_cons = ",\n          ".join(", ".join(f'"+f"(d[{i}])' for i in range(j, min(j + 8, n))) for j in range(0, n, 8))
    tb, ta = int(trans_b), int(trans_a)
    majors = (", A transposed (MN-major)" if trans_a else "") + (", B transposed (MN-major)" if trans_b else "")
    return f'''// {atom.name}: D(64x{atom.n}, f32) += A(64x16, smem desc) * B(16x{atom.n}, smem desc){majors}.
// Issue between wgmma_fence() and wgmma_commit_group(); scale_d == 0 overwrites d.
__device__ __forceinline__ void {wgmma_helper_name(atom, trans_b, trans_a)}(float (&d)[{n}], uint64_t desc_a, uint64_t desc_b, int scale_d) {{
    asm volatile(
        "{{\\n"
        ".reg .pred p;\\n"
        "setp.ne.b32 p, %{n + 2}, 0;\\n"
        "{atom.ptx} {{{d_ops}}}, %{n}, %{n + 1}, p, 1, 1, {ta}, {tb};\\n"
        "}}\\n"
        : {d_cons}
        : "l"(desc_a), "l"(desc_b), "r"(scale_d)
        : "memory");
}}'''


def wgmma_rs_helper_name(atom: WGMMA_64xNx16, trans_b: bool = False) -> str:
    return f"wgmma_m64n{atom.n}k16_{atom.dtype.ptx}_rs{'_tb' if trans_b else ''}"


def wgmma_rs(atom: WGMMA_64xNx16, trans_b: bool = False) -> str:
    """``wgmma.mma_async`` with A from registers (4 x 32-bit, ``atom.a_map``) and B by descriptor;
    ``d = A*B + (scale_d ? d : 0)``."""
    n = atom.c_regs
    d_ops = ", ".join(f"%{i}" for i in range(n))
    d_cons = ",\n          ".join(", ".join(f'"+f"(d[{i}])' for i in range(j, min(j + 8, n))) for j in range(0, n, 8))
    return f'''// {atom.name.replace("_SS", "_RS")}: D(64x{atom.n}, f32) += A(64x16, registers) * B(16x{atom.n}, smem desc{", MN-major" if trans_b else ""}).
__device__ __forceinline__ void {wgmma_rs_helper_name(atom, trans_b)}(float (&d)[{n}], const uint32_t (&a)[4], uint64_t desc_b, int scale_d) {{
    asm volatile(
        "{{\\n"
        ".reg .pred p;\\n"
        "setp.ne.b32 p, %{n + 5}, 0;\\n"  // scale-d is a predicate operand: 0 overwrites d
        "{atom.ptx} {{{d_ops}}}, {{%{n}, %{n + 1}, %{n + 2}, %{n + 3}}}, %{n + 4}, p, 1, 1, {1 if trans_b else 0};\\n"
        "}}\\n"
        : {d_cons}
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d)
        : "memory");
}}'''


def warpgroup_index() -> str:
    """The thread's warpgroup, as a value the compiler knows is the same across the warp (``shfl.sync`` from lane 0)."""
    return r'''// The thread's warpgroup, broadcast from lane 0: the compiler then knows it is warp-uniform, so the shared-memory
// descriptors made from it stay in uniform registers (threadIdx.x / 128 put them in per-thread ones, two R2UR and a
// 64-bit add before every wgmma)
__device__ __forceinline__ uint32_t warpgroup_index() {
    return __shfl_sync(0xffffffffu, threadIdx.x / 128u, 0);
}'''


def helpers(atoms: tuple[WGMMA_64xNx16, ...] = ()) -> str:
    """All Hopper helpers in a fixed order, then one wgmma helper per atom (K-major B)."""
    parts = [mbarrier_init(), mbarrier_arrive_expect_tx(), mbarrier_wait(), tma_load_2d(), tma_load_4d(), bulk_load(), bulk_reduce_add(), tma_store_4d(),
             fence_mbarrier_init(), named_barrier(), smem_descriptor(), fence_proxy_async(), wgmma_sync(), setmaxnreg(),
             warpgroup_index()]
    parts += [wgmma(a) for a in atoms]
    return "\n".join(parts)
