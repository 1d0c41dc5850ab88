"""The plan of the wgmma backward (sm_90a): TMA tiles, the query-block ring, five warpgroup GEMMs.

One CTA owns key block ``kb`` (``B_c`` = 64 x consumers key rows of one kv head) and walks the query
blocks of ``B_r`` rows (64; 128 at d_head 64 or 80 at d_head 128:
:data:`~flashgen.dsl.backward_config.WGMMA_B_RS`) that meet it (:class:`~flashgen.attention.query_blocks.QueryBlocks`), for every query head of its group, as
the mma.sync backward does:

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
``dQ``      dQ = dS K (64 x n, B_c)          sdS (every consumer's dS^T   sK, own columns, MN-major
            (B_r 64 or 128)                  rows; own query columns),
                                             MN-major
``dQ``      dQ^T = K^T dS^T (64 x 80, B_c)   sK, own columns of d_head,   sdS stored [query][key]
            (B_r 80)                         MN-major                     (dS), K-major
==========  ===============================  ===========================  ==============================

The consumers split the block's dQ (:class:`~flashgen.dsl.hopper_backward_smem.DqStage`) by columns at
``B_r`` = 64 (each all 64 query rows x ``n`` = d / consumers columns) and by rows at ``B_r`` = 128 (each
64 query rows x ``n`` = d columns, the A operand starting at its query columns of the dS^T tile).

Query blocks of 80 rows (d_head 128; 80 is no wgmma M, but a wgmma N) make dQ transposed, dQ^T = K^T dS^T:
consumer ``w``'s M is columns ``[64 w, 64 w + 64)`` of d_head (A: sK MN-major from that column box), N the 80
query rows (B: the dS tile stored [query][key], K-major, written from the S^T-shaped accumulators with
``stmatrix .trans``: :class:`~flashgen.dsl.hopper_backward_smem.DsStore`).

dS^T goes registers -> shared memory (``sdS``, two buffers: a consumer may store the next block's
while another still reads this one's) and, after a named barrier over the consumers, each consumer
computes its part of the block's dQ and adds it into the fp32 buffer with
``red.global.add.v4.f32`` straight from the accumulators (:class:`~flashgen.dsl.hopper_backward_smem.DqStage`).
Once the loop ends and every consumer's last dQ GEMM read sK (a barrier over the consumers), each stages dK (times
the scale) over its own 64 rows of sK and dV over its rows of sV, in the tiles' layouts, and one of its threads
writes them with TMA stores of 64-row boxes (``stores``): whole 128-byte rows instead of the accumulators' 4-byte
pieces, which doubled the kernel's L2 write sectors and kept the warps waiting on their stores.

``deterministic``: each consumer stages its dQ in shared memory, and its bulk reduction of a query block
waits until the key blocks below this one that visit the query block have made theirs (a turn counter
per query block and consumer, :meth:`~flashgen.attention.query_blocks.QueryBlocks.key_rank`) and passes
the turn once it completed, so every dQ element is summed in ascending key blocks; the CTAs then walk
their query blocks upwards.

The emitter (:mod:`flashgen.emit.hopper_backward_kernel`) and the CPU checks read these objects: the
tile layouts and offsets, descriptor fields and per-step offsets, the accumulator-to-A tables, the
barrier counts and the schedule.
"""
from __future__ import annotations

import functools

from typing import Any

import attrs

