"""HopperPlan -> standalone CUDA C++ (sm_90a): TMA producer, wgmma consumers, named-barrier pingpong.

Same file shape as :mod:`flashgen.emit.kernel` (header with the plan, PTX helpers, the
kernel, an ``extern "C"`` launcher taking the same argument struct (:mod:`flashgen.emit.abi`), so one
launcher calls both engines' kernels). The launcher builds the three TMA tensor maps per call
(``cuTensorMapEncodeTiled`` through the runtime's driver entry point: no -lcuda).
Every shared-memory address, descriptor field, barrier count and the step order come
from :func:`flashgen.dsl.hopper_plan.make_hopper_plan`.
"""
from __future__ import annotations

import json

from ..attention.epilogue import epilogue
from ..attention.softmax import online_softmax
from ..dsl.config import LOG2E, WGMMA_M
from ..dsl.hopper_plan import HopperPlan, TmaTile
from ..dsl.steps import Block, ConvertP, Gemm, Pass, Release, RescaleO, Softmax, Step, Turn, WaitFull, WgmmaWait
from ..targets import Target, named as target_named
from .abi import args_struct
from .ptx import hopper as ptx_hopper, ldmatrix, math as ptx_math, vec
from .ptx.used import HELPERS_MARK, insert_used
from .source import KernelSource, kernel_meta
from .template import SMEM_ATTRIBUTE, CodeTemplate, compose

#: What this emitter writes for: TMA, mbarriers, wgmma and setmaxnreg exist on sm_90a only.
TARGET: Target = target_named("sm_90a")


#: What each consumer GEMM reads: its accumulator, where the emitter can stage A (Q: its shared-memory
#: descriptor, or its A fragments when the plan loads them; P: only the fragments converted from S),
#: and B's ring tile. The plan says where A comes from and how B is laid out; a plan asking for an A
#: source not staged here is refused.
_GEMM_OPERANDS = {"S": ("s_acc", {"smem": "desc_q", "regs": "q_frag"}, "K", "desc_k"),
                  "O": ("o_acc", {"regs": "p_frag"}, "V", "desc_v")}


def _wgmma_helper(g) -> str:
    """The emitted wgmma helper a plan GEMM calls: A from shared memory or registers, B K- or MN-major."""
    name = ptx_hopper.wgmma_helper_name if g.a_from == "smem" else ptx_hopper.wgmma_rs_helper_name
    return name(g.atom, g.trans_b)


def _gemm(plan: HopperPlan, which: str, block: Block) -> list[str]:
    """One consumer GEMM: fence, ``k_steps`` wgmma with constant descriptor offsets, commit."""
    g = plan.gemm_S if which == "S" else plan.gemm_O
    acc, sources, b_tile, desc_b = _GEMM_OPERANDS[which]
    if g.a_from not in sources or (which == "S" and (g.a_from == "regs") != (plan.q_load is not None)):
        raise NotImplementedError(f"GEMM {which} with A from {g.a_from}: the emitter stages A of {which} in {' or '.join(sources)}"
                                  + (" (registers: with the plan's Q fragment load)" if which == "S" else ""))
    a = sources[g.a_from]
    stage = _stage_of(block)
    b_addr = [f"{desc_b} + uint64_t({stage}) * {plan.tiles[b_tile].stage_bytes >> 4}u + {boff >> 4}u" for boff in g.b.step_offsets]
    # S starts its accumulator at the first k step (scale-d 0; where the score rule put a bias there, onto it:
    # ScoreMask.init_cpp); O accumulates onto the rescaled O
    adds = plan.score_mask.s_gemm_adds_cpp() if which == "S" else "true"
    scale = [{"false": 0, "true": 1}.get(adds, adds)] + [1] * (len(b_addr) - 1)
    if g.a_from == "smem":
        calls = [f"{_wgmma_helper(g)}({acc}, {a} + {off >> 4}u, {b}, {sc});" for off, b, sc in zip(g.a.step_offsets, b_addr, scale)]
    else:
        calls = [f"{_wgmma_helper(g)}({acc}, {a}[{t}], {b}, {sc});" for t, (b, sc) in enumerate(zip(b_addr, scale))]
    fence = [f"wgmma_fence_operands({acc});"] + ([f"wgmma_fence_operands({a});"] if g.a_from == "regs" else [])
    return fence + ["wgmma_fence();"] + calls + ["wgmma_commit_group();", f"wgmma_fence_operands({acc});"]


def _fragment_rows(plan: HopperPlan) -> dict:
    """Where the score rule finds a consumer thread's S values: its row halves, their global row and first
    key column, the tile's batch and head. Values (4*chunk + 2h + e): row half h, column 8*chunk + e +
    col(thread, 0); proven on the map by flashgen.sim.verify."""
    c = plan.gemm_S.atom.c_map
    return dict(loops=["for (uint32_t h = 0; h < 2; ++h)"], i=f"q_row0 + int(64 * cw + {c.row.to_cpp(['wtid', '2 * h'])})",
                c0=f"j * int(B_c) + int({c.col.to_cpp(['wtid', '0'])})", b="batch", h="head")


def _softmax(plan: HopperPlan, first: bool) -> list[str]:
    """Mask (masked blocks only), then the online softmax (flashgen.attention.softmax) of both row
    halves; ``corr`` keeps O's rescale factors for the rescale_O step."""
    rule = plan.score_mask.apply_cpp(value="s_acc[4 * {t} + 2 * h + e]", bits="mask_bits[h]", **_fragment_rows(plan))
    return rule + [
        "#pragma unroll",
        "for (uint32_t h = 0; h < 2; ++h) {",
        "    float neg_m;",
        "    const float c = softmax_max_step(s_acc, h, row_max[h], scale_log2, neg_m);",
        f"    softmax_exp_step(s_acc, h, row_sum[h], scale_log2, neg_m, c, {'true' if first else 'false'});",
        # the first block of a tile has nothing to rescale; later ones keep the factor for O (rescaled once PV is done)
        *([] if first else ["    corr[h] = c;"]),
        "}",
    ]


def _convert_p(plan: HopperPlan) -> list[str]:
    out = [f"// P -> A fragments of P V (plan.p_from_s: which S values each 32-bit A register packs)"]
    for t, regs in enumerate(plan.p_from_s):
        out.append(" ".join(f"p_frag[{t}][{r}] = pack2(s_acc[{lo}], s_acc[{hi}]);" for r, (lo, hi) in enumerate(regs)))
    return out


def _stage_of(block: Block) -> str:
    """The ring stage variable of a block: ``st`` (block j), ``st_prev`` (j-1; the last block, whose steps
    run after the loop with ``j = j_end``)."""
    return "st_prev" if block.offset == -1 else "st"


def _stage(step: Step) -> str:
    """The ring stage variable of a K/V step's block; "" for Q (one slot)."""
    return _stage_of(step.block) if step.arg != "Q" else ""


