"""A mask_mod's block mask as C++: the kernels that make it and the functions that read it.

The block mask (:meth:`flashgen.mods.KernelMods.block_mask_shape`) classifies blocks of a call's scores as
empty, partial or full. A forward kernel's has a row per (batch, head, query block) and a class per key
block; a backward kernel's is transposed, in its own block sizes: a row per (batch, head, key block), a
class per query block. Both are made on the GPU by the same two kernels (:func:`kernels_cpp`), exported
from the kernel's translation unit with its entry points, and read in the kernels by the functions of
:func:`reading_cpp`; :mod:`flashgen.sim.block_mask` is the numpy twin of both.
"""
from __future__ import annotations

from typing import Any

#: A tile's cost in the block mask's tile order (:meth:`flashgen.attention.scheduler.TileScheduler.order`): per key
#: block it keeps, 1 if full and this if partial (the mask_mod's arithmetic: on an H100 about twice a full block).
PARTIAL_BLOCK_COST = 2


def _row_cpp(mods: Any, block: str, n_blocks: str) -> str:
    """The index of a block mask row: batch and head only where the mask_mod reads them."""
    b = "b" if mods.uses("b") else "0"
    extent, h = ("heads", "h") if mods.uses("h") else ("1", "0")
    return f"(({b}) * {extent} + {h}) * {n_blocks} + {block}"


def reading_cpp(mods: Any, backward: bool = False, ordered: bool = False) -> str:
    """The forward's reading functions (``block_mask_row``, ``_clip``, ``_next``, ``_partial``; ``ordered``: and
    ``block_mask_order``, where its tile order starts) or, ``backward``, the transposed mask's
    (``bwd_block_mask_row``, ``_clip``, ``_partial``)."""
    if not backward:
        fns = _BLOCK_MASK_FNS + (_TILE_ORDER_FNS if ordered else "")
        return fns.replace("$ROW", _row_cpp(mods, "qb", "n_qb")).replace("$CLASSES", _classes_cpp(mods))
    return _BWD_BLOCK_MASK_FNS.replace("$ROW", _row_cpp(mods, "kb", "n_kb")).replace("$GROUP", "group" if mods.uses("h") else "1")


def _classes_cpp(mods: Any) -> str:
    """The int32 count of a forward block mask's rows (before its tile order), of ``batch``, ``heads``, ``n_qb`` and
    ``n_kb``."""
    nb, nh = ("batch" if mods.uses("b") else "1"), ("heads" if mods.uses("h") else "1")
    return f"int64_t({nb}) * {nh} * n_qb * (2 + n_kb)"


def kernels_cpp(mods: Any, name: str, transposed: bool = False, ordered: bool = False) -> str:
    """The block mask's kernels, ``<name>_block_mask_numel(args)`` and ``<name>_mask_blocks(args, out, stream)``
    (``args`` the TU's own argument struct). ``transposed``: the backward's; ``ordered`` (a forward whose scheduler
    takes one, :mod:`flashgen.attention.scheduler`): the rows are followed by the tile order, made by a third
    kernel (``sched_order``)."""
    fill = "\n".join("    " + l for l in mods.fill_cpp(p="m", scales=False))
    fields = " ".join(f.split("//")[0].strip() for f in mods.params_cpp())
    rows, classes, what = ("kb", "qb", "query") if transposed else ("qb", "kb", "key")
    order_kernel, order_launch, order_numel = ("", "", "")
    if ordered:
        order_kernel = _ORDER_KERNEL.replace("$COST", str(PARTIAL_BLOCK_COST))
        order_launch, order_numel = _ORDER_LAUNCH, " + n_qb * a->heads * a->batch"
    return _MASK_BLOCKS.replace("$ORDER_KERNEL", order_kernel).replace("$ORDER_LAUNCH", order_launch).replace(
        "$ORDER_NUMEL", order_numel).replace("$NAME", name).replace("$FILL", fill).replace("$FIELDS", fields).replace(
        "$NH", "a->heads" if mods.uses("h") else "1").replace("$NB", "a->batch" if mods.uses("b") else "1").replace(
        "$RB", rows).replace("$CB", classes).replace("$CWHAT", what)


