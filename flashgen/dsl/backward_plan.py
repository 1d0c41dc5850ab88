"""BackwardPlan: a BackwardConfig turned into DSL objects (mma.sync engine) — the backward's single
source of truth, built from the forward's pieces (TiledCopy, OperandLoad, WarpGemm, the m16n8k16
atom's maps, the swizzled tile layout, the step classes) and the shared backward rules.

One CTA owns key/value block ``kb`` (``B_c`` rows of one kv head) and walks the query blocks that
meet it (:class:`~flashgen.attention.query_blocks.QueryBlocks`) of every query head of its group.
Warp ``w`` is warp ``h = w % d_split`` of group ``g = w // d_split``; the group owns key rows
``[g*kr, (g+1)*kr)``, ``kr = B_c / groups``, and query rows ``[g*qr, (g+1)*qr)`` of dQ, and warp
``h`` of them the ``dw`` columns from ``h*dw`` of dK, dV and dQ (every warp's partitions carry that
grid: ``warp_cols = d_split``); ``dw`` is d_head's share rounded up to a power of two
(:attr:`BackwardConfig.d_cols_per_warp`), so the shares may cover more than ``d_mma``, never more
than the ``d_smem`` columns of the shared tiles, which are zero-filled past d_head. ``dq_split`` gives dQ
a warp grid of its own: ``qs = dq_split`` warps across its columns (``qw`` each, rounded as ``dw``) and
``n_warps / qs`` down its rows (``qr = B_r * qs / n_warps`` each), warp ``w`` at ``(w // qs, w % qs)``;
the dQ GEMM's loads and adds carry that grid (the table's ``qr x dw`` is then ``qr x qw``). Per query block
(``B_r`` rows of Q, dO, lse and D copied to shared memory):

==========  ============================  =======================  ==================================
GEMM        warp tile (m x n, k)          A operand                B operand
==========  ============================  =======================  ==================================
``S``       S^T = K Q^T (kr x B_r, d)     sK, own rows (ldmatrix)  sQ (ldmatrix, as the forward's K)
``dP``      dP^T = V dO^T (kr x B_r, d)   sV, own rows             sdO (as the forward's K)
``dV``      dV += P^T dO (kr x dw, B_r)   P^T: the S^T accumulator sdO, own columns (ldmatrix.trans)
``dK``      dK += dS^T Q (kr x dw, B_r)   dS^T: the dP^T acc.      sQ, own columns (ldmatrix.trans)
``dQ``      dQ = dS K (qr x dw, B_c)      sdS^T read as dS, own    sK, own columns (ldmatrix.trans)
                                          rows (ldmatrix.trans)
==========  ============================  =======================  ==================================

S^T and dP^T (kr x B_r) are computed by every warp of the group (each needs all of them as the A
operand of its dV and dK columns). With ``split_scores`` warp ``h`` of a group computes only the ``nw =
B_r / d_split`` query columns from ``h * nw`` of them (its S and dP B operands: those rows of sQ and
sdO), stores its part of P^T to ``sP`` (B_c x B_r, 16 bit, laid out as ``sdS``) and of dS^T to ``sdS``,
and after a barrier dV and dK read their A operands, the group's key rows, from ``sP`` and ``sdS``
(ldmatrix, as the S GEMM reads K). dS^T goes registers -> shared (``sdS``, key rows, 16 bit; stored
by the first warp of each group, :attr:`BackwardPlan.ds_store_every`) so that the dQ GEMM, whose
warps own query rows, can read all of it; ``sdS_t`` is the same memory in (query, key) coordinates.
dQ is added into a ``(batch, heads, seq_q, d)`` fp32 buffer with ``red.global.add.f32`` at the C
fragment's coordinates, each element of a query block by one thread of the CTA
(:func:`dq_adds_once`); the key blocks' CTAs add in whatever order they come, or, ``deterministic``,
in ascending key blocks (:class:`WaitOrder` / :class:`SignalOrder` around the adds, the rank from
:meth:`QueryBlocks.key_rank`), so that the fp32 sums are the same run to run. dK (times the softmax scale) and dV go registers -> shared (over sK, sV)
-> global at the end, as the forward's O: each warp copies back the ``kr x dw`` block it staged (its
own rows and columns, so a ``__syncwarp`` orders them); the columns past d_head, of the stores and of
the dQ adds, are dropped.
"""
from __future__ import annotations