def _wait_full(plan: HopperPlan, step: WaitFull) -> list[str]:
    stage = _stage(step)
    if not stage:  # Q: one slot, one phase per tile
        return [f"mbar_wait(bar_{step.arg.lower()}_full, {plan.q_ring.phase_cpp('q_it')});"]
    return [f"mbar_wait(bar_{step.arg.lower()}_full + 8 * {stage}, {'ph' if stage == 'st' else 'ph_prev'});"]


def _release(plan: HopperPlan, step: Release) -> list[str]:
    stage = _stage(step)
    slot = f" + 8 * {stage}" if stage else ""  # Q has one slot, K/V one per ring stage
    return [f"if (lane == 0) mbar_arrive(bar_{step.arg.lower()}_empty{slot});  // one arrival per warp"]


def _wgmma_wait(plan: HopperPlan, step: WgmmaWait) -> list[str]:
    # after the wait the retired groups' registers are the compiler's again: S always, O and P once all are done
    code = [f"wgmma_wait_group<{step.arg}>();", "wgmma_fence_operands(s_acc);"]
    return code + (["wgmma_fence_operands(o_acc); wgmma_fence_operands(p_frag);"] if step.arg == "0" else [])


#: consumer step class -> its code (the plan's schedule is made of these; see flashgen.dsl.steps)
_STEP_CODE = {
    WaitFull: _wait_full,
    Release: _release,
    Gemm: lambda plan, step: _gemm(plan, step.arg, step.block),
    WgmmaWait: _wgmma_wait,
    Softmax: lambda plan, step: ["softmax(j, masked, " + ("std::true_type{}" if step.arg == "first" else "std::false_type{}") + ");"],
    RescaleO: lambda plan, step: ["scale_row(o_acc, 0, corr[0]);", "scale_row(o_acc, 1, corr[1]);"],
    ConvertP: lambda plan, step: _convert_p(plan),
    Turn: lambda plan, step: ["named_bar_sync(1 + cw, 2 * 128);"],
    Pass: lambda plan, step: ["named_bar_arrive(1 + (cw + 1) % CONSUMERS, 2 * 128);"],
}


def _step(plan: HopperPlan, step: Step) -> list[str]:
    """C++ for one consumer step (blocks j, j-1, last; a guarded step runs where its guard holds)."""
    code = _STEP_CODE[type(step)](plan, step)
    if step.guard:
        next = plan.score_mask.next_cpp("bm", "j", "j_end") if _skips(plan) else ""
        code = [f"if ({step.guard.to_cpp(end='j_end', next=next)}) {{"] + ["    " + c for c in code] + ["}"]
    why = f"// [{step}]" + (f" {step.why}" if step.why else "")
    return [why] + code


#: The file's head: what it is, the plan, includes, the kernel's constants and rules, the PTX helpers.
_HEADER = CodeTemplate(
    r"""// Generated by flashgen. Do not edit: change the config and re-emit.
//
// $short_form
// knobs: $knobs_json
// grid: $grid_doc
// block: $threads threads (warpgroup 0: TMA producer, warpgroups 1..$consumers: consumers of 64 query
// rows each), dynamic shared memory: $smem_bytes bytes
// build: $gencode
//
// plan:
$plan_lines
#include <stdint.h>
#include <cuda.h>  // CUtensorMap and its enums (types only: the encoder is fetched through the runtime)
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <math.h>
#include <atomic>
#include <type_traits>

namespace $name {

constexpr uint32_t B_r = $B_r, B_c = $B_c, D_HEAD = $d_head, STAGES = $stages, CONSUMERS = $consumers, THREADS = $threads;
static_assert(THREADS == 128 * (1 + CONSUMERS), "one producer and CONSUMERS consumer warpgroups");
constexpr uint32_t Q_BYTES = $q_bytes, KV_BYTES = $kv_bytes;  // expect_tx of a Q tile and of one K or V stage

$mask_fns

$tail_rule

$scheduler

using elem_t = $elem_t;

// ---- PTX helpers ----
$ptx_helpers

$softmax_fns"""
)

#: The kernel's parameters and its output tile (in the scheduler's order).
_TYPES = CodeTemplate(
    r"""struct Params {
    CUtensorMap tm_q, tm_k, tm_v, tm_o;  // (d_head, seq, heads, batch) maps, 64 x {B_r, B_c, B_c, $o_box_rows} boxes, 128B swizzle
    float* lse; int64_t lse_batch, lse_head;
    int seq_q, seq_k;
    int heads, batch, kv_group;
    int mask_offset, window_left, window_right;
    float scale, scale_log2;
    $mod_params
    $tile_order_param
    $tail_params
};

// One output tile: B_r query rows of one head, and the key blocks holding any kept score of them.
struct Tile {
    int q_row0, head, batch, kv_head, j_begin, j_end;
    int unit, tail_tile, part;  // a part of a split tail tile: its workspace slot, tile and part; unit -1: a whole tile
};
// Tile `tile` in the scheduler's order (sched_coords): at position `tile` of a launch, with a block mask's order its tile
__device__ __forceinline__ Tile tile_at(const Params& p, int tile, int n_q_blocks) {
    Tile t;
    int q_block;
    $tile_order
    sched_coords(tile, n_q_blocks, p.heads, &q_block, &t.head, &t.batch);
    t.q_row0 = q_block * int(B_r);
    t.kv_head = t.head / p.kv_group;
    kv_block_range(t.q_row0, p.seq_q, p.seq_k, p.mask_offset, p.window_left, p.window_right, &t.j_begin, &t.j_end);
    $block_mask_tile
    return t;
}"""
)

#: The kernel: shared memory, roles, the CTA's tiles (sched_work), barriers; then producer and consumers.
_KERNEL = CodeTemplate(
    r"""__global__ void __launch_bounds__(THREADS, 1) kernel(const __grid_constant__ Params p) {
    extern __shared__ unsigned char smem_raw[];
    // the 128B swizzle repeats every 1024 bytes of absolute address: align the base (slack is in the size)
    const uint32_t smem = (static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw)) + 1023u) & ~1023u;
    $smem_decls
    const uint32_t wg = warpgroup_index(), wtid = threadIdx.x % 128, lane = threadIdx.x % 32;
    // tiles = (query block, head, batch) in tile_at's order; $tile_loop_doc
    const int n_q_blocks = (p.seq_q + int(B_r) - 1) / int(B_r), n_tiles = n_q_blocks * p.heads * p.batch;
    // round r of this CTA (sched_work): its tile, or part of a split tail tile; false once it has no work left
    auto cta_work = [&](int r, Tile* t) {
        int tile, part;
        if (!sched_work(r, int(blockIdx.x), int(gridDim.x), n_tiles, p.tail_parts, &tile, &part)) return false;
        *t = tile_at(p, tile, n_q_blocks);
        t->unit = -1;
        if (part >= 0) {  // part `part` of the tile: its share of the key blocks (tail_range) and workspace slot
            tail_range(t->j_begin, t->j_end, part, p.tail_parts, &t->j_begin, &t->j_end);
            $block_mask_part
            t->tail_tile = tile - r * int(gridDim.x);
            t->part = part;
            t->unit = t->tail_tile * p.tail_parts + part;
        }
        return true;
    };

    if (threadIdx.x == 0) {
        $barrier_init
        fence_mbarrier_init();
    }
    __syncthreads();

    $producer_code

    $consumers_code
}

}  // namespace $name"""
)