#: Reading the block mask (:meth:`flashgen.mods.KernelMods.block_mask_shape`); ``$ROW`` indexes its rows.
_BLOCK_MASK_FNS = """
// ---- block mask: per (batch, head, query block) the kept key blocks [lo, hi), then a class per key block
// (0 empty, 1 partial, 2 full), made by <name>_mask_blocks; nullptr: every block partial, none skipped
__host__ __device__ __forceinline__ const int* block_mask_row(const int* bm, int b, int h, int qb, int heads, int seq_q, int seq_k) {
    (void)b; (void)h; (void)heads;
    if (bm == nullptr) return nullptr;
    const int n_qb = (seq_q + int(B_r) - 1) / int(B_r), n_kb = (seq_k + int(B_c) - 1) / int(B_c);
    return bm + int64_t($ROW) * (2 + n_kb);
}
// [j_begin, j_end) narrowed to the row's [lo, hi), then to its first and last non-empty block (never reversed)
__host__ __device__ __forceinline__ void block_mask_clip(const int* r, int* j_begin, int* j_end) {
    if (r == nullptr) return;
    if (r[0] > *j_begin) *j_begin = r[0];
    if (r[1] < *j_end) *j_end = r[1];
    if (*j_end < *j_begin) *j_end = *j_begin;
    while (*j_begin < *j_end && r[2 + *j_begin] == 0) ++*j_begin;  // a split tile's part may start or end
    while (*j_end > *j_begin && r[2 + *j_end - 1] == 0) --*j_end;    // on an empty block
}
// The key block a tile walks after block j of its clipped [j_begin, j_end): the next non-empty one, else j_end
__host__ __device__ __forceinline__ int block_mask_next(const int* r, int j, int j_end) {
    if (r == nullptr) return j + 1;
    for (++j; j < j_end && r[2 + j] == 0; ++j) {}
    return j;
}
__host__ __device__ __forceinline__ bool block_mask_partial(const int* r, int kb) { return r == nullptr || r[2 + kb] != 2; }"""

#: Reading a forward block mask's tile order (after its rows; ``$CLASSES`` counts them).
_TILE_ORDER_FNS = """
// The block mask's tile order (sched_order): after its rows, the tile at each position of a launch (sched_work's tile)
__host__ __device__ __forceinline__ const int* block_mask_order(const int* bm, int batch, int heads, int seq_q, int seq_k) {
    (void)batch; (void)heads;
    const int n_qb = (seq_q + int(B_r) - 1) / int(B_r), n_kb = (seq_k + int(B_c) - 1) / int(B_c);
    return bm + $CLASSES;
}"""

#: Reading the backward's (transposed) block mask: ``$ROW`` indexes its rows, ``$GROUP`` counts the rows a CTA's
#: kv head reads (its group's query heads where the mask_mod reads h, else its one row).
_BWD_BLOCK_MASK_FNS = """
// ---- block mask (backward): per (batch, head, key block) the query blocks [lo, hi) holding a kept score, then a
// class per query block (0 empty, 1 partial, 2 full), made by <name>_mask_blocks; nullptr: every block partial
__host__ __device__ __forceinline__ const int* bwd_block_mask_row(const int* bm, int b, int h, int kb, int heads, int seq_q, int seq_k) {
    (void)b; (void)h; (void)heads;
    if (bm == nullptr) return nullptr;
    const int n_qb = (seq_q + int(B_r) - 1) / int(B_r), n_kb = (seq_k + int(B_c) - 1) / int(B_c);
    return bm + int64_t($ROW) * (2 + n_qb);
}
// [qb_begin, qb_end) narrowed to the union of the rows' [lo, hi) over query heads h0 .. h0 + group - 1 (never reversed)
__host__ __device__ __forceinline__ void bwd_block_mask_clip(const int* bm, int b, int h0, int group, int kb, int heads, int seq_q, int seq_k,
                                                             int* qb_begin, int* qb_end) {
    (void)group;
    if (bm == nullptr) return;
    int lo = 0, hi = 0;  // the union; empty until a non-empty row
    for (int g = 0; g < $GROUP; ++g) {
        const int* r = bwd_block_mask_row(bm, b, h0 + g, kb, heads, seq_q, seq_k);
        if (r[1] <= r[0]) continue;
        lo = hi > lo && lo < r[0] ? lo : r[0];
        hi = hi > r[1] ? hi : r[1];
    }
    if (hi <= lo) { *qb_end = *qb_begin; return; }  // no kept score in this key block
    if (lo > *qb_begin) *qb_begin = lo;
    if (hi < *qb_end) *qb_end = hi;
    if (*qb_end < *qb_begin) *qb_end = *qb_begin;
}
// whether work item (query head h, query block qb) of key block kb takes the masked path: not a full block
__host__ __device__ __forceinline__ bool bwd_block_mask_partial(const int* bm, int b, int h, int kb, int qb, int heads, int seq_q, int seq_k) {
    const int* r = bwd_block_mask_row(bm, b, h, kb, heads, seq_q, seq_k);
    return r == nullptr || r[2 + qb] != 2;
}"""

