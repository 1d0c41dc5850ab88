"""The backward's two memory-bound kernels around its main kernel, shared by both engines.

* ``preprocess``: ``D = rowsum(dO * O) - dlse`` per query row (the plan's :class:`~flashgen.attention.backward.RowDot`,
  16-byte loads: rows are 16-byte aligned by the launcher ABI), and zero of the fp32 dQ buffer the main kernel adds
  into (each CTA its rows' share; a separate fill of the buffer cost a launch and a pass over it);
* ``convert_dq``: dQ = the buffer times the softmax scale, in the inputs' dtype, 8 columns per thread and one
  16-byte store each. Both engines' buffers hold each query block as one chunk in the order their dQ adds write it.
  The mma.sync backward's order (:class:`~flashgen.dsl.dq_fragments.DqFragments`) keeps eight columns of two rows in
  64 contiguous bytes, which a thread reads straight; the wgmma backward's
  (:meth:`~flashgen.dsl.hopper_backward_smem.DqStage.index_cpp`) a CTA stages in shared memory with 16-byte loads in
  the chunk's own order before it gathers rows from it (gathering from global memory read one scattered 4-byte word
  per element: 2.5x the time of the other backwards' conversions on an H200).

Both are bound by memory: on an H200 at 16k tokens, 16 heads of 128 they move 268 and 201 MB.
"""
from __future__ import annotations

from ..dsl.dq_fragments import DqFragments
from ..dsl.hopper_backward_smem import DqStage
from .template import CodeTemplate

#: the preprocess; ``$rows``: the dQ buffer's rows a head (the wgmma one's padded), ``$stats``: what it writes per row
_PREPROCESS = CodeTemplate(
    r"""// D = rowsum(dO * O) - dlse: ROWDOT_LANES threads per query row; grid (ceil($rows * ROWDOT_LANES / 128), heads, batch).
// Also zeroes the CTA's rows' share of the head's fp32 dQ buffer ($rows x D_HEAD floats a head, in any order).
__global__ void __launch_bounds__(128) preprocess(const __grid_constant__ Params p) {
    static_assert(D_HEAD % 8 == 0, "16-byte chunks of rows and of the dQ buffer");
    const int64_t head = int64_t(blockIdx.z) * p.heads + blockIdx.y;
    {
        float4* acc = reinterpret_cast<float4*>(p.dq_accum + head * $rows * D_HEAD);
        const int64_t end = dq_zero_end(blockIdx.x, $rows);
        for (int64_t i = dq_zero_first(blockIdx.x) + threadIdx.x; i < end; i += 128) acc[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    const int row = int((blockIdx.x * 128 + threadIdx.x) / ROWDOT_LANES);
    const int lane = int(threadIdx.x % ROWDOT_LANES);
    const bool ok = row < p.seq_q;
    const int r = ok ? row : 0;
    const elem_t* dO = p.dout + blockIdx.z * p.do_batch + blockIdx.y * p.do_head + int64_t(r) * p.do_ld;
    const elem_t* O = p.o + blockIdx.z * p.o_batch + blockIdx.y * p.o_head + int64_t(r) * p.o_ld;
    const float d = rowdot_reduce(ok ? rowdot_partial(dO, O, lane, int(D_HEAD)) : 0.f);
    // lse's gradient g adds scale * P * g to the scores' (d lse / dS = scale * P): the same as D - g
    const int64_t at = head * p.seq_q + row;
    $stats
}"""
)

#: Which part of the work a block or thread of the two kernels takes (host and device: tests run them on the host)
SLOTS = r"""// the preprocess block `block`'s share of a head's dQ buffer of `rows` rows (128 / ROWDOT_LANES rows' floats): the
// float4s [dq_zero_first(block), dq_zero_end(block, rows)); the blocks of a launch cover the buffer once
__host__ __device__ __forceinline__ int64_t dq_zero_first(int64_t block) { return block * (128 / ROWDOT_LANES * int64_t(D_HEAD) / 4); }
__host__ __device__ __forceinline__ int64_t dq_zero_end(int64_t block, int64_t rows) {
    const int64_t end = dq_zero_first(block + 1), all = rows * (int64_t(D_HEAD) / 4);
    return end < all ? end : all;
}"""

#: the chunked conversion's thread slots (after :data:`SLOTS`; needs ``B_r``)
CHUNK_SLOTS = r"""// slot i of a query block's conversion: row convert_row(i), columns [convert_col(i), + 8). A warp's lanes l and
// l + 16 one 32-byte sector of a row, lanes 0-15 sixteen consecutive rows (which the staged chunk's fragment order
// spreads over the banks), then the next 16 rows, then the next 16 columns
__host__ __device__ __forceinline__ uint32_t convert_row(uint32_t i) { return i % 16 + 16 * (i / 32 % (B_r / 16)); }
__host__ __device__ __forceinline__ uint32_t convert_col(uint32_t i) { return 8 * (i / 16 % 2 + 2 * (i / (2 * B_r))); }
// the column (from convert_col(i)) of slot i's read k of the staged chunk, rotated per slot so that the lanes of one
// shared-memory phase hit different banks (dq_chunk_index's order, DQ_VEC floats a slot): of four 8-byte column
// pairs, pair (k + convert_pair_rot(i)) % 4; of eight single columns, column k ^ convert_each_rot(i)
__host__ __device__ __forceinline__ uint32_t convert_pair_rot(uint32_t i) { return convert_row(i) / (8 / DQ_VEC) % 4; }
__host__ __device__ __forceinline__ uint32_t convert_each_rot(uint32_t i) { return convert_row(i) / 8 % 2 + convert_col(i) / 8 % 2 * 2; }
__host__ __device__ __forceinline__ uint32_t convert_pair_read(uint32_t i, uint32_t k) { return 2 * ((k + convert_pair_rot(i)) % 4); }
__host__ __device__ __forceinline__ uint32_t convert_each_read(uint32_t i, uint32_t k) { return k ^ convert_each_rot(i); }"""