#: Warpgroup 0: one thread issues every TMA load of the CTA's tiles into Q's slot and the K/V ring.
_PRODUCER = CodeTemplate(
    r"""if (wg == 0) {
    // ---- producer: registers back to the pool, one thread issues every TMA copy ----
    setmaxnreg_dec<$producer_regs>();
    if (wtid == 0) {
        uint32_t kv_it = 0, q_it = 0;  // K/V ring slots and Q tiles used so far (stage and phase)
        Tile t;
        for (int r = 0; cta_work(r, &t); ++r) {
            const int q_row0 = t.q_row0, head = t.head, batch = t.batch, kv_head = t.kv_head, j_begin = t.j_begin, j_end = t.j_end;
            if (j_begin >= j_end) continue;  // no key block: the consumers write zeros
            $wait_q_empty
            mbar_arrive_expect_tx(bar_q_full, Q_BYTES);
            $load_q
            $producer_walk
                const uint32_t $kv_use_vars;
                mbar_wait(bar_k_empty + 8 * st, $kv_empty_phase);  // a fresh barrier passes parity 1 at once
                mbar_arrive_expect_tx(bar_k_full + 8 * st, KV_BYTES);
                $load_k
                mbar_wait(bar_v_empty + 8 * st, $kv_empty_phase);
                mbar_arrive_expect_tx(bar_v_full + 8 * st, KV_BYTES);
                $load_v
            }
            $count_tile
        }
    }
    return;
}"""
)

#: Warpgroups 1..: per tile the plan's steps over the key blocks, the split's merge, the output.
_CONSUMERS = CodeTemplate(
    r"""// ---- consumers: 64 query rows each ----
setmaxnreg_inc<$consumer_regs>();
const uint32_t cw = wg - 1;  // consumer index
const float scale_log2 = p.scale_log2;
float o_acc[D_HEAD / 2], s_acc[B_c / 2];
uint32_t p_frag[B_c / 16][4];
$q_frag_decl
float row_max[2], row_sum[2], corr[2] = {1.f, 1.f};
$desc_q_decl
const uint64_t desc_k = smem_desc(sK, $k_lbo, $k_sbo, $swizzle_code);
const uint64_t desc_v = smem_desc(sV, $v_lbo, $v_sbo, $swizzle_code);
(void)corr;
$pingpong_start
uint32_t kv_it = 0, q_it = 0;  // the producer's counters, kept in step

Tile t;
for (int r = 0; cta_work(r, &t); ++r) {
    const int q_row0 = t.q_row0, head = t.head, batch = t.batch, j_begin = t.j_begin, j_end = t.j_end;
    $bias_tile
    row_max[0] = row_max[1] = -INFINITY;
    row_sum[0] = row_sum[1] = 0.f;
    #pragma unroll
    for (uint32_t i = 0; i < D_HEAD / 2; ++i) o_acc[i] = 0.f;

    $mask_bits_decl
    auto softmax = [&](const int j, auto masked, auto first) {
        if constexpr (decltype(first)::value) {
            $softmax_first
        } else {
            $softmax_next
        }
    };

    if (j_begin < j_end) {
        $tile_start
        $load_q_frags
        $main_loop
        $count_tile
    }

    $merge_parts
    $epilogue_code
}
if (wtid == 0) bulk_wait_group<0>();  // the last stores finished reading shared memory before the CTA exits
$pingpong_end"""
)

#: A consumer's output of one tile: O /= l and the LSE, staged in shared memory, TMA stores.
_EPILOGUE = CodeTemplate(
    r"""// ---- epilogue: O /= l, registers -> shared memory (Q's layout, this consumer's rows) -> TMA stores ----
float inv[2];
#pragma unroll
for (uint32_t h = 0; h < 2; ++h) {
    const float l = epilogue_row_sum(row_sum[h]);
    inv[h] = epilogue_inv(l);
    const int row = q_row0 + int(64 * cw + $c_row_h);
    if (p.lse != nullptr && $lse_writer && row < p.seq_q)
        p.lse[batch * p.lse_batch + head * p.lse_head + row] = epilogue_lse(row_max[h], l, p.scale);
}
$store_merged
$o_stage_decl
#pragma unroll
for (uint32_t i = 0; i < D_HEAD / 2; i += 2) {
    const uint32_t r = $c_row_i, c = $c_col_i;
    st_shared_b32(sO + 2 * ($o_stage_rc), pack2(o_acc[i] * inv[(i / 2) % 2], o_acc[i + 1] * inv[(i / 2) % 2]));
}
fence_proxy_async();  // the TMA unit (async proxy) reads what these st.shared wrote
named_bar_sync(1 + CONSUMERS + cw, 128);  // this warpgroup's rows are staged
if (wtid == 0) {  // one thread stores them; the warpgroup goes on without waiting for global writes
    $store_o
    bulk_commit_group();
}"""
)

#: Host side, shared with the wgmma backward: the driver's tensor-map encoder and one (d_head, seq, heads,
#: batch) map per tensor (``$box_cols``-column boxes, ``$tma_dtype``, ``$tma_swizzle``).
TENSOR_MAPS = CodeTemplate(
    r"""using encode_fn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*, const cuuint64_t*,
                               const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                               CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// cuTensorMapEncodeTiled through the runtime's driver entry point (no link against libcuda).
static encode_fn tensor_map_encoder() {
    static encode_fn fn = nullptr;
    if (fn == nullptr) {
        void* ptr = nullptr;
        cudaDriverEntryPointQueryResult found;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &found) == cudaSuccess &&
            found == cudaDriverEntryPointSuccess)
            fn = reinterpret_cast<encode_fn>(ptr);
    }
    return fn;
}

// A (d_head, seq, heads, batch) map of a (batch, seq, heads, d_head) tensor with element strides
// `stride` = (batch, head, seq); boxes of 64 columns x `box_rows` rows, 128B swizzle, zero fill.
static bool make_map(CUtensorMap* map, const void* ptr, int seq, int heads, int batch, const int64_t* stride, uint32_t box_rows) {
    encode_fn encode = tensor_map_encoder();
    if (encode == nullptr) return false;
    const cuuint64_t dims[4] = {D_HEAD, cuuint64_t(seq), cuuint64_t(heads), cuuint64_t(batch)};
    // a size-1 dimension's stride is never used; give it a valid one (a multiple of 16 bytes)
    const int64_t s_seq = seq > 1 ? stride[2] : D_HEAD, s_head = heads > 1 ? stride[1] : D_HEAD, s_batch = batch > 1 ? stride[0] : D_HEAD;
    const cuuint64_t strides[3] = {cuuint64_t(s_seq) * sizeof(elem_t), cuuint64_t(s_head) * sizeof(elem_t), cuuint64_t(s_batch) * sizeof(elem_t)};
    const cuuint32_t box[4] = {$box_cols, box_rows, 1, 1}, elem_strides[4] = {1, 1, 1, 1};
    return encode(map, $tma_dtype, 4, const_cast<void*>(ptr), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                  $tma_swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}"""
)