from typing import Any

import attrs

from ..attention.backward import Recompute, RowDot, ScoreGrad
from ..attention.backward_grid import BackwardGrid
from ..attention.item_walk import ItemWalk
from ..attention.query_blocks import QueryBlocks
from .atoms.copy import (
    CopyAtom,
    GM2SM_async,
    GM2SM_async_f32,
    GM2SM_f32,
    RF2GM_red,
    RF2SM,
    SM2GM,
    SM2RF,
    ldmatrix_x4_cols_then_rows,
    ldmatrix_x4_rows_then_cols,
    ldmatrix_x4_trans_a,
)
from .atoms.mma import MMA_16x8x16
from .backward_config import BackwardConfig
from .dq_fragments import DqFragments
from .layout import Layout
from ..attention.score_mask import ScoreMask
from .plan import OperandLoad, Schedule, TiledCopy, WarpGemm, _row_reduce_lanes, smem_tile_layout
from .steps import BEGIN, HAS_NEXT, J, NEXT, Barrier, Commit, Copy, Gemm, GradScores, Guard, RecomputeP, ReduceGM, SignalOrder, Step, StoreRF, Wait, WaitOrder
from .swizzle import ComposedLayout
from .tensor import Tensor
from .tiling import Loop, Partition, vector_copy_tv

#: The tiles of one query block, streamed; and the CTA's key/value block, resident.
STREAMED = ("Q", "dO")
RESIDENT = ("K", "V")
#: fp32 row statistics of a query block: the forward's log-sum-exp and the preprocess's D.
STATS = ("LSE", "D")


@attrs.frozen
class StatsCopy:
    """A query block's ``B_r`` fp32 values of ``name`` -> shared memory, value ``i`` by thread
    ``i % threads``, 4 bytes at a time (rows past seq_q become 0): a cp.async in the block's group
    (``atom.is_async``) or a load and a store. Four bytes: a head's row of values starts 16-byte
    aligned only when seq_q is a multiple of 4."""

    name: str
    atom: CopyAtom
    rows: int


