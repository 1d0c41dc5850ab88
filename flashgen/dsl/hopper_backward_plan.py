"""The plan of the wgmma backward (sm_90a): TMA tiles, the query-block ring, five warpgroup GEMMs.

One CTA owns key block ``kb`` (``B_c`` = 64 x consumers key rows of one kv head) and walks the query
blocks of ``B_r`` = 64 rows that meet it (:class:`~flashgen.attention.query_blocks.QueryBlocks`), for
every query head of its group, as the mma.sync backward does:

* warpgroup 0 is the **producer**: one thread loads K and V once (TMA, one barrier), then per query
  block Q with its lse and dO with its D into a ``stages``-deep ring (TMA boxes for the tiles, one
  bulk copy each for the statistics, which the preprocess writes padded to whole query blocks);
* consumer ``w`` owns key rows ``[64 w, 64 w + 64)``; per query block (``schedule``):

==========  ===============================  ===========================  ==============================
GEMM        consumer tile (m x n, k)         A operand                    B operand
==========  ===============================  ===========================  ==============================
``S``       S^T = K Q^T (64 x B_r, d)        sK, own rows, K-major        sQ, K-major
``dP``      dP^T = V dO^T (64 x B_r, d)      sV, own rows, K-major        sdO, K-major
``dV``      dV += P^T dO (64 x d, B_r)       P^T: S^T's accumulator       sdO, MN-major
``dK``      dK += dS^T Q (64 x d, B_r)       dS^T: dP^T's accumulator     sQ, MN-major
``dQ``      dQ = dS K (B_r x d/consumers,    sdS (every consumer's dS^T   sK, own columns, MN-major
            B_c)                             rows), MN-major
==========  ===============================  ===========================  ==============================

dS^T goes registers -> shared memory (``sdS``, two buffers: a consumer may store the next block's
while another still reads this one's) and, after a named barrier over the consumers, each consumer
computes ``d / consumers`` columns of the block's dQ and adds them into the fp32 buffer with
``red.global.add``. dK (times the scale) and dV go straight from the accumulators to global memory
once the loop ends.

The emitter (:mod:`flashgen.emit.hopper_backward_kernel`) and the CPU checks read these objects: the
tile layouts and offsets, descriptor fields and per-step offsets, the accumulator-to-A tables, the
barrier counts and the schedule.
"""
from __future__ import annotations

import functools

import attrs

from ..attention.backward import Recompute, RowDot, ScoreGrad
from ..attention.pipeline import MbarrierRing
from ..attention.query_blocks import QueryBlocks
from ..attention.score_mask import ScoreMask
from .atoms.hopper import Mbarrier, TmaLoad, WGMMA_64xNx16, kmajor_tile_layout, wgmma_kmajor_descriptors, wgmma_mnmajor_descriptors
from .backward_config import BackwardConfig
from .config import PRODUCER_REGS, WARPGROUP, WGMMA_M, consumer_regs
from .hopper_plan import BOX_COLS, SMEM_ALIGN, SWIZZLE, OperandDesc, SmemTile, TmaTile, WarpgroupGemm, _p_from_s
from .steps import ConvertP, Gemm, GradScores, Handoff, RecomputeP, ReduceGM, Release, Step, StoreRF, WaitFull, WgmmaWait

#: bytes of one query block's lse or D (fp32 per row), one bulk copy each
STAT = 4