#: Host side: the argument struct, tensor maps, the SM count, the launch's grid (sched_grid).
_HOST = CodeTemplate(
    r"""$args_struct

namespace $name {

$tensor_maps_code

// SMs of the current device: asked of the driver once per device (every launch needs it)
static int sm_count(int* sms) {
    static std::atomic<int> known[64];  // 0: not asked yet
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return (int)cudaGetLastError();
    if (dev < 64 && (*sms = known[dev].load(std::memory_order_relaxed)) > 0) return 0;
    if (cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) return (int)cudaGetLastError();
    if (dev < 64) known[dev].store(*sms, std::memory_order_relaxed);
    return 0;
}

// Key blocks of the shortest (`lo`) and longest (`hi`) tile of a launch
static void tile_blocks(const ${name}_args* a, int* lo, int* hi) {
    $tile_blocks_body
}

// CTAs of a launch of `tiles` tiles (see "grid:" at the top) and the parts a partial last round's tiles split into
static int grid_ctas(const ${name}_args* a, int64_t tiles, int* out, int* parts) {
    int sms = 0, lo = 0, hi = 0;  // SMs; key blocks of the shortest and longest tile
    if (const int e = sm_count(&sms)) return e;
    tile_blocks(a, &lo, &hi);
    sched_grid(tiles, sms, lo, (a->seq_q + int(B_r) - 1) / int(B_r), lo == hi, $ordered_launch, out, parts);
    return 0;
}

}  // namespace $name"""
)

#: The C entry points: the launch's workspace and the launch.
_ENTRY_POINTS = CodeTemplate(
    r"""// Scratch memory a launch with these arguments uses: `bytes` in all, of which the first `zeroed` must be
// zero at launch (0 and 0: none). $workspace_doc
extern "C" int ${name}_workspace(const ${name}_args* a, size_t* bytes, size_t* zeroed) {
    using namespace $name;
    *bytes = *zeroed = 0;
    $workspace_body
    return 0;
}

// Launch on `stream` (a cudaStream_t). Returns a cudaError_t: cudaErrorInvalidValue for sizes the kernel
// cannot take or strides a tensor map cannot describe (multiples of 16 bytes), cudaErrorNotSupported when
// the driver has no cuTensorMapEncodeTiled.
extern "C" int ${name}_launch(const ${name}_args* a, void* stream) {
    using namespace $name;
    if (a->batch <= 0 || a->heads <= 0 || a->kv_heads <= 0 || a->heads % a->kv_heads || a->seq_q <= 0 || a->seq_k < 0)
        return (int)cudaErrorInvalidValue;
    if (tensor_map_encoder() == nullptr) return (int)cudaErrorNotSupported;
    static Params p;  // large (4 tensor maps): built in static storage, passed by value to the launch
    p = Params{};
    const int seq_k = a->seq_k > 0 ? a->seq_k : 1;  // an empty key sequence still needs a valid map (no block is loaded)
    if (!make_map(&p.tm_q, a->q, a->seq_q, a->heads, a->batch, a->q_stride, B_r) ||
        !make_map(&p.tm_k, a->k, seq_k, a->kv_heads, a->batch, a->k_stride, B_c) ||
        !make_map(&p.tm_v, a->v, seq_k, a->kv_heads, a->batch, a->v_stride, B_c) ||
        !make_map(&p.tm_o, a->o, a->seq_q, a->heads, a->batch, a->o_stride, $o_box_rows))
        return (int)cudaErrorInvalidValue;
    p.lse = a->lse; p.lse_batch = a->lse_stride[0]; p.lse_head = a->lse_stride[1];
    p.seq_q = a->seq_q; p.seq_k = a->seq_k; p.heads = a->heads; p.batch = a->batch; p.kv_group = a->heads / a->kv_heads;
    p.mask_offset = a->mask_offset; p.window_left = a->window_left; p.window_right = a->window_right;
    p.scale = a->softmax_scale; p.scale_log2 = a->softmax_scale * $log2e;
    $mod_fill
    $tile_order_fill
    constexpr int smem = $smem_bytes;
    $smem_attribute
    const int64_t tiles = int64_t((a->seq_q + B_r - 1) / B_r) * a->heads * a->batch;
    if (tiles > INT32_MAX) return (int)cudaErrorInvalidValue;
    int ctas = 0, parts = 1;
    if (const int e = grid_ctas(a, tiles, &ctas, &parts)) return e;
    $tail_setup
    kernel<<<dim3(unsigned(ctas)), THREADS, smem, (cudaStream_t)stream>>>(p);
    return (int)cudaGetLastError();
}"""
)

#: The file: every part above, in order (see compose).
_FILE = CodeTemplate("""$header_code

$types_code

$kernel_code

$host_code

$entry_points_code
$mask_blocks
""")
_PARTS = [("epilogue_code", _EPILOGUE), ("consumers_code", _CONSUMERS), ("producer_code", _PRODUCER), ("kernel_code", _KERNEL),
          ("header_code", _HEADER), ("types_code", _TYPES), ("tensor_maps_code", TENSOR_MAPS), ("host_code", _HOST), ("entry_points_code", _ENTRY_POINTS),
          ("file", _FILE)]


def _desc_q_decl(plan: HopperPlan) -> list[str]:
    a = plan.gemm_S.a
    if plan.gemm_S.a_from != "smem":
        return ["// S reads Q's A fragments from registers (q_frag): no descriptor for Q"]
    return [f"const uint64_t desc_q = smem_desc(sQ + cw * {a.row_block_offset}u, {a.lbo}u, {a.sbo}u, {a.swizzle.desc_code}u);"]


def _q_frag_decl(plan: HopperPlan) -> list[str]:
    if plan.q_load is None:
        return []
    return [f"uint32_t q_frag[{plan.gemm_S.k_steps}][4];  // Q's A fragments, one x4 per k16 step ({plan.q_load.name})"]


def q_load_cpp(plan: HopperPlan) -> tuple[str, str, str]:
    """C++ of the Q fragment load's lane address: (tile row, tile column) in ``cw``, ``wtid``, ``lane`` and
    the step ``kk``, and the element offset of (``row``, ``col``) in Q's tile (host-tested against the plan)."""
    ld = plan.q_load
    row, col = ld.partition.coord_cpp("lane", "0", warp="(wtid / 32)")
    return f"{WGMMA_M} * cw + {row}", col, plan.tiles[ld.tile].layout.to_cpp(["row", "col"])