from ..attention.backward import Recompute, RowDot, ScoreGrad
from ..attention.backward_grid import BackwardGrid
from ..attention.item_walk import ItemWalk
from ..attention.pipeline import MbarrierRing
from ..attention.query_blocks import QueryBlocks
from ..attention.score_mask import ScoreMask
from .atoms.hopper import Mbarrier, TmaLoad, TmaStore, WGMMA_64xNx16, wgmma_kmajor_descriptors, wgmma_mnmajor_descriptors
from .backward_config import BackwardConfig
from .config import PRODUCER_REGS, WARPGROUP, WGMMA_M, consumer_regs
from .hopper_backward_smem import DqStage, DsStore, smem_plan
from .hopper_plan import BOX_COLS, SWIZZLE, OperandDesc, TmaTile, WarpgroupGemm, WarpSpecialized, _p_from_s
from .steps import (ConvertP, Gemm, GradScores, Handoff, RecomputeP, ReduceGM, Release, SignalOrder, Step, StoreRF, WaitFull,
                    WaitOrder, WgmmaWait)

#: the orders of a consumer's score steps per query block, by when it waits for dP^T and makes dS^T (:func:`_score_steps`)
SCORE_ORDERS = ("split", "fused", "exp_first")


@attrs.frozen
class HopperBackwardPlan(WarpSpecialized):
    cfg: BackwardConfig
    tiles: dict  # K, V, Q, dO, dS -> SmemTile
    stats: dict  # LSE, D -> (offset, stages, bytes per stage)
    loads: dict  # K, V, Q, dO -> TmaTile
    #: dK, dV -> TmaTile over sK, sV: consumer w stages its rows [64 w, 64 w + 64) and stores the boxes starting there
    stores: dict
    barriers: dict  # name -> (Mbarrier, offset, stages)
    #: one use per (query head, query block) work item of the CTA: Q + lse on q_*, dO + D on do_*
    ring: MbarrierRing
    #: arrivals of one consumer's release on an empty barrier: every thread's (each read the stage's lse
    #: or D itself, so each orders its own reads before the producer's next fill)
    release_arrivals: int
    gemms: dict  # S, dP, dV, dK, dQ -> WarpgroupGemm
    #: [k16 step][A reg] -> (accumulator value lo, hi): P^T -> A of dV and dS^T -> A of dK (one table)
    a_from_acc: tuple
    #: the order of a consumer's score steps: one of :data:`SCORE_ORDERS` (:func:`_score_order`)
    score_order: str = attrs.field(validator=attrs.validators.in_(SCORE_ORDERS))
    #: columns of dQ per consumer (consumer w: from dq_stage.col0(w), rows from dq_stage.row0(w))
    dq_cols: int
    #: where each consumer stages its dQ for the bulk reductions
    dq_stage: DqStage
    #: how dS^T goes from the accumulators into the dS tile
    ds_store: DsStore
    schedule: tuple[Step, ...]
    score_mask: ScoreMask
    query_blocks: QueryBlocks
    recompute: Recompute
    score_grad: ScoreGrad
    row_dot: RowDot
    producer_regs: int
    consumer_regs: int
    smem_bytes: int
    #: which block of the grid computes which key block, in what order the CTAs start (the config's ``longest_first``)
    grid: BackwardGrid
    #: the order a CTA walks its (query head, query block) items: rotated by its key block, unless dQ's adds are ordered
    items: ItemWalk

    @property
    def grad_with_p(self) -> bool:
        """dS^T made in the pass that recomputes P^T (the ``fused`` order)."""
        return self.score_order == "fused"

    @property
    def uniform_warpgroup(self) -> bool:
        """Whether the kernel takes its warpgroup index as a value ptxas knows is the same across a warp (broadcast
        from lane 0), so that the shared-memory descriptors made from it stay in uniform registers: at d_head 128 the
        item loop's SASS has 874 instructions instead of 966 (no R2UR and 64-bit add before each wgmma). Not with a
        score_mod whose derivative reads the score: there ptxas spilled 12 bytes with softcap (none without)."""
        return not self.score_mask.derivative_reads_score

    @property
    def stat_pairs(self) -> bool:
        """Whether a consumer reads the lse and D of two adjacent query columns with one 8-byte load (its accumulator
        values four at a time). Not with a score_mod whose derivative reads the score: softcap's consumer then
        spilled 60 bytes (none with one value at a time)."""
        return not self.score_mask.derivative_reads_score


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