#: The block mask's two kernels and their C entry point; ``$FILL`` fills ``m.mask_args`` from the words; ``$RB``:
#: the blocks of a row (qb forward, kb backward), ``$CB`` those with a class in it (kb, qb), ``$CWHAT`` their name.
_MASK_BLOCKS = """
namespace $NAME {
// one CTA per (key block, query block, batch x head of the mask): does the mask_mod keep all, some or none
__global__ void mask_blocks_kernel(const mask_mod_args ma, int seq_q, int seq_k, int nh, int n_qb, int n_kb, int* out) {
    const int kb = blockIdx.x, qb = blockIdx.y, b = int(blockIdx.z) / nh, h = int(blockIdx.z) % nh;
    bool any = false, all = true;
    for (int e = threadIdx.x; e < int(B_r * B_c); e += blockDim.x) {
        const int i = qb * int(B_r) + e / int(B_c), j = kb * int(B_c) + e % int(B_c);
        if (i < seq_q && j < seq_k) {  // the key tail is the kernels' own rule
            const bool keep = mask_mod(b, h, i, j, ma);
            any = any || keep;
            all = all && keep;
        }
    }
    any = __syncthreads_or(any);
    all = __syncthreads_and(all);
    if (threadIdx.x == 0) out[(int64_t(blockIdx.z) * n_$RB + $RB) * (2 + n_$CB) + 2 + $CB] = any ? (all ? 2 : 1) : 0;
}
// one thread per row: the range [lo, hi) of its non-empty $CWHAT blocks ([0, 0) when there is none)
__global__ void mask_ranges_kernel(int rows, int n_$CB, int* out) {
    const int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= rows) return;
    int* r = out + int64_t(row) * (2 + n_$CB);
    int lo = n_$CB, hi = 0;
    for (int $CB = 0; $CB < n_$CB; ++$CB)
        if (r[2 + $CB] != 0) { lo = $CB < lo ? $CB : lo; hi = $CB + 1; }
    r[0] = lo < hi ? lo : 0;
    r[1] = hi;
}$ORDER_KERNEL
}  // namespace $NAME

// The int32 count of the block mask of a call with these sizes (KernelMods.block_mask_shape); 0 for invalid sizes.
extern "C" int64_t $NAME_block_mask_numel(const $NAME_args* a) {
    using namespace $NAME;
    if (a->batch <= 0 || a->heads <= 0 || a->seq_q <= 0 || a->seq_k <= 0) return 0;
    const int64_t nb = $NB, nh = $NH, n_qb = (a->seq_q + int(B_r) - 1) / int(B_r), n_kb = (a->seq_k + int(B_c) - 1) / int(B_c);
    return nb * nh * n_$RB * (2 + n_$CB)$ORDER_NUMEL;
}

// The block mask of a call with these arguments into `out` (int32, KernelMods.block_mask_shape), on `stream`.
extern "C" int $NAME_mask_blocks(const $NAME_args* a, int* out, void* stream) {
    using namespace $NAME;
    if (a->batch <= 0 || a->heads <= 0 || a->seq_q <= 0 || a->seq_k <= 0 || out == nullptr) return (int)cudaErrorInvalidValue;
    struct { $FIELDS } m{};  // the mods' values (the forward's fields; no scale is filled: no softmax runs)
$FILL
    const int nb = $NB, nh = $NH, n_qb = (a->seq_q + int(B_r) - 1) / int(B_r), n_kb = (a->seq_k + int(B_c) - 1) / int(B_c);
    mask_blocks_kernel<<<dim3(n_kb, n_qb, nb * nh), 128, 0, (cudaStream_t)stream>>>(m.mask_args, a->seq_q, a->seq_k, nh, n_qb, n_kb, out);
    const int rows = nb * nh * n_$RB;
    mask_ranges_kernel<<<(rows + 127) / 128, 128, 0, (cudaStream_t)stream>>>(rows, n_$CB, out);$ORDER_LAUNCH
    return (int)cudaGetLastError();
}"""