@attrs.frozen
class DqStage:
    """How a consumer's dQ of a query block reaches the fp32 buffer: staged in shared memory in fragment
    order (the 32-bit values ``2p`` and ``2p+1`` of thread ``t`` at 8-byte slot ``128 p + t``: each
    warp's 8-byte stores fill 256 contiguous bytes, free of bank conflicts), then added with one
    ``cp.reduce.async.bulk`` into the same bytes of the buffer's chunk for (batch, head, query block,
    consumer). The buffer is flashgen's own workspace, so it keeps fragment order too; the dQ conversion
    finds element (row, col) of a query block with :meth:`index_cpp`, the inverse of the accumulator map."""

    offset: int  # bytes from the aligned shared-memory base: consumer w's region at offset + w * region_bytes
    rows: int  # B_r
    cols: int  # dQ columns per consumer
    consumers: int

    @property
    def region_bytes(self) -> int:
        return 4 * self.rows * self.cols

    def slot(self, thread: int, value: int) -> int:
        """The fp32 index, in a consumer's region, of accumulator value ``value`` of thread ``thread``."""
        return 2 * (128 * (value // 2) + thread) + value % 2

    def index_cpp(self) -> str:
        """``dq_chunk_index(r, c)``: the fp32 index of dQ element (row ``r`` of the query block, column ``c``)
        within the block's chunk (every consumer's region in order): the accumulator map of a 64 x n
        wgmma inverted (row ``16 w + 8 h + g``: warp ``w``, half ``h``, lane group ``g``; column
        ``8 j + 2 q + e``: thread ``32 w + 4 g + q`` holds it as value ``4 j + 2 h + e``)."""
        return f"""// the fp32 index of dQ element (r, c) of a query block in its chunk of the dQ buffer (DqStage's fragment order)
__host__ __device__ __forceinline__ uint32_t dq_chunk_index(uint32_t r, uint32_t c) {{
    const uint32_t consumer = c / {self.cols}u, cc = c % {self.cols}u;
    const uint32_t thread = 32u * (r / 16u) + 4u * (r % 8u) + (cc % 8u) / 2u;
    const uint32_t value = 4u * (cc / 8u) + 2u * ((r % 16u) / 8u) + cc % 2u;
    return consumer * {self.rows * self.cols}u + 2u * (128u * (value / 2u) + thread) + value % 2u;
}}"""


def _kmajor(name: str, rows: int, cols: int, dtype, offset: int, stages: int) -> SmemTile:
    return SmemTile(name, rows, cols, kmajor_tile_layout(rows, cols, dtype, SWIZZLE), offset, stages, rows * cols * dtype.size)


def smem_plan(cfg: BackwardConfig) -> tuple[dict, int]:
    """(name -> SmemTile or (offset, stages, stage bytes), total bytes with the alignment slack).

    Order: K, V (resident), Q and dO (``stages`` each), dS^T (2 buffers), lse and D (``stages`` each),
    the consumers' staged dQ (:class:`DqStage`), the mbarriers. Every 16-bit tile starts on the 1024-byte swizzle pattern."""
    d, B_r, B_c, st, dt = cfg.d_head, cfg.B_r, cfg.B_c, cfg.stages, cfg.dtype
    tiles, off = {}, 0
    for name, rows, cols, stages in (("K", B_c, d, 1), ("V", B_c, d, 1), ("Q", B_r, d, st), ("dO", B_r, d, st), ("dS", B_c, B_r, 2)):
        tiles[name] = _kmajor("s" + name, rows, cols, dt, off, stages)
        off += stages * tiles[name].stage_bytes
    for name in ("LSE", "D"):
        tiles[name] = (off, st, B_r * STAT)
        off += st * B_r * STAT
    tiles["dQ"] = DqStage(off, B_r, d // cfg.consumers, cfg.consumers)
    off += cfg.consumers * tiles["dQ"].region_bytes
    tiles["barriers"] = (off, 0, 8)
    off += 8 * (1 + 4 * st)  # kv_full; q_full, do_full, q_empty, do_empty per stage
    return tiles, off + SMEM_ALIGN


@attrs.frozen
class HopperBackwardPlan:
    cfg: BackwardConfig
    tiles: dict  # K, V, Q, dO, dS -> SmemTile
    stats: dict  # LSE, D -> (offset, stages, bytes per stage)
    loads: dict  # K, V, Q, dO -> TmaTile
    barriers: dict  # name -> (Mbarrier, offset, stages)
    #: one use per (query head, query block) work item of the CTA: Q + lse on q_*, dO + D on do_*
    ring: MbarrierRing
    #: arrivals of one consumer's release on an empty barrier: every thread's (each read the stage's lse
    #: or D itself, so each orders its own reads before the producer's next fill)
    release_arrivals: int
    gemms: dict  # S, dP, dV, dK, dQ -> WarpgroupGemm
    #: [k16 step][A reg] -> (accumulator value lo, hi): P^T -> A of dV and dS^T -> A of dK (one table)
    a_from_acc: tuple
    #: columns of dQ per consumer (consumer w: columns from w * dq_cols)
    dq_cols: int
    #: where each consumer stages its dQ for the bulk reductions
    dq_stage: DqStage
    schedule: tuple[Step, ...]
    score_mask: ScoreMask
    query_blocks: QueryBlocks
    recompute: Recompute
    score_grad: ScoreGrad
    row_dot: RowDot
    producer_regs: int
    consumer_regs: int
    smem_bytes: int

    @property
    def consumers(self) -> int:
        return self.cfg.consumers

    @property
    def threads(self) -> int:
        return WARPGROUP * (1 + self.consumers)


def item_order(items: int, kb: int) -> list[int]:
    """The order in which the CTA of key block ``kb`` walks its ``items`` work items: from item ``kb`` on,
    cyclically, so that the key blocks' CTAs, which run side by side, add into different query blocks of dQ
    at any one time instead of all into the same rows."""
    return [(w + kb) % items for w in range(items)]


ITEM_ORDER_CPP = "(w + kb) % work"


def _kmajor_desc(operand: str, rows: int, cols: int, dtype, rows_per_wgmma: int) -> OperandDesc:
    """A K-major operand of a ``rows x cols`` tile: steps along its columns, consumer blocks down its rows."""
    ds = wgmma_kmajor_descriptors(0, rows, cols, dtype, SWIZZLE, rows_per_wgmma=rows_per_wgmma)
    return OperandDesc(operand, "K", ds[0][0].leading_byte_offset, ds[0][0].stride_byte_offset, SWIZZLE,
                       tuple(x.start_address for x in ds[0]), row_block_offset=ds[1][0].start_address if len(ds) > 1 else 0)


def _mnmajor_desc(operand: str, k_rows: int, n_cols: int, dtype, block_cols: int = 0) -> OperandDesc:
    """An MN-major operand of a ``k_rows x n_cols`` tile (the reduction down its rows); consumer ``w``
    starts ``w * block_cols`` columns in (within a 64-column box or whole boxes further)."""
    ds = wgmma_mnmajor_descriptors(0, k_rows, n_cols, dtype, SWIZZLE)
    box = SWIZZLE.span_bytes // dtype.size
    block = (block_cols // box) * k_rows * SWIZZLE.span_bytes + (block_cols % box) * dtype.size
    return OperandDesc(operand, "MN", ds[0].leading_byte_offset, ds[0].stride_byte_offset, SWIZZLE,
                       tuple(x.start_address for x in ds), row_block_offset=block)


def _schedule() -> tuple[Step, ...]:
    """A consumer's steps per query block (the ring's use ``w``, the dS buffer ``w % 2``)."""
    return (
        WaitFull("Q", why="Q and its lse landed"),
        Gemm("S", why="S^T = K_w Q^T"),
        WaitFull("dO", why="dO and its D landed"),
        Gemm("dP", why="dP^T = V_w dO^T, in flight with S^T"),
        WgmmaWait("1", why="S^T ready (dP^T may still run)"),
        RecomputeP(why="P^T = exp2(S^T * scale log2e - lse log2e), the score mask where the block needs it"),
        ConvertP("P", why="P^T -> 16-bit A fragments of dV"),
        Gemm("dV", why="dV += P^T dO"),
        WgmmaWait("1", why="dP^T ready (dV may still run)"),
        GradScores(why="dS^T = P^T (dP^T - D)"),
        ConvertP("dS", why="dS^T -> 16-bit A fragments of dK"),
        StoreRF("dS", why="dS^T -> sdS[w % 2] for every consumer's dQ"),
        Gemm("dK", why="dK += dS^T Q"),
        Handoff("dS", why="every consumer's dS^T rows stored (and visible to wgmma)"),
        Gemm("dQ", why="dQ = dS K, this consumer's columns"),
        WgmmaWait("0", why="dV, dK, dQ done: Q and dO read for the last time"),
        Release("Q"),
        Release("dO"),
        ReduceGM("dQ", why="dQ staged in shared memory, added into the fp32 buffer by one bulk reduction"),
    )


@functools.lru_cache(maxsize=None)
def make_hopper_backward_plan(cfg: BackwardConfig) -> HopperBackwardPlan:
    """The DSL objects of one wgmma backward config."""
    if cfg.engine != "wgmma":
        raise ValueError(f"{cfg.short_form()} is an engine={cfg.engine} backward; make_hopper_backward_plan builds wgmma ones")
    d, B_r, B_c, dt, n = cfg.d_head, cfg.B_r, cfg.B_c, cfg.dtype, cfg.consumers
    layout, smem = smem_plan(cfg)
    tiles = {k: layout[k] for k in ("K", "V", "Q", "dO", "dS")}
    loads = {name: TmaTile(tiles[name], TmaLoad(tiles[name].rows, BOX_COLS, dt, SWIZZLE), "kv" if name in ("K", "V") else "q")
             for name in ("K", "V", "Q", "dO")}
    bar0 = layout["barriers"][0]
    barriers, off = {}, bar0
    for name, stages, count in (("kv_full", 1, 1), ("q_full", cfg.stages, 1), ("do_full", cfg.stages, 1),
                                ("q_empty", cfg.stages, WARPGROUP * n), ("do_empty", cfg.stages, WARPGROUP * n)):  # release_arrivals each
        barriers[name] = (Mbarrier(name, count), off, stages)
        off += 8 * stages
    dq_cols = d // n
    atom_s, atom_kv, atom_q = WGMMA_64xNx16(dt, B_r), WGMMA_64xNx16(dt, d), WGMMA_64xNx16(dt, dq_cols)
    gemms = {
        "S": WarpgroupGemm("S", atom_s, "smem", _kmajor_desc("K", B_c, d, dt, WGMMA_M), _kmajor_desc("Q", B_r, d, dt, B_r), trans_b=False),
        "dP": WarpgroupGemm("dP", atom_s, "smem", _kmajor_desc("V", B_c, d, dt, WGMMA_M), _kmajor_desc("dO", B_r, d, dt, B_r), trans_b=False),
        "dV": WarpgroupGemm("dV", atom_kv, "regs", None, _mnmajor_desc("dO", B_r, d, dt), trans_b=True),
        "dK": WarpgroupGemm("dK", atom_kv, "regs", None, _mnmajor_desc("Q", B_r, d, dt), trans_b=True),
        "dQ": WarpgroupGemm("dQ", atom_q, "smem", _mnmajor_desc("dS", B_c, B_r, dt), _mnmajor_desc("K", B_c, d, dt, dq_cols),
                            trans_b=True, trans_a=True),
    }
    mask = ScoreMask(cfg.mask, B_r, B_c)
    return HopperBackwardPlan(
        cfg=cfg, tiles=tiles, stats={k: layout[k] for k in ("LSE", "D")}, loads=loads, barriers=barriers,
        ring=MbarrierRing("qdo", cfg.stages, per_tile=True, stages_name="STAGES"), release_arrivals=WARPGROUP, gemms=gemms,
        a_from_acc=_p_from_s(atom_s, atom_kv, B_r // 16), dq_cols=dq_cols, dq_stage=layout["dQ"], schedule=_schedule(),
        score_mask=mask, query_blocks=QueryBlocks(mask), recompute=Recompute(), score_grad=ScoreGrad(), row_dot=RowDot(),
        producer_regs=PRODUCER_REGS, consumer_regs=consumer_regs(n), smem_bytes=smem,
    )