def _score_steps(order: str, reads_score: bool = False) -> tuple[Step, ...]:
    """From S^T's wait to dS^T in sdS (``order``, :data:`SCORE_ORDERS`):

    * ``split``: P^T, its fragments and dV's GEMM before dP^T's wait, then dS^T (64-row query blocks: the fp32
      P^T and dP^T of 32 values each fit beside the fragments, and dV runs under the wait);
    * ``fused``: both waited for, P^T and dS^T made in one pass, for a score_mod whose derivative reads the
      score (``reads_score``: another pass would keep the raw score, a register per value), and for wider query
      blocks without ``exp_first``;
    * ``exp_first``: the exponentials under dP^T's GEMM, then dS^T, P^T's fragments (its fp32 values die before
      dS^T's are packed), dS^T's fragments and store, and dV last (wider query blocks, the config's ``exp_first``,
      shipped at d_head 64; with dV issued before dP^T's wait the fp32 P^T, its fragments and dP^T were live
      beside dK and dV, and ptxas spilled 48 bytes at 128 rows, 64 at 80, and serialized the wgmma; dV issued
      before dS^T's store serialized it too, and P^T packed after the store spilled 24 bytes at 128 rows with one
      stage and ordered adds)."""
    ds = (ConvertP("dS", why="dS^T -> 16-bit A fragments of dK"), StoreRF("dS", why="dS^T -> sdS[w % 2] for every consumer's dQ"))
    p, dv = ConvertP("P", why="P^T -> 16-bit A fragments of dV"), Gemm("dV", why="dV += P^T dO")
    plain = "P^T = exp2(S^T * scale log2e - lse log2e), the score mask where the block needs it"
    if order == "fused":
        score = "score_mod(S^T * scale) log2e" if reads_score else "S^T * scale log2e"
        return (WgmmaWait("0", why="S^T and dP^T ready"),
                RecomputeP(why=f"P^T = exp2({score} - lse log2e), the score mask where the block needs it"),
                GradScores(why="dS^T = P^T (dP^T - D)" + (" score_mod'" if reads_score else "") + ", in the same pass"), p, dv, *ds)
    if order == "exp_first":
        return (WgmmaWait("1", why="S^T ready (dP^T may still run)"), RecomputeP(why=plain + ", while dP^T runs"),
                WgmmaWait("0", why="dP^T ready"), GradScores(why="dS^T = P^T (dP^T - D)"), p, *ds, dv)
    return (WgmmaWait("1", why="S^T ready (dP^T may still run)"), RecomputeP(why=plain), p, dv,
            WgmmaWait("1", why="dP^T ready (dV may still run)"), GradScores(why="dS^T = P^T (dP^T - D)"), *ds)


def _schedule(deterministic: bool, score_order: str = "split", reads_score: bool = False) -> tuple[Step, ...]:
    """A consumer's steps per query block (the ring's use ``w``, the dS buffer ``w % 2``); ``deterministic``:
    its dQ added in its turn among the key blocks that visit the query block (ascending); the score steps in
    ``score_order`` (:func:`_score_steps`). The consumers issue S^T and dP^T each when ready: taking turns (a
    named barrier passed after dP^T's issue, so that one consumer's exponentials run under the other's GEMMs)
    ran 0.96-1.03x as fast on an H200 (bf16, d_head 64 and 128, seq 2048 / 8192, one A/B of 2 rounds)."""
    ordered = (WaitOrder("dQ", why="the lower key blocks' adds of this consumer's dQ columns made"),) if deterministic else ()
    signal = (SignalOrder("dQ", why="this add complete: the next key block's turn"),) if deterministic else ()
    return (
        WaitFull("Q", why="Q and its lse landed"),
        Gemm("S", why="S^T = K_w Q^T"),
        WaitFull("dO", why="dO and its D landed"),
        Gemm("dP", why="dP^T = V_w dO^T, in flight with S^T"),
        *_score_steps(score_order, reads_score),
        *(_ordered_tail(ordered, signal) if deterministic else _overlapped_tail()),
    )