#: The tile order's kernel (in the block mask's namespace): one CTA runs sched_order over the tiles' costs.
_ORDER_KERNEL = """
// one CTA: the tile order after the rows (sched_order) of a launch on `ctas` CTAs; a tile's cost: per key block it
// walks (its row's [lo, hi) within the built-in mask's kv_block_range), 1 if full and $COST if partial
__global__ void __launch_bounds__(SCHED_ORDER_MAX_CTAS) mask_order_kernel(int* bm, int batch, int heads, int seq_q, int seq_k,
                                                                          int mask_offset, int window_left, int window_right, int ctas) {
    __shared__ int w[SCHED_ORDER_ROUNDS * SCHED_ORDER_MAX_CTAS], ranked[SCHED_ORDER_ROUNDS * SCHED_ORDER_MAX_CTAS];
    __shared__ int load[SCHED_ORDER_MAX_CTAS], turn[SCHED_ORDER_MAX_CTAS];
    const int n_qb = (seq_q + int(B_r) - 1) / int(B_r);
    const auto cost = [&](int tile) {
        int qb, h, b;
        sched_coords(tile, n_qb, heads, &qb, &h, &b);
        const int* r = block_mask_row(bm, b, h, qb, heads, seq_q, seq_k);
        int lo, hi, c = 0;  // the key blocks the tile walks, as tile_at clips them
        kv_block_range(qb * int(B_r), seq_q, seq_k, mask_offset, window_left, window_right, &lo, &hi);
        block_mask_clip(r, &lo, &hi);
        for (int kb = lo; kb < hi; ++kb) c += r[2 + kb] == 2 ? 1 : r[2 + kb] == 1 ? $COST : 0;
        return c;
    };
    int* order = const_cast<int*>(block_mask_order(bm, batch, heads, seq_q, seq_k));
    const int tiles = n_qb * heads * batch;
    if (ctas > SCHED_ORDER_MAX_CTAS) {  // more SMs than one CTA deals to: the scheduler's own order
        for (int t = threadIdx.x; t < tiles; t += blockDim.x) order[t] = t;
        return;
    }
    sched_order(tiles, ctas, int(threadIdx.x), int(blockDim.x), cost, w, ranked, load, turn, order);
}"""

#: Launching it, in ``<name>_mask_blocks``: the width of a round of an ordered launch (one CTA per SM, the launcher's
#: ``sm_count``, at most one per tile).
_ORDER_LAUNCH = """
    int sms = 0;
    if (const int e = sm_count(&sms)) return e;
    const int64_t tiles = int64_t(n_qb) * a->heads * a->batch;
    const int ctas = int(tiles < sms ? tiles : sms);
    mask_order_kernel<<<1, SCHED_ORDER_MAX_CTAS, 0, (cudaStream_t)stream>>>(out, a->batch, a->heads, a->seq_q, a->seq_k,
                                                                           a->mask_offset, a->window_left, a->window_right, ctas);"""
