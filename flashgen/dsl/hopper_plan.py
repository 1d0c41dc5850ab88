"""The plan of a Hopper (wgmma engine) kernel: TMA tiles, the K/V ring, descriptors, roles, schedule.

FlashAttention-3-style forward, one CTA per ``B_r`` query rows of one head:

* warpgroup 0 is the **producer**: after ``setmaxnreg.dec`` one thread issues TMA loads
  (Q once, then K_j and V_j into a ``stages``-deep ring), each completing on a "full"
  mbarrier with transaction bytes, after waiting on the stage's "empty" mbarrier;
* warpgroups 1.. are **consumers** of 64 query rows each (``setmaxnreg.inc``):
  ``S = Q K_j^T`` (wgmma, B from shared memory K-major; A = Q's fragments, loaded once per tile
  by ldmatrix where they fit the register budget, else Q's tile by descriptor), online softmax on the
  accumulator registers, ``O += P V_j`` (wgmma, A = P from registers, B = V MN-major),
  releasing each stage with one arrival per warp on its "empty" barrier;
* ``pingpong``: the consumers take turns issuing GEMMs (a ring of named barriers), so one's
  softmax runs under the others' tensor-core work; ``intra_overlap``: S_j and
  O += P_{j-1} V_{j-1} are issued back to back and the softmax of S_j runs while PV is
  in flight;
* ``persistent``: CTAs loop over tiles (query block, head, batch); the output is staged in
  its own tile and the consumers release Q (``q_empty``) once the last S GEMM retired, so the
  producer loads the next tile's Q and K/V while this tile's epilogue runs; a partial last
  round's tiles are split by key blocks over the idle CTAs (``tail_split``; with a mask, and
  for one CTA per tile, only when there are fewer tiles than SMs);
* the epilogue: each consumer stages its 64 output rows in shared memory (Q's swizzled
  layout) and one of its threads hands them to TMA stores (``stores``), so the warps do not
  wait for global writes; the staging bytes are rewritten only after the stores read them.

Every object here is read by both the emitter (:mod:`flashgen.emit.hopper_kernel`) and the
simulator (:mod:`flashgen.sim.hopper`): shared-memory placement (``tma_tile`` layouts),
descriptor fields and per-step offsets, the P-from-S register table, the barrier counts
and the consumer schedule.
"""
from __future__ import annotations

import functools

from typing import TYPE_CHECKING

import attrs

from ..attention.pipeline import MbarrierRing
from ..attention.scheduler import TileScheduler, orders_tiles
from .atoms.hopper import (
    GmmaSwizzle,
    Mbarrier,
    SmemDescriptor,
    TmaLoad,
    TmaStore,
    WGMMA_64xNx16,
    kmajor_tile_layout,
    wgmma_kmajor_descriptors,
    wgmma_mnmajor_descriptors,
)
from .atoms.copy import SM2RF, CopyAtom, ldmatrix_x4_rows_then_cols
from .config import PRODUCER_REGS, WARPGROUP, WGMMA_M, KernelConfig, consumer_regs
from .layout import Layout
from ..attention.score_mask import ScoreMask
from .plan import _row_reduce_lanes
from .steps import (LAST, PREV, ConvertP, FinishRows, Gemm, Guard, J, Pass, Release, RescaleO, Softmax, Step, StoreO, Turn, WaitFull,
                    WgmmaWait)
from .swizzle import ComposedLayout, Swizzle
from .tail_split import TailSplit
from .tiling import Loop, Partition

if TYPE_CHECKING:
    from ..mods.kernel_mods import KernelMods

SWIZZLE = GmmaSwizzle.B128
BOX_COLS = SWIZZLE.span_bytes // 2  # 64 16-bit columns per TMA box (one 128-byte swizzle row)
#: parts a wave-tail tile splits into at most (each part reloads Q and refills the pipeline)
TAIL_MAX_PARTS = 8
SMEM_ALIGN = 1024  # the 128B swizzle pattern repeats every 1024 bytes of absolute address


@attrs.frozen
class SmemTile:
    """One operand tile in shared memory: ``layout(row, col)`` -> element offset from its stage base."""

    name: str
    rows: int
    cols: int
    layout: ComposedLayout
    offset: int  # bytes from the 1024-aligned shared-memory base
    stages: int
    stage_bytes: int

    def stage_offset(self, s: int) -> int:
        return self.offset + s * self.stage_bytes

    def __str__(self) -> str:
        st = f" x {self.stages} stages" if self.stages > 1 else ""
        return f"{self.name}[{self.rows}x{self.cols}]{st} @ {self.offset}: {self.layout}"


