"""KernelPlan: a KernelConfig turned into DSL objects — the single source of truth.

``make_plan(cfg)`` is a pure function. The emitter renders every address, fragment
and pipeline step from the returned objects; the simulator evaluates the same
objects. Nothing downstream re-derives index math.

Coordinates: shared-memory tiles are ``(row, col)`` with ``col`` along d_head
(for Q, K, V and O). Global tiles are row-major with a runtime row stride ``ld``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
import numpy as np

from ..attention.pipeline import CpAsyncGroups
from ..attention.score_mask import ScoreMask
from .atoms.copy import (
    GM2SM,
    GM2SM_async,
    RF2SM,
    SM2GM,
    SM2RF,
    CopyAtom,
    ldmatrix_x4_cols_then_rows,
    ldmatrix_x4_rows_then_cols,
)
from .atoms.mma import MMA_16x8x16
from .config import FRAG_K, SWIZZLE_TILE_COLS, KernelConfig
from .layout import Layout
from .steps import BEGIN, FIRST_BLOCK, HAS_NEXT, J, LAST_BLOCK, NEXT, Barrier, Commit, Copy, Gemm, Guard, LoadRF, Softmax, Step, Wait
from .swizzle import ComposedLayout, Swizzle
from .tensor import Tensor
from .tiling import Loop, Partition, TVMap, vector_copy_tv

if TYPE_CHECKING:
    from ..mods.kernel_mods import KernelMods

#: The seed's shared-memory swizzle: XOR the 16-byte chunk index (bits 3..5 of the
#: element offset) with the row within an 8-row group (bits 6..8) of a 64-element row.
SEED_SWIZZLE = Swizzle(3, 3, 3)


def smem_tile_layout(rows: int, cols: int, swizzled: bool) -> ComposedLayout:
    """``rows x cols`` tile stored as ``cols/64`` column blocks of ``rows x 64`` row-major elements.

    Coordinate ``(row, col)``; ``col`` is split into (col % 64, col / 64). Each 64-wide
    block row is 128 bytes, so Sw<3,3,3> puts 8 rows x one 16-byte chunk in 8 bank groups.
    """
    blocks = cols // SWIZZLE_TILE_COLS
    layout = Layout((rows, (SWIZZLE_TILE_COLS, blocks)), (SWIZZLE_TILE_COLS, (1, rows * SWIZZLE_TILE_COLS)))
    return ComposedLayout(SEED_SWIZZLE if swizzled else Swizzle(0, 0, 0), layout)


@attrs.frozen
class TiledCopy:
    """A copy atom applied by a group of threads over a partition of one tile.

    ``src``/``dst`` are tensors; for GM the tensor's layout is a packed stand-in and
    the real address is ``row * ld + col`` with the runtime row stride ``ld``.
    """

    name: str
    atom: CopyAtom
    src: Tensor
    dst: Tensor
    partition: Partition
    scope: str  # "cta" (thread = threadIdx.x) or "warp" (thread = lane)

    @property
    def smem(self) -> Tensor:
        return self.dst if self.dst.space == "SM" else self.src


@attrs.frozen
class OperandLoad:
    """How one MMA operand goes shared -> registers (ldmatrix.x4 per 16x16 block).

    ``k_step_tiles`` 8-wide k tiles are loaded per step (the knob, 0 resolved to all);
    ``buffers`` = 2 under register double buffering; ``resident`` = loaded once per CTA.
    """

    operand: str
    copy: TiledCopy
    k_step_tiles: int
    buffers: int
    resident: bool

    @property
    def k_step(self) -> int:
        return self.k_step_tiles * FRAG_K

    # Register roles of one ldmatrix.x4 (destination register i <- matrix i). For the
    # A operand (Q) register i is A register i. For a B operand (K, V) the x4 covers
    # two n8 tiles: n tile ``2*nn + i / 2`` takes register i as its B register ``i % 2``.
    N_TILES_PER_X4 = 2
    B_REGS_PER_N_TILE = 2

    @staticmethod
    def b_operand_regs(nt: int) -> tuple[int, tuple[int, int]]:
        """(x4 index nn, (register for b0, register for b1)) feeding n8 tile ``nt``."""
        per = OperandLoad.N_TILES_PER_X4
        r = OperandLoad.B_REGS_PER_N_TILE
        return nt // per, (r * (nt % per), r * (nt % per) + 1)


@attrs.frozen
class WarpGemm:
    """One warp's share of a CTA GEMM: ``(m_tiles*16) x (n_tiles*8)`` += A (.. x k) * B (k x ..)."""

    name: str
    mma: MMA_16x8x16
    m_tiles: int
    n_tiles: int
    k: int
    a: "OperandLoad | None"  # None: A comes from the S accumulator (P, converted to 16 bit)
    b: OperandLoad



@attrs.frozen
class Schedule:
    """The CTA's steps (:mod:`flashgen.dsl.steps`): ``prologue`` once, ``body`` per key block ``j`` in
    ``[j_begin, n_blocks)`` (all key blocks, or those a mask keeps)."""

    prologue: tuple[Step, ...]
    body: tuple[Step, ...]