@attrs.frozen
class BackwardPlan:
    cfg: BackwardConfig
    tensors: dict
    g2s: dict  # "Q"/"dO"/"K"/"V" -> TiledCopy
    stats: dict  # "LSE"/"D" -> StatsCopy
    gemms: dict  # "S"/"dP"/"dV"/"dK"/"dQ" -> WarpGemm
    r2s: dict  # "dS"/"dK"/"dV" -> TiledCopy (accumulator -> shared, 16 bit)
    s2g: dict  # "dK"/"dV" -> TiledCopy
    red_dQ: TiledCopy  # dQ accumulator -> fp32 global buffer
    dq_fragments: DqFragments  # the fp32 buffer's order: where red_dQ's values land
    schedule: Schedule
    row_reduce_lanes: tuple[int, ...]
    score_mask: ScoreMask
    query_blocks: QueryBlocks
    recompute: Recompute
    score_grad: ScoreGrad
    row_dot: RowDot  # the preprocess kernel's rule
    #: which block of the grid computes which key block, in what order the CTAs start (the config's ``longest_first``)
    grid: BackwardGrid
    valid_cols: int
    #: dS^T is stored by warps ``w % ds_store_every == 0``: the first of each group, whose other warps
    #: hold the same values; every warp with ``split_scores`` (each holds its own query columns)
    ds_store_every: int = 1
    #: the dQ GEMM and its adds in passes over slices of the warp's columns (:attr:`BackwardConfig.dq_passes`):
    #: the emitted GEMM adds each slice as soon as it is made, so only a slice's accumulators live; the sums
    #: (each element's k steps in order) and the shared-memory reads are those of one pass
    dq_passes: int = 1
    #: the order of the CTA's (query head, query block) items: from item 0 upwards (the kernel divides the item's
    #: index); the dQ adds' pointer steps through it (``item_step``)
    items: ItemWalk = ItemWalk(rotates=False)

    @property
    def mma(self) -> MMA_16x8x16:
        return self.gemms["S"].mma

    @property
    def closing_barrier(self) -> bool:
        """The query-block loop ends with a barrier after every warp's last shared-memory read (the dQ
        GEMM's of sK): only where the ordered dQ adds need one. Without it the epilogue passes a
        barrier before it stages dK and dV over sK and sV."""
        body = self.schedule.body
        last_gemm = max(i for i, s in enumerate(body) if isinstance(s, Gemm))
        return any(isinstance(s, Barrier) for s in body[last_gemm + 1:])

    def copies(self) -> list[tuple[str, TiledCopy]]:
        """(kind, copy) of every copy through shared memory, in the order of a query block and the epilogue."""
        out: list[tuple[str, TiledCopy]] = [("g2s", self.g2s[n]) for n in RESIDENT + STREAMED]
        out += [("s2r", load.copy) for g in self.gemms.values() for load in (g.a, g.b) if load is not None]
        out += [("r2s", self.r2s[n]) for n in ("P", "dS", "dK", "dV") if n in self.r2s]
        return out + [("s2g", self.s2g[n]) for n in ("dK", "dV")]

    @property
    def smem_layout(self) -> dict[str, int]:
        """Byte offset of each shared tensor (16-bit tiles; the fp32 statistics after them); a streamed
        tile's offset is its stage 0's, stage ``s`` at ``+ s *`` :attr:`stage_bytes`."""
        out, at = {}, 0
        for name in ("sK", "sV", "sQ", "sdO", "sdS") + (("sP",) if "sP" in self.tensors else ()):
            out[name] = at
            at += self.tensors[name].layout.cosize * 2 * (self.cfg.stages if name[1:] in STREAMED else 1)
        out["sdS_t"], out["sdK"], out["sdV"] = out["sdS"], out["sK"], out["sV"]
        for name in STATS:
            out[f"s{name}"] = at
            at += 4 * self.cfg.B_r * self.cfg.stages
        out["end"] = at
        return out

    @property
    def stage_bytes(self) -> dict[str, int]:
        """Bytes from one stage of each streamed tile (and row statistic) to the next."""
        out = {name: self.tensors[f"s{name}"].layout.cosize * 2 for name in STREAMED}
        return out | {name: 4 * self.cfg.B_r for name in STATS}


def transposed(layout: ComposedLayout) -> ComposedLayout:
    """The same memory in (col, row) coordinates: ``transposed(L)((c, r)) == L((r, c))``."""
    inner = layout.layout
    return ComposedLayout(layout.swizzle, Layout((inner.shape[1], inner.shape[0]), (inner.stride[1], inner.stride[0])))


def _tensors(cfg: BackwardConfig) -> dict[str, Tensor]:
    dt, D = cfg.dtype, cfg.d_smem
    rows = {"Q": cfg.B_r, "dO": cfg.B_r, "K": cfg.B_c, "V": cfg.B_c}
    t = {}
    for name, n in rows.items():
        t[f"g{name}"] = Tensor(f"g{name}", "GM", dt, Layout((n, D), (D, 1)))
        t[f"s{name}"] = Tensor(f"s{name}", "SM", dt, smem_tile_layout(n, D, cfg.swizzled))
    t["sdS"] = Tensor("sdS", "SM", dt, smem_tile_layout(cfg.B_c, cfg.B_r, cfg.swizzled))  # dS^T: (key, query)
    t["sdS_t"] = Tensor("sdS_t", "SM", dt, transposed(t["sdS"].layout))  # dS: (query, key)
    if cfg.split_scores:
        t["sP"] = Tensor("sP", "SM", dt, smem_tile_layout(cfg.B_c, cfg.B_r, cfg.swizzled))  # P^T: (key, query)
    # dK and dV are staged over K's and V's shared memory; each warp rewrites only its own key rows
    t["sdK"] = Tensor("sdK", "SM", dt, t["sK"].layout)
    t["sdV"] = Tensor("sdV", "SM", dt, t["sV"].layout)
    t["gdK"] = Tensor("gdK", "GM", dt, Layout((cfg.B_c, D), (D, 1)))
    t["gdV"] = Tensor("gdV", "GM", dt, Layout((cfg.B_c, D), (D, 1)))
    return t