@attrs.frozen
class TmaTile:
    """How a tile is filled: ``tma`` boxes over (rows of ``row_coord``, 64-column blocks)."""

    tile: SmemTile
    tma: TmaLoad
    row_coord: str  # "q" (query rows of the CTA) or "kv" (key rows of block j)

    @property
    def bytes(self) -> int:
        """expect_tx of one tile: every box's bytes (zero-filled out-of-bounds included)."""
        return self.tile.stage_bytes

    @property
    def boxes(self):
        return self.tma.coverage(self.tile.rows, self.tile.cols)


@attrs.frozen
class OperandDesc:
    """A wgmma operand's descriptors: fields shared by all steps, start offsets per k16 step.

    ``start(base, s)`` is ``base + step_offsets[s]`` (+ ``row_block_offset * block`` for the part of
    the tile consumer ``block`` reads: its A rows, or the backward dQ's B columns); LBO/SBO/swizzle
    are constant.
    """

    operand: str
    major: str  # "K" or "MN"
    lbo: int
    sbo: int
    swizzle: GmmaSwizzle
    step_offsets: tuple[int, ...]
    row_block_offset: int = 0

    def descriptor(self, base: int, step: int, block: int = 0) -> SmemDescriptor:
        return SmemDescriptor(base + self.row_block_offset * block + self.step_offsets[step], self.lbo, self.sbo, self.swizzle)


@attrs.frozen
class RegisterLoad:
    """A shared-memory tile's rows -> a consumer's A fragments: ``atom`` (ldmatrix.x4) per warp and k16
    step, lanes pointing where ``partition`` says (rows relative to the consumer's first row; warp w
    adds ``partition.warp_row_step`` rows, k16 step ``kk`` 16 columns). Register i of step ``kk``
    is A register i of that step's wgmma (``atom.a_map`` of the GEMM it feeds)."""

    name: str
    tile: str  # "Q"
    atom: CopyAtom
    partition: Partition


@attrs.frozen
class WarpgroupGemm:
    """One consumer GEMM: ``k_steps`` wgmma of ``atom``; A from shared memory or registers; ``trans_a``:
    A read MN-major from shared memory (the backward's dQ reads dS^T's tile as dS)."""

    name: str
    atom: WGMMA_64xNx16
    a_from: str  # "smem" or "regs"
    a: "OperandDesc | None"
    b: OperandDesc
    trans_b: bool
    trans_a: bool = False

    @property
    def k_steps(self) -> int:
        return len(self.b.step_offsets)


class WarpSpecialized:
    """A plan of one TMA producer warpgroup and ``cfg.consumers`` consumer warpgroups (both engines' wgmma
    kernels, forward and backward)."""

    @property
    def consumers(self) -> int:
        return self.cfg.consumers

    @property
    def threads(self) -> int:
        return WARPGROUP * (1 + self.consumers)


@attrs.frozen
class HopperPlan(WarpSpecialized):
    cfg: KernelConfig
    tiles: dict  # Q, K, V, O (O stages the output per consumer rows: in Q's space, or after the ring when persistent)
    loads: dict  # Q, K, V -> TmaTile
    stores: dict  # O -> TmaTile: each consumer stores its 64 staged rows (TmaStore boxes of 64 rows)
    barriers: dict  # name -> (Mbarrier, offset, count per stage)
    #: the K/V ring's stages and phases (k_* and v_* barriers, one use per key block) and Q's one slot
    #: (q_* barriers, one use per tile), counted over the CTA's tiles
    kv_ring: MbarrierRing
    q_ring: MbarrierRing
    gemm_S: WarpgroupGemm
    gemm_O: WarpgroupGemm
    #: Q's A fragments loaded once per tile when S reads A from registers (``cfg.q_in_registers``), else None
    q_load: "RegisterLoad | None"
    p_from_s: tuple[tuple[tuple[int, int], ...], ...]  # [k16 step][A reg] -> (S value lo, S value hi)
    o_stage: ComposedLayout  # (CTA row, col) of the output tile -> element offset (Q's layout)
    #: tile order, grid size, persistent rounds and the wave-tail split (a partial last round's tiles
    #: split over idle CTAs: persistent and unmasked; masked and one-CTA-per-tile kernels split only
    #: launches of fewer tiles than SMs)
    scheduler: TileScheduler
    score_mask: ScoreMask
    row_reduce_lanes: tuple[int, ...]
    #: a tile with key blocks starts with ``tile_start`` (its Q landed), walks the blocks (``prologue``
    #: on the first, ``body`` on the rest, ``epilogue`` after the last) and ends with ``tile_output``
    #: (row sums, 1/l and LSE, then O / l staged and stored), which every tile runs
    tile_start: tuple[Step, ...]
    prologue: tuple[Step, ...]
    body: tuple[Step, ...]
    epilogue: tuple[Step, ...]
    tile_output: tuple[Step, ...]
    producer_regs: int
    consumer_regs: int
    smem_bytes: int

    @property
    def tail_split(self) -> TailSplit:
        return self.scheduler.tail