@attrs.frozen
class KernelPlan:
    cfg: KernelConfig
    tensors: dict
    g2s: dict  # "Q"/"K"/"V" -> TiledCopy
    s2r: dict  # "Q"/"K"/"V" -> OperandLoad
    r2s_O: TiledCopy
    s2g_O: TiledCopy
    gemm_S: WarpGemm
    gemm_O: WarpGemm
    schedule: Schedule
    row_reduce_lanes: tuple[int, ...]  # xor masks joining the lanes that share a C-fragment row
    score_mask: "ScoreMask"
    #: columns that hold data; shared-memory columns in [valid_cols, d_smem) are zero-filled
    #: by the g2s copies and never stored by s2g. Rows are bounded at run time (tails).
    valid_cols: int

    @property
    def mma(self) -> MMA_16x8x16:
        return self.gemm_S.mma


def _row_reduce_lanes(c_map: TVMap) -> tuple[int, ...]:
    """Lane xor masks whose partners hold the same accumulator rows (derived from the C map)."""
    rows, _ = c_map.tables()  # [lane, value]
    lanes = np.arange(32)
    return tuple(1 << bit for bit in range(5) if np.array_equal(rows[lanes], rows[lanes ^ (1 << bit)]))


def make_schedule(cfg: KernelConfig, groups: CpAsyncGroups = CpAsyncGroups()) -> Schedule:
    """Which copy is issued when and which wait/barrier guards each use.

    Each wait names the copies the steps after it read; ``groups`` (the cp.async group rule) derives
    its ``wait_group`` count from the commits before it. A barrier then makes the data visible CTA-wide.
    """
    resident_q = LoadRF("Q", guard=FIRST_BLOCK, why="Q fragments stay in registers for the whole CTA") if cfg.Q_mma_load_K_tiles == 0 else None
    if not cfg.async_copy:
        pro = (Copy("Q", why="Q block: synchronous 16-byte copies"),)
        body = (
            Copy("K", J, why="K_j -> shared"),
            Barrier(why="K_j visible to all warps"),
            resident_q,
            Gemm("S", why="S = Q K_j^T"),
            Copy("V", J, why="V_j -> shared"),
            Barrier(why="V_j visible"),
            Softmax(why="online softmax on S, rescale O"),
            Gemm("O", why="O += P V_j"),
            # no barrier here: the next block's first barrier (after its K copy, before its V copy) covers V_j
        )
        return Schedule(*groups.resolve(pro, tuple(s for s in body if s)))
    if not cfg.eager_load_blocks:
        pro = (Copy("Q", why="Q block"), Commit())
        body = (
            Copy("K", J, why="K_j"),
            Commit(),
            Wait(needs=(("Q", None), ("K", J)), why="Q and K_j have landed"),
            Barrier(why="... and are visible to all warps"),
            resident_q,
            Copy("V", J, why="V_j overlaps S = Q K_j^T and the softmax"),
            Commit(),
            Gemm("S", why="S = Q K_j^T"),
            Softmax(why="online softmax on S, rescale O"),
            Wait(needs=(("V", J),), why="V_j has landed"),
            Barrier(why="V_j visible; all warps done reading K_j"),
            Gemm("O", why="O += P V_j"),
            # no barrier here: V_{j+1} is copied only after the next block's first barrier
        )
        return Schedule(*groups.resolve(pro, tuple(s for s in body if s)))
    pro = (
        Copy("Q", why="Q block"),
        Copy("K", BEGIN, guard=Guard(0, "<", "end"), why="first K block together with Q"),
        Commit(),
    )
    body = (
        Copy("V", J, why="V_j overlaps S = Q K_j^T and the softmax"),
        Commit(),
        Wait(needs=(("Q", None), ("K", J)), why="all but the newest group (V_j) have landed: Q, K_j"),
        Barrier(why="K_j visible to all warps"),
        resident_q,
        Gemm("S", why="S = Q K_j^T"),
        Barrier(why="all warps done reading K_j"),
        Copy("K", NEXT, guard=HAS_NEXT, why="prefetch K_{j+1} during softmax and P V_j"),
        Commit(guard=HAS_NEXT),
        Softmax(why="online softmax on S, rescale O"),
        Wait(guard=HAS_NEXT, needs=(("V", J),), why="V_j has landed (K_{j+1} may be in flight)"),
        Wait(guard=LAST_BLOCK, needs=(("V", J),), why="V_j has landed"),
        Barrier(why="V_j visible to all warps"),
        Gemm("O", why="O += P V_j"),
        Barrier(why="all warps done with V_j before V_{j+1} overwrites it"),
    )
    return Schedule(*groups.resolve(pro, tuple(s for s in body if s)))