def _load_q_frags(plan: HopperPlan) -> list[str]:
    """Once Q landed: this consumer's A fragments of Q for every k16 step, read through the Q tile's
    layout at the rows and columns ``plan.q_load`` points each lane at."""
    ld = plan.q_load
    if ld is None:
        return []
    (kk,) = ld.partition.loops
    tile = plan.tiles[ld.tile]
    row, col, off = q_load_cpp(plan)
    return [
        f"// {ld.name}: {ld.atom.name} per k16 step; {ld.partition.tv}, warp w +{ld.partition.warp_row_step} rows, "
        f"step {kk.name} +{kk.col_step} columns; {tile.name}: {tile.layout}",
        "#pragma unroll",
        f"for (uint32_t {kk.name} = 0; {kk.name} < {kk.extent}; ++{kk.name}) {{",
        f"    const uint32_t row = {row}, col = {col};",
        f"    {ldmatrix.helper_name(ld.atom)}(q_frag[{kk.name}], s{ld.tile} + 2u * ({off}));",
        "}",
        "wgmma_fence_operands(q_frag);  // the S GEMMs read them asynchronously",
    ]


def _tma_calls(plan: HopperPlan, op: str) -> list[str]:
    load = plan.loads[op]
    dst = {"Q": "sQ", "K": "sK + st * KV_BYTES", "V": "sV + st * KV_BYTES"}[op]
    row = "q_row0" if load.row_coord == "q" else "j * int(B_c)"
    head = "head" if op == "Q" else "kv_head"
    bar = "bar_q_full" if op == "Q" else f"bar_{op.lower()}_full + 8 * st"
    return [
        f"tma_load_4d({dst} + {b.smem_offset}u, &p.tm_{op.lower()}, {bar}, {b.col0}, {row} + {b.row0}, {head}, batch);"
        for b in load.boxes
    ]


def tma_store_calls(store: TmaTile, tmap: str, base: str, row0: str, head: str) -> list[str]:
    """Consumer ``cw``'s TMA stores (map ``tmap``) of its staged rows of ``store``'s tile at ``base``: the boxes
    of row block ``cw``, the first at global row ``row0``.

    Boxes are ``WGMMA_M`` rows and row block i of a column block sits i boxes after row block 0
    (``base + cw * bytes``): proven on the plan by flashgen.sim.verify (``store_box_problems``).
    """
    rows = store.tma.box_rows
    first = {b.col0: b.smem_offset for b in store.boxes if b.row0 == 0}
    return [f"tma_store_4d(&{tmap}, {base} + cw * {store.tma.bytes}u + {off}u, {col0}, {row0} + {rows} * int(cw), {head}, batch);"
            for col0, off in sorted(first.items())]


def _tma_store_calls(plan: HopperPlan) -> list[str]:
    """Consumer ``cw``'s TMA stores of its staged output rows."""
    return tma_store_calls(plan.stores["O"], "p.tm_o", "sO", "q_row0", "head")


def _kv_use_vars(plan: HopperPlan) -> str:
    """``it``: the K/V ring's use of block ``j`` (the CTA's counter ``kv_it`` runs over its tiles; with a
    mask_mod, ``kv_u`` counts the blocks of the tile walked before ``j``); ``st``, ``ph``: its slot and
    the parity of its full barrier (plan.kv_ring)."""
    ring = plan.kv_ring
    use = ring.use_cpp("kv_it", "kv_u", "") if _skips(plan) else ring.use_cpp("kv_it")
    return f"it = {use}, st = {ring.stage_cpp('it')}, ph = {ring.phase_cpp('it')}"


def _skips(plan: HopperPlan) -> bool:
    """Whether the tiles' walks skip the key blocks the block mask calls empty (a mask_mod): the producer
    and the consumers then step with ``block_mask_next`` and count the blocks walked (``kv_u``), so both
    sides use the same ring slots and phases."""
    return plan.score_mask.mask_mod is not None


#: the tile's block-mask row, and the count of its blocks walked (a mask_mod only)
_WALK_DECLS = ["const int* bm = block_mask_row(p.block_mask, batch, head, q_row0 / int(B_r), p.heads, p.seq_q, p.seq_k);",
               "int kv_u = 0;  // blocks of this tile walked so far: block j is the K/V ring's use kv_it + kv_u"]


def _walk_env(plan: HopperPlan) -> dict:
    """The producer's loop over a tile's key blocks, the tiles' counters' advance, a split part's clip."""
    ring, mask = plan.kv_ring, plan.score_mask
    if not _skips(plan):
        return dict(producer_walk=["for (int j = j_begin; j < j_end; ++j) {"], block_mask_part=[],
                    count_tile=[ring.after_tile_cpp("kv_it"), plan.q_ring.after_tile_cpp("q_it")])
    part = ("block_mask_clip(block_mask_row(p.block_mask, t->batch, t->head, t->q_row0 / int(B_r), p.heads, p.seq_q, p.seq_k), "
            "&t->j_begin, &t->j_end);  // the part starts and ends on non-empty blocks")
    return dict(producer_walk=_WALK_DECLS + [f"for (int j = j_begin; j < j_end; j = {mask.next_cpp('bm', 'j', 'j_end')}, ++kv_u) {{"],
                block_mask_part=[part], count_tile=[ring.after_tile_cpp("kv_it", "", "kv_u"), plan.q_ring.after_tile_cpp("q_it")])