def _p_from_s(atom_s: WGMMA_64xNx16, atom_o: WGMMA_64xNx16, k_steps: int) -> tuple:
    """For each k16 step of P V and each 32-bit A register: the two S accumulator values it packs.

    Derived by matching maps: A value ``v`` of step ``t`` needs ``P[row, 16 t + col]`` at
    ``a_map(thread, v)``; the table names the S accumulator value (``c_map``) holding that
    element in thread 0 -- the "accumulator reused as A operand" rule. That every thread holds
    its element at the same index is proven in the verification step
    (:func:`flashgen.sim.verify.p_from_s_problems`), not here.
    """
    c_rows, c_cols = atom_s.c_map.tables()
    a_rows, a_cols = atom_o.a_map.tables()
    where = {(int(r), int(c)): i for i, (r, c) in enumerate(zip(c_rows[0], c_cols[0]))}
    out = []
    for t in range(k_steps):
        regs = []
        for r in range(4):
            pair = []
            for v in (2 * r, 2 * r + 1):
                row, col = int(a_rows[0, v]), 16 * t + int(a_cols[0, v])
                if (row, col) not in where:
                    raise AssertionError(f"P[{row}, {col}] is not in thread 0's S accumulator")
                pair.append(where[(row, col)])
            regs.append(tuple(pair))
        out.append(tuple(regs))
    return tuple(out)


def _schedule(cfg: KernelConfig) -> tuple[tuple[Step, ...], tuple[Step, ...], tuple[Step, ...]]:
    """The consumer warpgroup's steps. ``turn``/``pass`` bracket GEMM issue (pingpong only).

    Blocks: ``j`` is the current key block; ``j-1`` the previous one (intra overlap).
    The emitter maps each step class to code; the simulator walks the same steps and checks the
    async hazards (accumulators touched while a wgmma group is in flight, stages released
    or read at the wrong time).
    """
    # persistent: Q is free for the next tile once the last block's S GEMM retired
    rel_q = (Release("Q", guard=Guard(1, "==", "end"), why="last S retired: the producer may load the next tile's Q"),) if cfg.persistent else ()
    turn = (Turn(why="pingpong: wait for this warpgroup's turn to issue"),) if cfg.pingpong else ()
    pas = (Pass(why="pingpong: hand the tensor cores to the next warpgroup"),) if cfg.pingpong else ()
    if cfg.intra_overlap:
        prologue = (
            WaitFull("K", J, why="K_j landed (TMA transaction bytes complete)"),
            *turn,
            Gemm("S", J, why="S = Q K_j^T"),
            *pas,
            WgmmaWait("0", why="S ready"),
            Release("K", J, why="K_j stage free for the producer"),
            *rel_q,
            Softmax("first", J, why="row max/sum of S_j, P = exp2(S - max)"),
            ConvertP(why="P -> 16-bit A fragments"),
        )
        body = (
            WaitFull("K", J),
            *turn,
            Gemm("S", J, why="S_j = Q K_j^T"),
            WaitFull("V", PREV),
            Gemm("O", PREV, why="O += P_{j-1} V_{j-1}, in flight during the softmax of S_j"),
            *pas,
            WgmmaWait("1", why="S_j ready (PV may still run)"),
            Release("K", J),
            *rel_q,
            Softmax("stats", J, why="new row max, exp2, row sums; O untouched (PV in flight)"),
            WgmmaWait("0", why="PV done: O and the P registers are free"),
            Release("V", PREV),
            RescaleO(why="O *= exp2(old max - new max)"),
            ConvertP(),
        )
        epilogue = (
            WaitFull("V", LAST),
            *turn,
            Gemm("O", LAST, why="O += P V of the last block"),
            *pas,
            WgmmaWait("0"),
            Release("V", LAST),
        )
        return prologue, body, epilogue
    body = (
        WaitFull("K", J),
        *turn,
        Gemm("S", J, why="S = Q K_j^T"),
        *pas,
        WgmmaWait("0"),
        Release("K", J),
        *rel_q,
        Softmax("stats", J),
        RescaleO(),
        ConvertP(),
        WaitFull("V", J),
        *turn,
        Gemm("O", J, why="O += P V_j"),
        *pas,
        WgmmaWait("0"),
        Release("V", J),
    )
    return (), body, ()