#: dQ's add into the fp32 buffer, which every item ends with (DqStage: straight from the accumulators, or staged when ordered)
_REDUCE_DQ = ReduceGM("dQ", why="dQ added into the fp32 buffer (DqStage)")


def _overlapped_tail() -> tuple[Step, ...]:
    """dQ before dK, so that dQ's add (staged through shared memory, two barriers) runs while the tensor cores do dK
    instead of after every GEMM of the item retired."""
    return (Handoff("dS", why="every consumer's dS^T rows stored (and visible to wgmma)"),
            Gemm("dQ", why="dQ = dS K, this consumer's columns"),
            Gemm("dK", why="dK += dS^T Q, in flight while dQ is added"),
            WgmmaWait("1", why="dV and dQ done (dK may still run)"),
            _REDUCE_DQ,
            WgmmaWait("0", why="dK done: Q and dO read for the last time"),
            Release("Q"), Release("dO"))


def _ordered_tail(ordered: tuple, signal: tuple) -> tuple[Step, ...]:
    """dK before dQ and both retired before dQ's ordered add: dK's registers would stay live through the wait
    for the lower key blocks' adds (ptxas spilled 24 bytes at d_head 128)."""
    return (Gemm("dK", why="dK += dS^T Q"),
            Handoff("dS", why="every consumer's dS^T rows stored (and visible to wgmma)"),
            Gemm("dQ", why="dQ = dS K, this consumer's columns"),
            WgmmaWait("0", why="dV, dK, dQ done: Q and dO read for the last time"),
            Release("Q"), Release("dO"),
            *ordered, _REDUCE_DQ, *signal)


def _dq_gemm(dq: DqStage, atom: WGMMA_64xNx16, B_r: int, B_c: int, d: int, dt) -> WarpgroupGemm:
    """Consumer w's dQ: dQ = dS K (M = its 64 query rows or all 64, N = dq.cols of K's columns from dq.col0(w); A the
    dS^T tile read MN-major, B sK MN-major), or with ``dq.transposed`` dQ^T = K^T dS^T (M = its 64 columns of d_head,
    N = the B_r query rows; A sK MN-major from dq.col0(w), B the [query][key] dS tile K-major)."""
    if dq.transposed:
        return WarpgroupGemm("dQ", atom, "smem", _mnmajor_desc("K", B_c, d, dt, dq.col0(1)), _kmajor_desc("dS", B_r, B_c, dt, B_r),
                             trans_b=False, trans_a=True)
    # dS's query rows (dS^T's columns) from dq.row0(w), K's columns from dq.col0(w); both w times consumer 1's
    return WarpgroupGemm("dQ", atom, "smem", _mnmajor_desc("dS", B_c, B_r, dt, dq.row0(1)), _mnmajor_desc("K", B_c, d, dt, dq.col0(1)),
                         trans_b=True, trans_a=True)


def _score_order(cfg: BackwardConfig, mask: ScoreMask) -> str:
    """``split`` for query blocks of one wgmma M of 64 rows; past it ``exp_first`` where the config asks for it,
    else ``fused`` (the split order there keeps the fp32 P^T, its fragments and dP^T beside dK and dV: ptxas
    spilled 48 bytes and serialized the wgmma at d_head 64, B_r 128); ``fused`` for a score_mod whose derivative
    reads the score at any size (:func:`_score_steps`)."""
    if mask.derivative_reads_score:
        return "fused"
    if cfg.B_r <= WGMMA_M:
        return "split"
    return "exp_first" if cfg.exp_first else "fused"