def _main_loop(plan: HopperPlan) -> list[str]:
    """prologue (first block) -> body over the rest -> epilogue, each step from the plan."""
    out: list[str] = []

    def steps(seq) -> list[str]:
        return [line for s in seq for line in _step(plan, s)]

    ring = plan.kv_ring
    stage_vars = [  # the ring's slot and full-barrier parity of block j (st, ph) and of block j - 1 (st_prev, ph_prev)
        f"const uint32_t {_kv_use_vars(plan)};",
        f"const uint32_t st_prev = {ring.prev_stage_cpp('it')}, ph_prev = {ring.prev_phase_cpp('it')};",
        "(void)st; (void)ph; (void)st_prev; (void)ph_prev;",
    ]
    # blocks with a softmax: the mask_mod's bits, and where the S accumulator starts (a bias), ahead of the S GEMM
    bits = plan.score_mask.bits_cpp(bits="mask_bits[h]", **_fragment_rows(plan))
    bits += plan.score_mask.init_cpp(value="s_acc[4 * {t} + 2 * h + e]", **_fragment_rows(plan))
    mask, skips = plan.score_mask, _skips(plan)
    row = "bm" if skips else "block_mask_row(p.block_mask, batch, head, q_row0 / int(B_r), p.heads, p.seq_q, p.seq_k)"
    dispatch = lambda fn: [  # noqa: E731
        "if (block_needs_mask(j, q_row0, p.seq_q, p.seq_k, p.mask_offset, p.window_left, p.window_right)"
        + mask.masked_cpp(row, "j") + ")",
        f"    {fn}(j, std::true_type{{}});",
        "else",
        f"    {fn}(j, std::false_type{{}});",
    ]
    out += _WALK_DECLS if skips else []
    if plan.prologue:
        out += ["auto first_block = [&](const int j, auto masked) {"] + ["    " + l for l in stage_vars + bits + steps(plan.prologue)] + ["};"]
        out += ["{", "    const int j = j_begin;"] + ["    " + l for l in dispatch("first_block")] + ["}"]
        out += ["++kv_u;  // block j_begin walked"] if skips else []
    body_start = mask.next_cpp("bm", "j_begin", "j_end") if plan.prologue else "j_begin"
    step = f"j = {mask.next_cpp('bm', 'j', 'j_end')}, ++kv_u" if skips else "++j"
    out += ["auto kv_block = [&](const int j, auto masked) {"] + ["    " + l for l in stage_vars + bits + steps(plan.body)] + ["};"]
    out += [f"for (int j = {body_start}; j < j_end; {step}) {{"] + ["    " + l for l in dispatch("kv_block")] + ["}"]
    if plan.epilogue:
        out += ["{", "    const int j = j_end;  // the last block's PV: its stage is the 'previous' one of j_end"]
        out += ["    " + l for l in stage_vars + steps(plan.epilogue)] + ["}"]
    return out


#: row half of O value i (the rescale's and the normalisation's rule)
_O_ROW_HALF = "(i / 2) % 2"


def _tail_split_code(plan: HopperPlan) -> dict:
    """The wave-tail split (``plan.tail_split``): the partials' publish-and-merge, the merged rows'
    stores, the launcher's rule and workspace (which tile and part a CTA takes: ``plan.scheduler``)."""
    return dict(merge_parts=_split_merge(), store_merged=_split_store(plan), tail_rule=plan.tail_split.to_cpp(),
                workspace_doc="The wave-tail split: see tail_rule.", **_split_launcher())


def _split_merge() -> list[str]:
    """A part's consumer warps publish their O and row statistics and count in; the last warp to count
    for its 16 rows merges every part's into its registers (rescaled to the common max)."""
    slot = _O_ROW_HALF
    return [
        "if (t.unit >= 0) {",
        "    // a part of a split tail tile: publish this warp's O, row max and row sums (fragment order), count",
        "    // the part in; the warp counting last for these 16 rows merges every part's and writes the rows",
        "    const uint32_t warp = 4 * cw + wtid / 32;",
        "    float* ml = p.part_ml + tail_ml_at(t.unit, warp) + lane;",
        "    float* po = p.part_o + tail_o_at(t.unit, warp) + lane;",
        "    ml[0] = row_max[0]; ml[32] = row_max[1]; ml[64] = row_sum[0]; ml[96] = row_sum[1];",
        "    #pragma unroll",
        "    for (uint32_t i = 0; i < D_HEAD / 2; ++i) po[32 * i] = o_acc[i];",
        "    __threadfence();  // the partials are visible before the count says so",
        "    __syncwarp();",
        "    int counted = 0;",
        "    if (lane == 0) counted = atomicAdd(p.part_count + tail_count_at(t.tail_tile, warp), 1);",
        "    if (__shfl_sync(0xffffffffu, counted, 0) != p.tail_parts - 1) continue;  // a later part merges these rows",
        "    __threadfence();  // ... and every other part's partials are visible to the loads below",
        "    const int unit0 = t.unit - t.part;",
        "    float neg_m[2];",
        "    #pragma unroll",
        "    for (uint32_t h = 0; h < 2; ++h) {",
        "        for (int k = 0; k < p.tail_parts; ++k)",
        "            row_max[h] = fmaxf(row_max[h], __ldcg(p.part_ml + tail_ml_at(unit0 + k, warp) + 32 * h + lane));",
        "        neg_m[h] = softmax_neg_max(row_max[h], scale_log2);  // the merged max",
        "        row_sum[h] = 0.f;",
        "    }",
        "    #pragma unroll",
        "    for (uint32_t i = 0; i < D_HEAD / 2; ++i) o_acc[i] = 0.f;",
        "    for (int k = 0; k < p.tail_parts; ++k) {  // parts in order, this one's read back like the others",
        "        const float* mlk = p.part_ml + tail_ml_at(unit0 + k, warp) + lane;",
        "        const float* pok = p.part_o + tail_o_at(unit0 + k, warp) + lane;",
        "        float c[2];",
        "        #pragma unroll",
        "        for (uint32_t h = 0; h < 2; ++h) {",
        "            c[h] = softmax_rescale_factor(__ldcg(mlk + 32 * h), scale_log2, neg_m[h]);",
        "            row_sum[h] = fmaf(__ldcg(mlk + 64 + 32 * h), c[h], row_sum[h]);",
        "        }",
        "        #pragma unroll",
        f"        for (uint32_t i = 0; i < D_HEAD / 2; ++i) o_acc[i] = fmaf(__ldcg(pok + 32 * i), c[{slot}], o_acc[i]);",
        "    }",
        "}",
    ]


def _split_store(plan: HopperPlan) -> list[str]:
    """The merged rows of a split tile, normalised, straight from the accumulator map to global memory."""
    co, slot = plan.gemm_O.atom.c_map, _O_ROW_HALF
    return [
        "if (t.unit >= 0) {  // merged rows of a split tile: this warp's 16 rows straight to global memory",
        "    elem_t* o = p.o + int64_t(batch) * p.o_batch + int64_t(head) * p.o_head;",
        "    #pragma unroll",
        "    for (uint32_t i = 0; i < D_HEAD / 2; i += 2) {",
        f"        const uint32_t r = {co.row.to_cpp(['wtid', 'i'])}, c = {co.col.to_cpp(['wtid', 'i'])};",
        "        const int row = q_row0 + int(64 * cw + r);",
        "        if (row < p.seq_q)",
        f"            *reinterpret_cast<uint32_t*>(o + int64_t(row) * p.o_seq + c) = pack2(o_acc[i] * inv[{slot}], o_acc[i + 1] * inv[{slot}]);",
        "    }",
        "    continue;",
        "}",
    ]