def _q_in_registers(cfg: KernelConfig, mods: "KernelMods | None") -> bool:
    """Whether S = Q K^T reads Q's A fragments from registers (``cfg.q_in_registers``): not with a score_mod, whose
    values need those registers (ptxas spilled 224 bytes for ALiBi and 360 for softcap at B_c 128 with them)."""
    return cfg.q_in_registers and (mods is None or mods.score is None)


@functools.lru_cache(maxsize=None)
def _scheduler(cfg: KernelConfig, score_mask: ScoreMask) -> TileScheduler:
    """The tile scheduler. The wave-tail split: persistent and unmasked, every partial last round; masked or one CTA
    per tile, only a launch of fewer tiles than SMs (masked rounds pair long and short tiles; a grid has no rounds
    to fill). A mask_mod's persistent kernel takes its tiles in the order its block mask holds."""
    tail = TailSplit(TAIL_MAX_PARTS, 2, cfg.consumers, cfg.d_head, full_rounds=cfg.persistent and cfg.mask == "none")
    return TileScheduler(cfg.B_r, cfg.persistent, cfg.mask != "none", tail,
                         ordered=orders_tiles(cfg.persistent, score_mask.mask_mod is not None))


def make_hopper_plan(cfg: KernelConfig, mods: "KernelMods | None" = None) -> HopperPlan:
    """The DSL objects of one wgmma config; ``mods``: the user's score_mod / mask_mod (:class:`flashgen.mods.KernelMods`)."""
    if cfg.engine != "wgmma":
        raise ValueError(f"{cfg.short_form()} is an engine={cfg.engine} config; make_hopper_plan builds wgmma plans")
    d, B_r, B_c, st, esz = cfg.d_head, cfg.B_r, cfg.B_c, cfg.stages, cfg.dtype.size
    q_bytes, kv_bytes = B_r * d * esz, B_c * d * esz
    q = SmemTile("sQ", B_r, d, kmajor_tile_layout(B_r, d, cfg.dtype, SWIZZLE), 0, 1, q_bytes)
    k = SmemTile("sK", B_c, d, kmajor_tile_layout(B_c, d, cfg.dtype, SWIZZLE), q_bytes, st, kv_bytes)
    v = SmemTile("sV", B_c, d, kmajor_tile_layout(B_c, d, cfg.dtype, SWIZZLE), q_bytes + st * kv_bytes, st, kv_bytes)
    # persistent: the output tile sits apart from Q (after the ring), so the next tile's Q can land
    # while this tile's output is still being stored; the producer waits on q_empty for that
    ring_end = q_bytes + 2 * st * kv_bytes
    o_offset = ring_end if cfg.persistent else 0
    bar0 = ring_end + (q_bytes if cfg.persistent else 0)
    names = [("q_full", 1, 1)] + [(n, st, c) for n, c in (("k_full", 1), ("v_full", 1), ("k_empty", 4 * cfg.consumers), ("v_empty", 4 * cfg.consumers))]
    names += [("q_empty", 1, 4 * cfg.consumers)] if cfg.persistent else []
    barriers, off = {}, bar0
    for name, stages, count in names:
        barriers[name] = (Mbarrier(name, count), off, stages)
        off += 8 * stages
    smem = off + SMEM_ALIGN  # slack to align the dynamic base
    if smem != cfg.smem_bytes:
        raise AssertionError(f"plan shared memory {smem} != config's {cfg.smem_bytes}")
    loads = {
        "Q": TmaTile(q, TmaLoad(B_r, BOX_COLS, cfg.dtype, SWIZZLE), "q"),
        "K": TmaTile(k, TmaLoad(B_c, BOX_COLS, cfg.dtype, SWIZZLE), "kv"),
        "V": TmaTile(v, TmaLoad(B_c, BOX_COLS, cfg.dtype, SWIZZLE), "kv"),
    }
    # descriptors relative to each tile's (stage) base; checked on a base of 0 (1024-aligned)
    qd = wgmma_kmajor_descriptors(0, B_r, d, cfg.dtype, SWIZZLE, rows_per_wgmma=WGMMA_M)
    kd = wgmma_kmajor_descriptors(0, B_c, d, cfg.dtype, SWIZZLE, rows_per_wgmma=B_c)[0]
    vd = wgmma_mnmajor_descriptors(0, B_c, d, cfg.dtype, SWIZZLE)
    a_q = OperandDesc("Q", "K", qd[0][0].leading_byte_offset, qd[0][0].stride_byte_offset, SWIZZLE,
                      tuple(x.start_address for x in qd[0]), row_block_offset=qd[1][0].start_address if len(qd) > 1 else 0)
    b_k = OperandDesc("K", "K", kd[0].leading_byte_offset, kd[0].stride_byte_offset, SWIZZLE, tuple(x.start_address for x in kd))
    b_v = OperandDesc("V", "MN", vd[0].leading_byte_offset, vd[0].stride_byte_offset, SWIZZLE, tuple(x.start_address for x in vd))
    atom_s, atom_o = WGMMA_64xNx16(cfg.dtype, B_c), WGMMA_64xNx16(cfg.dtype, d)
    if _q_in_registers(cfg, mods):  # Q read from shared memory once per tile instead of once per key block
        q_load = RegisterLoad("ldsm_Q", "Q", SM2RF(4), Partition(ldmatrix_x4_rows_then_cols("ldsm_Q"), (Loop("kk", d // 16, 0, 16),),
                                                             warp_row_step=16))
        gemm_s = WarpgroupGemm("S", atom_s, "regs", None, b_k, trans_b=False)
    else:
        q_load, gemm_s = None, WarpgroupGemm("S", atom_s, "smem", a_q, b_k, trans_b=False)
    gemm_o = WarpgroupGemm("O", atom_o, "regs", None, b_v, trans_b=True)
    # output staging: consumer w writes its O rows 64w.. in Q's layout, i.e. (non-persistent) exactly
    # the bytes of its own Q rows (only its S GEMMs read those, and they are done); the 128B swizzle
    # keeps the 4-byte accumulator stores conflict-free and is the layout a TMA box with that
    # swizzle reads, so one thread per consumer stores the rows (64-row boxes) while the
    # warpgroup goes on with the next tile
    o_stage = q.layout
    o = SmemTile("sO", B_r, d, o_stage, o_offset, 1, q_bytes)
    stores = {"O": TmaTile(o, TmaStore(WGMMA_M, BOX_COLS, cfg.dtype, SWIZZLE), "q")}
    prologue, body, epilogue = _schedule(cfg)
    score_mask = ScoreMask(cfg.mask, B_r, B_c, mods)
    return HopperPlan(
        cfg=cfg,
        tiles={"Q": q, "K": k, "V": v, "O": o},
        loads=loads,
        stores=stores,
        barriers=barriers,
        kv_ring=MbarrierRing("kv", st, stages_name="STAGES"), q_ring=MbarrierRing("q", 1, per_tile=True),
        gemm_S=gemm_s,
        gemm_O=gemm_o,
        q_load=q_load,
        p_from_s=_p_from_s(atom_s, atom_o, B_c // 16),
        o_stage=o_stage,
        scheduler=_scheduler(cfg, score_mask),
        score_mask=score_mask,
        row_reduce_lanes=_row_reduce_lanes(_warp_c_map(atom_s)),
        tile_start=(WaitFull("Q", J, why="this tile's Q landed"),),
        prologue=prologue,
        body=body,
        epilogue=epilogue,
        tile_output=(FinishRows(block=LAST), StoreO(block=LAST)),
        producer_regs=PRODUCER_REGS,
        consumer_regs=consumer_regs(cfg.consumers),
        smem_bytes=smem,
    )


def _warp_c_map(atom: WGMMA_64xNx16):
    """The accumulator map restricted to warp 0 (lanes 0..31), for the row-reduction lanes."""
    from .tiling import TVMap

    c = atom.c_map
    shape = ((4, 8), c.row.shape[1])
    return TVMap("C_warp", 32, c.n_values,
                 row=Layout(shape, ((c.row.stride[0][0], c.row.stride[0][1]), c.row.stride[1])),
                 col=Layout(shape, ((c.col.stride[0][0], c.col.stride[0][1]), c.col.stride[1])))