@functools.lru_cache(maxsize=None)
def make_hopper_backward_plan(cfg: BackwardConfig, mods: Any = None) -> HopperBackwardPlan:
    """The DSL objects of one wgmma backward config; ``mods`` as :func:`flashgen.dsl.backward_plan.make_backward_plan`."""
    if cfg.engine != "wgmma":
        raise ValueError(f"{cfg.short_form()} is an engine={cfg.engine} backward; make_hopper_backward_plan builds wgmma ones")
    d, B_r, B_c, dt, n = cfg.d_head, cfg.B_r, cfg.B_c, cfg.dtype, cfg.consumers
    layout, smem = smem_plan(cfg)
    tiles = {k: layout[k] for k in ("K", "V", "Q", "dO", "dS")}
    loads = {name: TmaTile(tiles[name], TmaLoad(tiles[name].rows, BOX_COLS, dt, SWIZZLE), "kv" if name in ("K", "V") else "q")
             for name in ("K", "V", "Q", "dO")}
    bar0 = layout["barriers"][0]
    barriers, off = {}, bar0
    freed = (("dq_empty", 1, 1),) if layout["dQ"].by_producer else ()  # the producer's reductions read the dQ regions
    for name, stages, count in (("kv_full", 1, 1), ("q_full", cfg.stages, 1), ("do_full", cfg.stages, 1),
                                ("q_empty", cfg.stages, WARPGROUP * n), ("do_empty", cfg.stages, WARPGROUP * n), *freed):  # release_arrivals each
        barriers[name] = (Mbarrier(name, count), off, stages)
        off += 8 * stages
    dq = layout["dQ"]
    dq_cols = dq.cols
    atom_s, atom_kv, atom_q = WGMMA_64xNx16(dt, B_r), WGMMA_64xNx16(dt, d), WGMMA_64xNx16(dt, dq_cols)
    gemms = {
        "S": WarpgroupGemm("S", atom_s, "smem", _kmajor_desc("K", B_c, d, dt, WGMMA_M), _kmajor_desc("Q", B_r, d, dt, B_r), trans_b=False),
        "dP": WarpgroupGemm("dP", atom_s, "smem", _kmajor_desc("V", B_c, d, dt, WGMMA_M), _kmajor_desc("dO", B_r, d, dt, B_r), trans_b=False),
        "dV": WarpgroupGemm("dV", atom_kv, "regs", None, _mnmajor_desc("dO", B_r, d, dt), trans_b=True),
        "dK": WarpgroupGemm("dK", atom_kv, "regs", None, _mnmajor_desc("Q", B_r, d, dt), trans_b=True),
        "dQ": _dq_gemm(dq, atom_q, B_r, B_c, d, dt),
    }
    stores = {grad: TmaTile(tiles[src], TmaStore(WGMMA_M, BOX_COLS, dt, SWIZZLE), "kv") for grad, src in (("dK", "K"), ("dV", "V"))}
    mask = ScoreMask(cfg.mask, B_r, B_c, mods)
    order = _score_order(cfg, mask)
    return HopperBackwardPlan(
        cfg=cfg, tiles=tiles, stats={k: layout[k] for k in ("LSE", "D")}, loads=loads, stores=stores, barriers=barriers,
        ring=MbarrierRing("qdo", cfg.stages, per_tile=True, stages_name="STAGES"), release_arrivals=WARPGROUP, gemms=gemms,
        a_from_acc=_p_from_s(atom_s, atom_kv, B_r // 16), dq_cols=dq_cols, dq_stage=dq, ds_store=layout["dS_store"], score_order=order,
        schedule=_schedule(cfg.deterministic, order, mask.derivative_reads_score),
        score_mask=mask, query_blocks=QueryBlocks(mask), recompute=Recompute(), score_grad=ScoreGrad(), row_dot=RowDot(),
        producer_regs=PRODUCER_REGS, consumer_regs=consumer_regs(n), smem_bytes=smem,
        grid=BackwardGrid(longest_first=cfg.longest_first), items=ItemWalk(rotates=not cfg.deterministic),
    )