def _split_launcher() -> dict:
    """The split's kernel parameters, the launcher's workspace setup and the workspace function's body."""
    params = [
        "int tail_parts;  // > 1: the last round's tiles are split into this many key ranges (tail_rule)",
        "int* part_count; float* part_ml; float* part_o;  // the split's workspace (counters zeroed at launch)",
        "elem_t* o; int64_t o_batch, o_head, o_seq;  // the output: a split tile's merged rows go straight there",
    ]
    setup = [
        "p.tail_parts = 1;",
        "p.o = static_cast<elem_t*>(a->o); p.o_batch = a->o_stride[0]; p.o_head = a->o_stride[1]; p.o_seq = a->o_stride[2];",
        "if (parts > 1 && a->workspace == nullptr) ctas = int(tiles < ctas ? tiles : ctas);  // no workspace: no split",
        "if (parts > 1 && a->workspace != nullptr) {",
        "    const int tail = int(tiles % ctas);  // fewer tiles than SMs: all of them (ctas = tiles * parts)",
        "    char* ws = static_cast<char*>(a->workspace);",
        "    p.tail_parts = parts;",
        "    p.part_count = reinterpret_cast<int*>(ws);",
        "    p.part_ml = reinterpret_cast<float*>(ws + tail_count_bytes(tail));",
        "    p.part_o = reinterpret_cast<float*>(ws + tail_count_bytes(tail) + tail_ml_bytes(tail * parts));",
        "}",
    ]
    body = [
        "if (a->batch <= 0 || a->heads <= 0 || a->seq_q <= 0 || a->seq_k <= 0) return 0;  // the launch refuses or splits nothing",
        "const int64_t tiles = int64_t((a->seq_q + B_r - 1) / B_r) * a->heads * a->batch;",
        "int ctas = 0, parts = 1;",
        "if (tiles > INT32_MAX) return 0;",
        "if (const int e = grid_ctas(a, tiles, &ctas, &parts)) return e;",
        "if (parts > 1) {",
        "    const int tail = int(tiles % ctas);",
        "    *zeroed = tail_count_bytes(tail);",
        "    *bytes = *zeroed + tail_ml_bytes(tail * parts) + tail_o_bytes(tail * parts);",
        "}",
    ]
    return dict(tail_params=params, tail_setup=setup, workspace_body=body)


def _plan_lines(plan: HopperPlan) -> list[str]:
    out = [f"//   {t}" for t in plan.tiles.values()]
    for op, ld in plan.loads.items():
        out.append(f"//   TMA {op}: {len(ld.boxes)} box(es) of {ld.tma.box_rows}x{ld.tma.box_cols} {ld.tma.swizzle}, {ld.bytes} bytes per tile")
    for name, (bar, off, stages) in plan.barriers.items():
        out.append(f"//   mbarrier {name}[{stages}] @ {off}: {bar.arrive_count} arrival(s) per phase")
    for g in (plan.gemm_S, plan.gemm_O):
        a = f"A {g.a.operand} {g.a.major}-major smem" if g.a else "A from registers"
        out.append(f"//   gemm {g.name}: {g.k_steps} x {g.atom.ptx}, {a}, B {g.b.operand} {g.b.major}-major (LBO {g.b.lbo}, SBO {g.b.sbo})")
    if plan.q_load is not None:
        ld = plan.q_load
        out.append(f"//   {ld.name}: {ld.tile} -> A fragments of gemm S once per tile, {ld.atom.name} per warp and k16 step")
    out.append(f"//   registers: producer {plan.producer_regs}, consumers {plan.consumer_regs} (setmaxnreg)")
    for sec in ("prologue", "body", "epilogue"):
        steps = getattr(plan, sec)
        if steps:
            out.append(f"//   {sec}: {' | '.join(s.op + (' ' + s.arg if s.arg else '') + (f' {s.block}' if s.block else '') for s in steps)}")
    return out


def _header_env(plan: HopperPlan) -> dict:
    """The file's head and the kernel's constants."""
    cfg = plan.cfg
    return dict(name=plan.score_mask.kernel_name(cfg.mangle()), short_form=cfg.short_form(), knobs_json=json.dumps(cfg.to_dict()), plan_lines=_plan_lines(plan),
                B_r=cfg.B_r, B_c=cfg.B_c, d_head=cfg.d_head, stages=cfg.stages, consumers=cfg.consumers, threads=plan.threads,
                smem_bytes=plan.smem_bytes, q_bytes=f"{plan.loads['Q'].bytes}u", kv_bytes=f"{plan.loads['K'].bytes}u",
                mask_fns=plan.score_mask.to_cpp(tile_order=plan.scheduler.ordered), mod_params=plan.score_mask.params_cpp(),
                tile_order=["if (p.tile_order != nullptr) tile = p.tile_order[tile];  // the block mask's order"] if plan.scheduler.ordered else [],
                tile_order_param=["const int* tile_order;  // the block mask's tile order (block_mask_order), or nullptr"]
                if plan.scheduler.ordered else [],
                block_mask_tile=plan.score_mask.tile_cpp("bm_row", "t.batch", "t.head", "q_block", "p.heads", "t.j_begin", "t.j_end"),
                elem_t=cfg.dtype.cpp, ptx_helpers=HELPERS_MARK, gencode=TARGET.gencode,
                softmax_fns=[online_softmax(plan).to_cpp(), epilogue(plan).to_cpp()],
                scheduler=plan.scheduler.to_cpp(), grid_doc=_grid_doc(plan))


def _grid_doc(plan: HopperPlan) -> str:
    """The launch shape in words, for the kernel's comments and the manifest (sched_grid is the rule)."""
    tiles = f"ceil(seq_q / {plan.cfg.B_r}) * heads * batch"
    notes = ["with unequal tiles, SMs rounded down to a multiple of half the query blocks"] if plan.scheduler.rounds_pair else []
    notes += ["fewer tiles than SMs: tiles x the wave-tail split's parts"]
    return f"{f'min(SMs, {tiles})' if plan.scheduler.persistent else tiles}{''.join('; ' + n for n in notes)}"


def _shared_memory_env(plan: HopperPlan) -> dict:
    """Tile and mbarrier addresses, the barriers' initialisation; Q's release and O's staging when persistent."""
    smem_decls = [f"const uint32_t sQ = smem + {plan.tiles['Q'].offset}u, sK = smem + {plan.tiles['K'].offset}u, sV = smem + {plan.tiles['V'].offset}u;"]
    bars = []
    for bname, (bar, off, stages) in plan.barriers.items():
        smem_decls.append(f"const uint32_t bar_{bname} = smem + {off}u;  // [{stages}] x 8 bytes")
        bars.append(f"for (uint32_t s = 0; s < {stages}; ++s) mbar_init(bar_{bname} + 8 * s, {bar.arrive_count});")
    if plan.cfg.persistent:  # Q released per tile, O staged apart
        q_empty = plan.q_ring.empty_phase_cpp(plan.q_ring.phase_cpp("q_it"))
        wait_q_empty = [f"mbar_wait(bar_q_empty, {q_empty});  // every consumer's last S GEMM of the previous tile read Q"]
        o_stage_decl = [f"const uint32_t sO = smem + {plan.tiles['O'].offset}u;  // apart from Q: the next tile's Q may be landing",
                        "if (wtid == 0) bulk_wait_group_read<0>();  // the previous tile's TMA stores have read the staged rows",
                        "named_bar_sync(1 + CONSUMERS + cw, 128);  // ... before this warpgroup writes them again"]
    else:
        wait_q_empty = []
        o_stage_decl = ["const uint32_t sO = sQ;  // O goes to this consumer's own Q rows (Q's layout): only its own S GEMMs read them, all done"]
    return dict(smem_decls=smem_decls, barrier_init=bars, wait_q_empty=wait_q_empty, o_stage_decl=o_stage_decl)