def _a_load(name: str, tile: Tensor, m_tiles: int, k: int, warp_rows: int, split: int, dt) -> OperandLoad:
    """A operand from a tile stored (m, k) row-major: the warp group's own rows, all k (ldmatrix)."""
    regs = Tensor(f"r{name}", "RF", dt, Layout((m_tiles, k // 16, 4), (4, 4 * m_tiles, 1)))
    part = Partition(ldmatrix_x4_rows_then_cols("ldsm_A"), (Loop("mi", m_tiles, 16, 0), Loop("kk", k // 16, 0, 16)), warp_rows,
                     warp_cols=split)
    return OperandLoad(name, TiledCopy(f"s2r_{name}", SM2RF(4), tile, regs, part, "warp"), k // 8, 1, False)


def _a_load_trans(name: str, tile: Tensor, m_tiles: int, k: int, warp_rows: int, split: int, dt) -> OperandLoad:
    """A operand from a tile stored k-major (``tile`` in (m, k) coordinates): ldmatrix.trans."""
    regs = Tensor(f"r{name}", "RF", dt, Layout((m_tiles, k // 16, 4), (4, 4 * m_tiles, 1)))
    part = Partition(ldmatrix_x4_trans_a("ldsm_At"), (Loop("mi", m_tiles, 16, 0), Loop("kk", k // 16, 0, 16)), warp_rows,
                     warp_cols=split)
    return OperandLoad(name, TiledCopy(f"s2r_{name}", SM2RF(4, trans=True), tile, regs, part, "warp"), k // 8, 1, False)


def _b_load(name: str, tile: Tensor, n: int, k: int, dt, split: int = 1) -> OperandLoad:
    """B operand from a tile stored (n, k) row-major (ldmatrix; the forward's K): all of it, or with
    ``split`` > 1 warp ``w``'s ``n`` rows from ``(w % split) * n``."""
    regs = Tensor(f"r{name}", "RF", dt, Layout((n // 16, k // 16, 4), (4, 4 * n // 16, 1)))
    place = dict(warp_cols=split, place_row_step=n) if split > 1 else {}
    part = Partition(ldmatrix_x4_cols_then_rows("ldsm_B"), (Loop("nn", n // 16, 16, 0), Loop("kk", k // 16, 0, 16)), **place)
    return OperandLoad(name, TiledCopy(f"s2r_{name}", SM2RF(4), tile, regs, part, "warp"), k // 8, 1, False)


def _b_load_trans(name: str, tile: Tensor, n: int, k: int, split: int, dt) -> OperandLoad:
    """B operand from a tile stored (k, n) row-major (ldmatrix.trans; the forward's V): all k, the
    warp's ``n`` columns from ``(w % split) * n`` (all of them when ``split`` is 1)."""
    regs = Tensor(f"r{name}", "RF", dt, Layout((k // 16, n // 16, 4), (4, 4 * k // 16, 1)))
    part = Partition(ldmatrix_x4_rows_then_cols("ldsm_Bt"), (Loop("kk", k // 16, 16, 0), Loop("nn", n // 16, 0, 16)),
                     warp_col_step=n if split > 1 else 0, warp_cols=split)
    return OperandLoad(name, TiledCopy(f"s2r_{name}", SM2RF(4, trans=True), tile, regs, part, "warp"), k // 8, 1, False)


def _gemms(cfg: BackwardConfig, t: dict[str, Tensor], mma: MMA_16x8x16) -> dict[str, WarpGemm]:
    dt, DM, DW, BR, BC, sp = cfg.dtype, cfg.d_mma, cfg.d_cols_per_warp, cfg.B_r, cfg.B_c, cfg.d_split
    kr, qr, nw = cfg.key_rows_per_warp, cfg.query_rows_per_warp, cfg.score_cols_per_warp
    qs, QW = cfg.dq_warp_cols, cfg.dq_cols_per_warp  # dQ's warp grid: qs warps across its columns, QW each
    mk, mq = kr // 16, qr // 16
    ss = sp if cfg.split_scores else 1  # warps splitting the query columns of S^T and dP^T
    p_a, ds_a = ((_a_load("Pt", t["sP"], mk, BR, kr, sp, dt), _a_load("dSt", t["sdS"], mk, BR, kr, sp, dt))
                 if cfg.split_scores else (None, None))  # else the S^T / dP^T accumulators
    return {
        "S": WarpGemm("S", mma, mk, nw // 8, DM, _a_load("K", t["sK"], mk, DM, kr, sp, dt), _b_load("Q", t["sQ"], nw, DM, dt, ss)),
        "dP": WarpGemm("dP", mma, mk, nw // 8, DM, _a_load("V", t["sV"], mk, DM, kr, sp, dt), _b_load("dO", t["sdO"], nw, DM, dt, ss)),
        "dV": WarpGemm("dV", mma, mk, DW // 8, BR, p_a, _b_load_trans("dOt", t["sdO"], DW, BR, sp, dt)),
        "dK": WarpGemm("dK", mma, mk, DW // 8, BR, ds_a, _b_load_trans("Qt", t["sQ"], DW, BR, sp, dt)),
        "dQ": WarpGemm("dQ", mma, mq, QW // 8, BC, _a_load_trans("dS", t["sdS_t"], mq, BC, qr, qs, dt),
                       _b_load_trans("Kt", t["sK"], QW, BC, qs, dt)),
    }


def _acc_copy(name: str, atom, src_name: str, dst: Tensor, m_tiles: int, n_tiles: int, warp_rows: int, mma, dt,
              split: int = 1, warp_cols: int = 0) -> TiledCopy:
    """An accumulator's C fragments (16x8 tiles ``(mi, nt)`` of the warp group's rows, from column
    ``(w % split) * warp_cols``) moved by ``atom``."""
    src = Tensor(src_name, "RF", dt, Layout((m_tiles, n_tiles, 4), (4, 4 * m_tiles, 1)))
    part = Partition(mma.c_map, (Loop("mi", m_tiles, 16, 0), Loop("nt", n_tiles, 0, 8)), warp_rows, warp_cols, split)
    return TiledCopy(name, atom, src, dst, part, "warp")


#: the loop has a first block (a key block that meets no query block has none)
ANY_BLOCK = Guard(0, "<", "end")


def _schedule(stages: int, deterministic: bool = False, grad_with_p: bool = False, split_scores: bool = False) -> Schedule:
    """Prologue: K and V of the CTA's key block. Body, per query block ``j`` (of every query head of
    the kv head's group): Q, dO, lse, D in one cp.async group; the five GEMMs and the rules between.

    One stage: block j's copies, then ``wait_group 0``. Two: the prologue copies block 0, and block j
    first issues block j+1's copies into the other stage and waits for all but that newest group, so
    the loads run under block j's GEMMs. Groups complete in order, so the first wait also completes K
    and V.

    Two barriers per block. The one before the dQ GEMM (dS^T visible) comes after every read of Q_j,
    dO_j, lse_j and D_j (the dQ GEMM reads only dS and K): a warp past it may overwrite block j's stage
    with the next copies, and the next block's opening barrier keeps its dS^T store off the dS that
    slower warps still read. So the loop has no closing barrier; the epilogue passes one
    (:attr:`BackwardPlan.closing_barrier`) before dK and dV are staged over sK and sV, which the last
    dQ GEMM reads. ``deterministic``: the dQ adds wait for their turn (as late as possible, after the
    dQ GEMM) and a closing barrier, behind every warp's adds, precedes passing it on. ``grad_with_p`` (a
    score_mod whose derivative reads the score): dP^T first, so that dS^T is made in the same pass as
    P^T, from the score it needs. ``split_scores``: :func:`_split_schedule`.
    """
    if split_scores:
        return _split_schedule(stages, deterministic, grad_with_p)
    pro, head = _copy_head(stages, "1")
    body = head + (
        Barrier(why="... and are visible to all warps"),
        *_score_steps(grad_with_p, Gemm("dV", why="dV += P^T dO_j")),
        Gemm("dK", why="dK += dS^T Q_j"),
        StoreRF("dS", why="dS^T -> shared memory for the dQ GEMM"),
        Barrier(why="dS^T visible to all warps"),
        Gemm("dQ", why="dQ_j = dS K"),
    ) + _dq_adds(deterministic)
    return Schedule(pro, tuple(s for s in body if s is not None))


def _score_steps(grad_with_p: bool, after_p: Step, s_cols: str = "", dp_cols: str = "") -> tuple:
    """S^T, dP^T, P^T and dS^T, with ``after_p`` (dV's GEMM, or with ``split_scores`` P^T's store) once P^T is
    made: S^T, P^T, ``after_p``, dP^T, dS^T; ``grad_with_p`` (a score_mod whose derivative reads the score):
    dP^T before P^T, so that dS^T is made in the same pass. ``s_cols`` / ``dp_cols``: which columns, for comments."""
    s, dp = Gemm("S", why="S^T = K Q_j^T" + s_cols), Gemm("dP", why="dP^T = V dO_j^T" + dp_cols)
    if grad_with_p:
        return (s, dp, RecomputeP(why="P^T = exp2(score_mod(S^T * scale) log2e - lse_j log2e), masked"),
                GradScores(why="dS^T = P^T * (dP^T - D_j) score_mod', in the same pass"), after_p)
    return (s, RecomputeP(why="P^T = exp2(S^T * scale*log2e - lse_j*log2e), masked"), after_p, dp,
            GradScores(why="dS^T = P^T * (dP^T - D_j)"))


def _stream_copies(block, guard=None, which="j") -> tuple:
    """Copies of a query block's Q, dO, lse and D (``block``: which one, ``which``: its name in comments)."""
    return tuple(Copy(n, block, guard, why=f"{n.lower() if n in STATS else n}_{which}") for n in STREAMED + STATS)


def _copy_head(stages: int, wait_two: str) -> tuple[tuple, tuple]:
    """(prologue, the body's opening copies and wait). One stage: block j's copies and ``wait_group 0``.
    Two: the prologue copies block 0 too; the body issues block j+1's and waits with ``wait_two``
    groups left in flight ("1": block j+1's, issued just before; "0": issued after the wait by
    :func:`_split_schedule`)."""
    pro = (Copy("K", why="K block (resident)"), Copy("V", why="V block (resident)"))
    if stages == 1:
        return pro + (Commit(),), _stream_copies(J) + (Commit(), Wait("0", why="Q_j, dO_j, lse_j, D_j (and K, V) have landed"))
    pro += _stream_copies(BEGIN, ANY_BLOCK, "first") + (Commit(),)
    if wait_two == "0":
        return pro, (Wait("0", why="Q_j, dO_j, lse_j, D_j (and K, V): issued in the block before"),)
    return pro, _stream_copies(NEXT, HAS_NEXT, "j+1") + (Commit(why="(empty in the last block: the wait below counts it)"),
                                                         Wait("1", why="all but block j+1's group: Q_j, dO_j, lse_j, D_j (and K, V)"))


def _dq_adds(deterministic: bool) -> tuple:
    """The dQ adds, in turn where ``deterministic`` (None for the steps it leaves out)."""
    return (
        WaitOrder("dQ", why="the key blocks below this one that visit Q_j have added their dQ_j") if deterministic else None,
        ReduceGM("dQ", why="dQ_j added into the fp32 buffer"),
        Barrier(why="every warp's dQ_j added before the turn passes on") if deterministic else None,
        SignalOrder("dQ", why="the next key block's turn to add dQ_j") if deterministic else None,
    )


def _split_schedule(stages: int, deterministic: bool, grad_with_p: bool) -> Schedule:
    """``split_scores``: each warp makes its query columns of P^T and dS^T and stores them (``sP``,
    ``sdS``); after the barrier that makes them visible, dV and dK read them as A operands and read
    Q_j and dO_j as B operands, and dQ reads dS and K. So block j's stage is read up to dK, after the
    second barrier: two stages issue block j+1's copies after the opening barrier (which every warp
    passes only once done with block j-1, whose stage they overwrite), and wait for them (``wait_group
    0``) at the next block's start; one stage closes each block with a barrier before the next block's
    copies. The opening barrier also keeps this block's P^T and dS^T stores off the tiles that slower
    warps still read for block j-1's dV, dK and dQ."""
    pro, head = _copy_head(stages, "0")
    opening = (Barrier(why="... and are visible to all warps; every warp is done with block j-1"),)
    if stages > 1:
        opening += _stream_copies(NEXT, HAS_NEXT, "j+1") + (Commit(why="(empty in the last block: the next wait counts it)"),)
    scores = _score_steps(grad_with_p, StoreRF("P", why="this warp's columns of P^T -> shared memory for the dV GEMM"),
                          ", this warp's query columns", ", the same columns")
    closing = (Barrier(why="every warp's reads of Q_j and dO_j done before block j+1's copies overwrite them"),
               ) if stages == 1 and not deterministic else ()
    # the turn of the ordered adds is waited for before the dQ GEMM: its passes add as they go (dq_passes)
    turn = _dq_adds(deterministic)
    body = head + opening + scores + (
        StoreRF("dS", why="this warp's columns of dS^T -> shared memory for the dK and dQ GEMMs"),
        Barrier(why="P^T and dS^T visible to all warps"),
        Gemm("dV", why="dV += P^T dO_j"),
        Gemm("dK", why="dK += dS^T Q_j"),
        turn[0],
        Gemm("dQ", why="dQ_j = dS K"),
    ) + turn[1:] + closing
    return Schedule(pro, tuple(s for s in body if s is not None))


def dq_adds_once(red: TiledCopy, n_warps: int, rows: int, cols: int) -> None:
    """ValueError unless the dQ reduction of ``n_warps`` warps adds each element of the query block's
    ``rows x cols`` tile (B_r x the warps' d_cols) from exactly one (warp, lane, value, loop index) and nothing
    outside it: then the order of the adds into one element is the order of the CTAs alone."""
    import numpy as np

    warps = np.repeat(np.arange(n_warps), 32)
    r, c = red.partition.coords(np.tile(np.arange(32), n_warps), warps)
    r, c = r.ravel(), c.ravel()
    inside = (r >= 0) & (r < rows) & (c >= 0) & (c < cols)
    hits = np.zeros((rows, cols), np.int64)
    np.add.at(hits, (r[inside], c[inside]), 1)
    if not inside.all() or not (hits == 1).all():
        raise ValueError(f"{red.name}: the CTA's threads add elements of dQ's {rows} x {cols} tile {hits.min()} to {hits.max()} "
                         f"times ({int((~inside).sum())} adds outside it), not once each; an ordered reduction of dQ would "
                         "have to order the threads of a CTA too")


def make_backward_plan(cfg: BackwardConfig, mods: Any = None) -> BackwardPlan:
    """The DSL objects of one backward config (pure; equal configs give equal plans); ``mods``: the
    score_mod / mask_mod of the forward it differentiates (a :class:`flashgen.mods.KernelMods`)."""
    if cfg.engine != "mma_sync":
        raise ValueError(f"{cfg.short_form()}: make_backward_plan builds mma_sync plans, not engine={cfg.engine}")
    dt, D, T = cfg.dtype, cfg.d_smem, cfg.threads
    kr, qr = cfg.key_rows_per_warp, cfg.query_rows_per_warp
    mma = MMA_16x8x16(dt)
    t = _tensors(cfg)
    atom = GM2SM_async()
    g2s = {}
    for name in STREAMED + RESIDENT:
        rows = cfg.B_r if name in STREAMED else cfg.B_c
        g2s[name] = TiledCopy(f"g2s_{name}", atom, t[f"g{name}"], t[f"s{name}"], Partition(vector_copy_tv(f"g2s_{name}", rows, D, T)), "cta")
    # one stage waits for its copies right away: plain loads (no cp.async addresses to keep) do as well
    stats_atom = GM2SM_async_f32() if cfg.stages > 1 else GM2SM_f32()
    stats = {name: StatsCopy(f"g2s_{name}", stats_atom, cfg.B_r) for name in STATS}
    gemms = _gemms(cfg, t, mma)
    sp, dw = cfg.d_split, cfg.d_cols_per_warp
    mk, nq, nd = kr // 16, cfg.B_r // 8, dw // 8
    own = dw if sp > 1 else 0  # a warp's column offset per place in its group
    if cfg.split_scores:  # each warp its own query columns of P^T and dS^T
        nw = cfg.score_cols_per_warp
        r2s = {n: _acc_copy(f"r2s_{n}", RF2SM(), f"r{n}", t[f"s{n}"], mk, nw // 8, kr, mma, dt, sp, nw) for n in ("P", "dS")}
    else:
        r2s = {"dS": _acc_copy("r2s_dS", RF2SM(), "rdS", t["sdS"], mk, nq, kr, mma, dt, sp)}
    r2s |= {
        "dK": _acc_copy("r2s_dK", RF2SM(), "rdK", t["sdK"], mk, nd, kr, mma, dt, sp, own),
        "dV": _acc_copy("r2s_dV", RF2SM(), "rdV", t["sdV"], mk, nd, kr, mma, dt, sp, own),
    }
    # a split warp stores the dw columns it staged, no other warp's; an unsplit one its rows' D columns
    s2g_cols = dw if sp > 1 else D
    s2g = {name: TiledCopy(f"s2g_{name}", SM2GM(), t[f"sd{name[1:]}"], t[f"gd{name[1:]}"],
                           Partition(vector_copy_tv(f"s2g_{name}", kr, s2g_cols, 32), (), kr, own, sp), "warp")
           for name in ("dK", "dV")}
    gdq = Tensor("gdQaccum", "GM", dt, Layout((cfg.B_r, D), (D, 1)))
    qs, qw = cfg.dq_warp_cols, cfg.dq_cols_per_warp  # dQ's warp grid (the dK/dV one's unless dq_split)
    red = _acc_copy("red_dQ", RF2GM_red(), "rdQ", gdq, qr // 16, qw // 8, qr, mma, dt, qs, qw if qs > 1 else 0)
    mask = ScoreMask(cfg.mask, cfg.B_r, cfg.B_c, mods)
    if cfg.deterministic:
        dq_adds_once(red, cfg.n_warps, cfg.B_r, cfg.dq_cols)
    schedule = _schedule(cfg.stages, cfg.deterministic, mask.derivative_reads_score, cfg.split_scores)
    return BackwardPlan(cfg, t, g2s, stats, gemms, r2s, s2g, red, DqFragments(red, cfg.n_warps, cfg.B_r, cfg.dq_cols), schedule, _row_reduce_lanes(mma.c_map), mask,
                        QueryBlocks(mask), Recompute(), ScoreGrad(), RowDot(), BackwardGrid(longest_first=cfg.longest_first),
                        cfg.d_head, 1 if cfg.split_scores else sp, cfg.dq_passes)