#: D per query row (the mma.sync kernel reads it with the rows' lse)
_STATS = ["if (ok && lane == 0) p.delta[at] = p.dlse != nullptr ? d - p.dlse[at] : d;"]
#: D and lse * log2(e) per row of whole query blocks (``stat_len`` rows): what the wgmma kernel's bulk copies load
_PADDED_STATS = [
    "if (lane == 0 && row < p.stat_len) {  // rows past seq_q: D 0 and lse_log2 +inf, so their P is 0",
    "    const int64_t padded = head * p.stat_len + row;",
    "    p.delta[padded] = !ok ? 0.f : p.dlse != nullptr ? d - p.dlse[at] : d;",
    "    p.lse_log2[padded] = ok ? bwd_lse_log2(p.lse[at]) : INFINITY;",
    "}",
]

#: eight fp32 dQ sums -> eight scaled 16-bit values in one 16-byte store (``dst`` 16-byte aligned: the ABI's rows)
_STORE8 = r"""// eight dQ sums times the scale, in elem_t, as one 16-byte store (st_global_v4: nvcc split a plain 16-byte store of a
// 16-bit type's row in four)
__device__ __forceinline__ uint32_t dq_pair(float lo, float hi, float scale) {
    const elem_t a = elem_t(bwd_grad_scaled(lo, scale)), b = elem_t(bwd_grad_scaled(hi, scale));
    uint16_t ua, ub;
    memcpy(&ua, &a, 2);
    memcpy(&ub, &b, 2);
    return uint32_t(ua) | uint32_t(ub) << 16;
}
__device__ __forceinline__ void store_dq8(elem_t* dst, const float (&v)[8], float scale) {
    st_global_v4(dst, make_uint4(dq_pair(v[0], v[1], scale), dq_pair(v[2], v[3], scale), dq_pair(v[4], v[5], scale),
                                 dq_pair(v[6], v[7], scale)));
}"""

_CONVERT_FRAGMENTS = CodeTemplate(
    r"""$store8

// dQ = dq_accum * scale (the buffer in chunks of whole query blocks in the dQ adds' fragment order, DqFragments): a
// thread one unit of four 16-byte slots (64 contiguous bytes), eight columns of two rows 8 apart; grid
// (ceil(query blocks * DQ_UNITS / 256), heads, batch)
__global__ void __launch_bounds__(256) convert_dq(const __grid_constant__ Params p) {
    const int64_t i = int64_t(blockIdx.x) * 256 + threadIdx.x;
    if (i >= (p.seq_q + int64_t(B_r) - 1) / B_r * DQ_UNITS) return;
    const int qb = int(i / DQ_UNITS);
    const uint32_t u = uint32_t(i % DQ_UNITS), col = dq_unit_col(u);
    const int row = qb * int(B_r) + int(dq_unit_row(u));
    if (col >= D_HEAD) return;  // padding columns of dQ's tiles: never added
    const int64_t head = int64_t(blockIdx.z) * p.heads + blockIdx.y;
    const float4* src = reinterpret_cast<const float4*>(p.dq_accum + head * dq_head_rows(p.seq_q) * D_HEAD + int64_t(qb) * DQ_CHUNK) + 4 * u;
    const float4 s0 = src[0], s1 = src[1], s2 = src[2], s3 = src[3];  // lane q of the group: columns 2q, 2q + 1 of both rows
    const float upper[8] = {s0.x, s0.y, s1.x, s1.y, s2.x, s2.y, s3.x, s3.y}, lower[8] = {s0.z, s0.w, s1.z, s1.w, s2.z, s2.w, s3.z, s3.w};
    elem_t* dq = p.dq + blockIdx.z * p.dq_batch + blockIdx.y * p.dq_head + col;
    if (row < p.seq_q) store_dq8(dq + int64_t(row) * p.dq_ld, upper, p.scale);
    if (row + 8 < p.seq_q) store_dq8(dq + int64_t(row + 8) * p.dq_ld, lower, p.scale);
}"""
)