def _roles_env(plan: HopperPlan) -> dict:
    """The producer's TMA loads, the consumers' registers, descriptors, steps and pingpong ring."""
    bk, bv = plan.gemm_S.b, plan.gemm_O.b
    if plan.cfg.pingpong:
        pingpong_start = ["// pingpong: consumers take turns in a ring (0, 1, ...); the last hands consumer 0 the first turn",
                          "if (cw == CONSUMERS - 1) named_bar_arrive(1 + 0, 2 * 128);"]
        pingpong_end = ["// the last consumer passed once more than consumer 0 took turns (its initial pass): take it, so every",
                        "// named-barrier phase completes before exit",
                        "if (cw == 0) named_bar_sync(1 + 0, 2 * 128);"]
    else:
        pingpong_start, pingpong_end = ["// no pingpong: consumers issue GEMMs independently"], []
    tile_loop_doc = ("persistent: gridDim.x about one CTA per SM (grid_ctas), each CTA loops over rounds" if plan.scheduler.persistent
                     else "one tile per CTA (gridDim.x = tiles: one round, or tiles x parts: see grid_ctas)")
    return dict(producer_regs=plan.producer_regs, consumer_regs=plan.consumer_regs, kv_use_vars=_kv_use_vars(plan),
                kv_empty_phase=plan.kv_ring.empty_phase_cpp("ph"), **_walk_env(plan),
                load_q=_tma_calls(plan, "Q"), load_k=_tma_calls(plan, "K"), load_v=_tma_calls(plan, "V"),
                q_frag_decl=_q_frag_decl(plan), desc_q_decl=_desc_q_decl(plan), load_q_frags=_load_q_frags(plan),
                k_lbo=f"{bk.lbo}u", k_sbo=f"{bk.sbo}u", v_lbo=f"{bv.lbo}u", v_sbo=f"{bv.sbo}u", swizzle_code=f"{bk.swizzle.desc_code}u",
                softmax_first=_softmax(plan, True), softmax_next=_softmax(plan, False),
                mask_bits_decl="uint64_t mask_bits[2];  // the mask_mod's bits of the block (bits_cpp)" if plan.score_mask.mask_bits
                else "// no mask_mod bits",
                bias_tile=plan.score_mask.bias_tile_cpp("batch", "head") or ["// no bias per tile"],
                pingpong_start=pingpong_start, pingpong_end=pingpong_end, tile_loop_doc=tile_loop_doc,
                tile_start=[line for st in plan.tile_start for line in _step(plan, st)], main_loop=_main_loop(plan))


def _epilogue_env(plan: HopperPlan) -> dict:
    """The names of the output region (_EPILOGUE)."""
    c, co = plan.gemm_S.atom.c_map, plan.gemm_O.atom.c_map
    return dict(c_row_h=c.row.to_cpp(["wtid", "2 * h"]), lse_writer=f"(lane & {sum(plan.row_reduce_lanes)}u) == 0",
                c_row_i=co.row.to_cpp(["wtid", "i"]), c_col_i=co.col.to_cpp(["wtid", "i"]),
                o_stage_rc=plan.o_stage.to_cpp(["64 * cw + r", "c"]), store_o=_tma_store_calls(plan))


def _host_env(plan: HopperPlan) -> dict:
    """The launcher's: the argument struct, the tensor maps' encoding, the key blocks of the launch's tiles."""
    cfg = plan.cfg
    if cfg.mask != "none":  # a mask makes query blocks' key ranges differ
        tile_blocks_body = [
            "*lo = INT32_MAX; *hi = 0;",
            "for (int qb = 0; qb * int(B_r) < a->seq_q; ++qb) {",
            "    int jb, je;",
            "    kv_block_range(qb * int(B_r), a->seq_q, a->seq_k, a->mask_offset, a->window_left, a->window_right, &jb, &je);",
            "    *lo = je - jb < *lo ? je - jb : *lo; *hi = je - jb > *hi ? je - jb : *hi;",
            "}",
        ]
    else:
        tile_blocks_body = ["*lo = *hi = (a->seq_k + int(B_c) - 1) / int(B_c);  // no mask: every tile takes every key block"]
    tma_dtype = {"fp16": "CU_TENSOR_MAP_DATA_TYPE_FLOAT16", "bf16": "CU_TENSOR_MAP_DATA_TYPE_BFLOAT16"}[cfg.dtype.value]
    name = plan.score_mask.kernel_name(cfg.mangle())
    return dict(args_struct=args_struct(name), mod_fill=plan.score_mask.fill_cpp(), mask_blocks=plan.score_mask.mask_blocks_cpp(name, tile_order=plan.scheduler.ordered),
                ordered_launch="a->block_mask != nullptr" if plan.scheduler.ordered else "false",
                tile_order_fill=["p.tile_order = a->block_mask != nullptr ? block_mask_order(a->block_mask, a->batch, a->heads, a->seq_q, a->seq_k) : nullptr;"]
                if plan.scheduler.ordered else [], o_box_rows=plan.stores["O"].tma.box_rows, box_cols=plan.loads["Q"].tma.box_cols,
                tma_dtype=tma_dtype, tma_swizzle=plan.loads["Q"].tma.swizzle.tma_name, log2e=f"{LOG2E!r}f",
                tile_blocks_body=tile_blocks_body, smem_attribute=SMEM_ATTRIBUTE)


def emit_hopper(plan: HopperPlan) -> KernelSource:
    """The CUDA source of one wgmma-engine plan. Pure and deterministic."""
    cfg = plan.cfg
    name = plan.score_mask.kernel_name(cfg.mangle())
    wgmma_fns = [(ptx_hopper.wgmma if g.a_from == "smem" else ptx_hopper.wgmma_rs)(g.atom, g.trans_b) for g in (plan.gemm_S, plan.gemm_O)]
    helpers = [vec.helpers(), ptx_math.helpers(cfg.dtype), ptx_hopper.helpers(), *wgmma_fns]
    if plan.q_load is not None:
        helpers.append(ldmatrix.helper(plan.q_load.atom))
    env = {**_header_env(plan), **_shared_memory_env(plan), **_roles_env(plan), **_epilogue_env(plan), **_host_env(plan),
           **_tail_split_code(plan)}
    text = compose(_PARTS, env)
    meta = kernel_meta(cfg, name, plan.threads, plan.smem_bytes, grid=f"({_grid_doc(plan)})", arch=TARGET.name, gpu=TARGET.described,
                       strides="multiples of 8 elements (16 bytes)")
    return KernelSource(name, insert_used(text, helpers), meta)