def make_plan(cfg: KernelConfig, mods: "KernelMods | None" = None) -> KernelPlan:
    """The DSL objects of one kernel config (pure; equal configs give equal plans); ``mods``: the user's
    score_mod / mask_mod the kernel applies (:class:`flashgen.mods.KernelMods`)."""
    if cfg.engine != "mma_sync":
        raise ValueError(f"{cfg.short_form()} is an engine={cfg.engine} config; make_plan builds mma_sync plans "
                         "(flashgen.engines.make_plan builds any config's)")
    dt, BR, BC, T = cfg.dtype, cfg.B_r, cfg.B_c, cfg.threads
    D = cfg.d_smem  # shared-memory tile width (whole 64-column swizzle blocks)
    DM = cfg.d_mma  # columns the MMAs cover (d_head rounded up to 16)
    rpw = cfg.rows_per_warp
    mma = MMA_16x8x16(dt)

    tensors = {
        "gQ": Tensor("gQ", "GM", dt, Layout((BR, D), (D, 1))),
        "gK": Tensor("gK", "GM", dt, Layout((BC, D), (D, 1))),
        "gV": Tensor("gV", "GM", dt, Layout((BC, D), (D, 1))),
        "gO": Tensor("gO", "GM", dt, Layout((BR, D), (D, 1))),
        "sQ": Tensor("sQ", "SM", dt, smem_tile_layout(BR, D, cfg.swizzled)),
        "sK": Tensor("sK", "SM", dt, smem_tile_layout(BC, D, cfg.swizzled)),
        "sV": Tensor("sV", "SM", dt, smem_tile_layout(BC, D, cfg.swizzled)),
    }
    # O is staged through Q's shared memory: each warp rewrites only its own Q rows.
    tensors["sO"] = Tensor("sO", "SM", dt, tensors["sQ"].layout)

    g2s_atom = GM2SM_async() if cfg.async_copy else GM2SM()
    g2s = {}
    for op, rows in (("Q", BR), ("K", BC), ("V", BC)):
        part = Partition(vector_copy_tv(f"g2s_{op}", rows, D, T))
        g2s[op] = TiledCopy(f"g2s_{op}", g2s_atom, tensors[f"g{op}"], tensors[f"s{op}"], part, "cta")

    s2r = {
        "Q": OperandLoad(
            "Q",
            TiledCopy(
                "s2r_Q", SM2RF(4), tensors["sQ"], Tensor("rQ", "RF", dt, Layout((cfg.m_tiles_per_warp, DM // 16, 4), (4, 4 * cfg.m_tiles_per_warp, 1))),
                Partition(ldmatrix_x4_rows_then_cols("ldsm_A"), (Loop("mi", cfg.m_tiles_per_warp, 16, 0), Loop("kk", DM // 16, 0, 16)), rpw),
                "warp",
            ),
            cfg.load_k_tiles("Q"), cfg.rf_buffers("Q"), cfg.Q_mma_load_K_tiles == 0,
        ),
        "K": OperandLoad(
            "K",
            TiledCopy(
                "s2r_K", SM2RF(4), tensors["sK"], Tensor("rK", "RF", dt, Layout((BC // 16, DM // 16, 4), (4, 4 * BC // 16, 1))),
                Partition(ldmatrix_x4_cols_then_rows("ldsm_B"), (Loop("nn", BC // 16, 16, 0), Loop("kk", DM // 16, 0, 16))),
                "warp",
            ),
            cfg.load_k_tiles("K"), cfg.rf_buffers("K"), False,
        ),
        "V": OperandLoad(
            "V",
            TiledCopy(
                "s2r_V", SM2RF(4, trans=True), tensors["sV"], Tensor("rV", "RF", dt, Layout((BC // 16, DM // 16, 4), (4, 4 * BC // 16, 1))),
                Partition(ldmatrix_x4_rows_then_cols("ldsm_Bt"), (Loop("kk", BC // 16, 16, 0), Loop("nn", DM // 16, 0, 16))),
                "warp",
            ),
            cfg.load_k_tiles("V"), cfg.rf_buffers("V"), False,
        ),
    }
    c_map = mma.c_map
    r2s = TiledCopy(
        "r2s_O", RF2SM(), Tensor("rO", "RF", dt, Layout((cfg.m_tiles_per_warp, DM // 8, 4), (4, 4 * cfg.m_tiles_per_warp, 1))), tensors["sO"],
        Partition(c_map, (Loop("mi", cfg.m_tiles_per_warp, 16, 0), Loop("nt", DM // 8, 0, 8)), rpw),
        "warp",
    )
    s2g = TiledCopy(
        "s2g_O", SM2GM(), tensors["sO"], tensors["gO"],
        Partition(vector_copy_tv("s2g_O", rpw, D, 32), (), rpw),
        "warp",
    )
    gemm_S = WarpGemm("S", mma, cfg.m_tiles_per_warp, BC // 8, DM, s2r["Q"], s2r["K"])
    gemm_O = WarpGemm("O", mma, cfg.m_tiles_per_warp, DM // 8, BC, None, s2r["V"])
    return KernelPlan(
        cfg, tensors, g2s, s2r, r2s, s2g, gemm_S, gemm_O, make_schedule(cfg), _row_reduce_lanes(c_map),
        ScoreMask(cfg.mask, BR, BC, mods), cfg.d_head,
    )