_CONVERT_CHUNKED = CodeTemplate(
    r"""$store8

// dQ = dq_accum * scale (the buffer in chunks of whole query blocks, dq_chunk_index's order); one CTA a query block:
// its chunk staged in shared memory with 16-byte loads, then a thread 8 columns of a row (convert_row, convert_col),
// read from the chunk without bank conflicts; grid (stat_len / B_r, heads, batch)
__global__ void __launch_bounds__(256) convert_dq(const __grid_constant__ Params p) {
    static_assert(B_r * D_HEAD * 4 <= 48 * 1024, "a query block's chunk fits static shared memory");
    __shared__ __align__(16) float chunk[B_r * D_HEAD];
    const int64_t head = int64_t(blockIdx.z) * p.heads + blockIdx.y;
    const float4* src = reinterpret_cast<const float4*>(p.dq_accum + (head * (p.stat_len / int(B_r)) + blockIdx.x) * (B_r * D_HEAD));
    for (uint32_t i = threadIdx.x; i < B_r * D_HEAD / 4; i += 256) reinterpret_cast<float4*>(chunk)[i] = src[i];
    __syncthreads();
    const int row0 = int(blockIdx.x * B_r), rows = min(int(B_r), p.seq_q - row0);
    elem_t* dq = p.dq + blockIdx.z * p.dq_batch + blockIdx.y * p.dq_head;
    static_assert(B_r % 16 == 0 && D_HEAD % 16 == 0, "16-row groups of pairs of 8-column groups");
    for (uint32_t i = threadIdx.x; i < B_r * (D_HEAD / 8); i += 256) {
        const uint32_t r = convert_row(i), c = convert_col(i);
        if (int(r) >= rows) continue;  // the last block's padding rows
        float v[8];
        $gather
        store_dq8(dq + int64_t(row0 + int(r)) * p.dq_ld + c, v, p.scale);
    }
}"""
)

#: the eight values of row r from column c (c % 8 == 0) out of the staged chunk, in the order of
#: :data:`CHUNK_SLOTS`'s rotations (undone with selects: a runtime index into v would put it in local memory): four
#: 8-byte reads where a row's column pairs are contiguous in fragment order (dQ tiles: a thread's 16-byte slot holds
#: two columns of two rows), else one read each (dQ^T tiles: consecutive rows adjoin)
_GATHER_PAIRS = ["const uint32_t rot = convert_pair_rot(i);", "float2 x[4];", "#pragma unroll",
                 "for (uint32_t k = 0; k < 4; ++k) x[k] = *reinterpret_cast<const float2*>(chunk + dq_chunk_index(r, c + convert_pair_read(i, k)));",
                 "#pragma unroll", "for (uint32_t j = 0; j < 4; ++j) {  // pair j was read as x[(j - rot) % 4]",
                 "    const float2 y = rot == 0 ? x[j] : rot == 1 ? x[(j + 3) % 4] : rot == 2 ? x[(j + 2) % 4] : x[(j + 1) % 4];",
                 "    v[2 * j] = y.x; v[2 * j + 1] = y.y;", "}"]
_GATHER_EACH = ["const uint32_t rot = convert_each_rot(i);", "float x[8];", "#pragma unroll",
                "for (uint32_t k = 0; k < 8; ++k) x[k] = chunk[dq_chunk_index(r, c + convert_each_read(i, k))];",
                "#pragma unroll", "for (uint32_t e = 0; e < 8; ++e) v[e] = rot == 0 ? x[e] : rot == 1 ? x[e ^ 1] : rot == 2 ? x[e ^ 2] : x[e ^ 3];"]


def aux_kernels(buffer: "DqStage | DqFragments") -> str:
    """The preprocess and the dQ conversion of a backward file (inside its namespace, after ``Params``), for the
    order of its dQ buffer.

    :class:`DqStage`: the wgmma backward's (chunks of whole query blocks, ``dq_chunk_index``): the preprocess then
    writes D and lse * log2(e) for ``p.stat_len`` rows (whole query blocks) and zeroes the padded buffer.
    :class:`DqFragments`: the mma.sync backward's (chunks in the dQ adds' fragment order, after the kernel's
    ``dq_head_rows``, ``dq_unit_row`` / ``_col``): the preprocess zeroes ``dq_head_rows(seq_q)`` rows a head."""
    if isinstance(buffer, DqFragments):
        return "\n\n".join([SLOTS, _PREPROCESS.substitute(rows="dq_head_rows(p.seq_q)", stats=_STATS),
                             _CONVERT_FRAGMENTS.substitute(store8=_STORE8)])
    gather = _GATHER_EACH if buffer.transposed else _GATHER_PAIRS
    return "\n\n".join([SLOTS, CHUNK_SLOTS, _PREPROCESS.substitute(rows="p.stat_len", stats=_PADDED_STATS),
                        _CONVERT_CHUNKED.substitute(store8=_STORE8, gather=gather)])


def convert_grid(buffer: "DqStage | DqFragments") -> str:
    """The launch grid of ``convert_dq`` for the order of the dQ buffer (C++, from the launcher's ``a`` and the
    wgmma launcher's ``stat_len``)."""
    if isinstance(buffer, DqFragments):
        return "dim3(unsigned(((a->seq_q + int64_t(B_r) - 1) / B_r * DQ_UNITS + 255) / 256), a->heads, a->batch)"
    return "dim3(stat_len / B_r, a->heads, a->batch)"
