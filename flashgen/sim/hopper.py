"""One CTA of the Hopper (wgmma engine) plan on the CPU: TMA fills, wgmma, online softmax, hazards.

Driven only by :func:`flashgen.dsl.hopper_plan.make_hopper_plan`'s objects: tile offsets and
stage sizes, the descriptors' per-step offsets (read back through the ISA address models
``descriptor_addresses`` / ``descriptor_addresses_mn``), the accumulator and A-register maps,
``p_from_s``, ``o_stage``, the barrier arrive counts, ``row_reduce_lanes``, ``score_mask`` and
the consumer steps. Nothing here re-derives the plan's index math: where the plan is wrong the
numbers or the hazard list say so.

What is modelled
----------------
* **TMA** (:func:`tma_fill` for loads, :func:`tma_read` for the output's stores): written from
  the 128B-swizzle byte rule, not from the tile layouts, so tests can compare the two. Rows
  past the sequence end are zero-filled on loads and not written on stores.
* **Producer**: a sequential program (per tile Q, then for each key block ``K_j`` and ``V_j``),
  each load waiting for its ring stage (Q: the previous tile's Q) to be released by every
  consumer warp (the plan's ``*_empty`` arrive counts). It runs as far ahead as the ring
  allows after every consumer step, so a stage released too early really is overwritten.
* **mbarriers** by phase: a fill completes a phase of its slot's full barrier, the count's
  last release one of its empty barrier; producer and consumers wait for the slot and parity
  the plan's rings give (``kv_ring``, ``q_ring``: :mod:`flashgen.attention.pipeline`), so a
  wrong stage or phase rule deadlocks or passes a wait on a slot holding other data.
* **Consumers**: each walks, per tile, the plan's ``tile_start`` (the Q wait), prologue / body per
  block / epilogue, then its ``tile_output`` (``finish_rows``, ``store_O``: walked as steps so
  their placement is checked too); round-robin one step at a
  time, a step that must wait (``wait_full`` before the data landed, ``turn`` before the
  previous warpgroup's ``pass``) blocks. Pingpong follows the emitted rule: a ring, each
  consumer passing to the next; the last gives consumer 0 one initial pass, and consumer 0
  takes the one pass left over before exit.
  Steps with a ``guard`` (``release Q`` in the last block of a persistent plan) run where it holds.
* **Tiles** come from the plan's scheduler (:func:`simulate_tiles`: one CTA of a launch of one
  head; a persistent CTA walks several tiles in the scheduler's rounds): the ring stages
  run on across tiles as the emitted counters do, the next tile's Q lands only after every
  consumer warp released the previous one, and an S GEMM executing on another tile's Q is
  reported. Output rows are written by each tile's ``store_O`` step.
* **Wave-tail split** (:func:`simulate_split_tile`): a tile's key ranges
  (``plan.tail_split.ranges``) walked as separate CTAs, each consumer's finished row max, row
  sums and O accumulators published, then merged per thread as the emitted counting-last warp
  does (common max, rescale, fp32 sums in part order) and written from the accumulator map.
* **wgmma groups**: each ``gemm`` step is one committed group; ``wgmma_wait N`` retires all
  but the ``N`` newest. A group *executes when it retires*, reading shared memory and
  registers then (the latest moment the hardware may read them), so a missing wait or an
  early release also gives wrong numbers, not only a hazard line.
* **Numerics** (fp32 like the kernel): each k16 wgmma is ``fp32(C + A B^T)`` with the
  16-term products summed in float64; the online softmax and the epilogue's math are the plan's
  :class:`~flashgen.attention.softmax.OnlineSoftmax` and :class:`~flashgen.attention.epilogue.Epilogue`
  evaluated (the rules the emitter renders); P and O rounded to the 16-bit dtype (``cvt.rn``).

Hazards (strings in ``report.hazards``; empty = clean)
------------------------------------------------------
* a step touching S/O/P registers an in-flight group writes (or writing registers it reads);
* ``release`` of a K/V block an in-flight group still reads; double or missing releases;
* a gemm reading a stage without its ``wait_full``, or a stage holding another block;
* dataflow: softmax without this block's S, gemm O without this block's P, O accumulated or
  rescaled at the wrong max, each block's S / softmax / PV not exactly once;
* pingpong named barriers: over-arrival, unbalanced turns and passes at exit, deadlock;
* output staging over another warpgroup's Q/O rows, the K/V ring or the mbarriers; wgmma groups
  in flight at exit; ``finish_rows`` / ``store_O`` out of place (statistics or O not of the
  finished tile's last block, O stored before all its PV GEMMs, a tile finished twice or never).
"""
from __future__ import annotations

import functools
from typing import Callable

import attrs
import numpy as np

from flashgen.attention.epilogue import epilogue
from flashgen.attention.softmax import online_softmax, scale_row
from flashgen.dsl.config import LOG2E, WARPGROUP as WG, WARPS_PER_WG
from flashgen.dsl.atoms.hopper import WGMMA_64xNx16, descriptor_addresses, descriptor_addresses_mn
from flashgen.dsl.hopper_plan import HopperPlan, SmemTile, TmaTile, make_hopper_plan
from flashgen.dsl.steps import (J, Block, ConvertP, FinishRows, Gemm, Pass, Release, RescaleO, Softmax, Step, StoreO, Turn, WaitFull,
                                WgmmaWait, runs)
from flashgen.sim import block_mask as bm
from flashgen.sim import hardware as hw
from flashgen.sim.cta import check_mods
from flashgen.sim.layout_eval import offsets, tile_table

SWIZZLE_SPAN = 128  # bytes of one 128B-swizzle row: 64 16-bit columns per TMA box

# ---------------------------------------------------------------------- TMA


def tma_byte_addresses(rows: int, cols: int, base_byte: int = 0, elem_bytes: int = 2) -> np.ndarray:
    """Absolute byte address TMA (128B swizzle) writes element ``(r, c)`` of a ``rows x cols`` tile to.

    Column block ``j = c // 64`` is one box of ``rows x 128`` bytes at ``base + j*rows*128``;
    inside it element ``(r, c)`` is at byte ``r*128 + 2*(c % 64)``; then the absolute address
    has its 16-byte granule XORed with its 128-byte line: ``a ^ (((a >> 7) & 7) << 4)``.
    """
    per_box = SWIZZLE_SPAN // elem_bytes
    r = np.arange(rows, dtype=np.int64)[:, None]
    c = np.arange(cols, dtype=np.int64)[None, :]
    addr = base_byte + (c // per_box) * rows * SWIZZLE_SPAN + r * SWIZZLE_SPAN + (c % per_box) * elem_bytes
    return addr ^ (((addr >> 7) & 7) << 4)


def _check_tma(smem: np.ndarray, tt: "TmaTile | None", who: str) -> None:
    """The image is a flat uint8 array; the boxes are the 128-byte-wide ones the byte rule models."""
    if tt is not None and tt.tma.box_cols * tt.tma.dtype.size != SWIZZLE_SPAN:
        raise ValueError(f"{who} models 128-byte-wide boxes; {tt.tile.name} has {tt.tma.box_cols}-column boxes")
    if smem.dtype != np.uint8 or smem.ndim != 1 or not smem.flags.c_contiguous or smem.size % 2:
        raise ValueError("smem must be a contiguous 1-D uint8 array of even length")


def tma_fill(smem: np.ndarray, tile: "TmaTile | SmemTile", base_byte: int, data: np.ndarray,
             rows: tuple[int, int] | None = None) -> None:
    """Place ``data`` (``[<= rows, <= cols]`` 16-bit patterns) into the uint8 image like a TMA load.

    Missing rows/columns (past the tensor's end) are zero-filled, as TMA's out-of-bounds fill.
    ``rows = (lo, hi)`` writes only those tile rows (the boxes of one consumer's part).
    """
    if isinstance(tile, TmaTile):
        _check_tma(smem, tile, "tma_fill")
        tile = tile.tile
    else:
        _check_tma(smem, None, "tma_fill")
    if base_byte % 1024:
        raise ValueError(f"tma_fill: base {base_byte:#x} is not 1024-byte aligned (the 128B swizzle pattern)")
    data = np.asarray(data)
    if data.dtype == np.float16:
        data = data.view(np.uint16)
    if data.dtype != np.uint16 or data.ndim != 2 or data.shape[0] > tile.rows or data.shape[1] > tile.cols:
        raise ValueError(f"tma_fill: expected uint16 [<= {tile.rows}, <= {tile.cols}], got {data.dtype} {data.shape}")
    full = np.zeros((tile.rows, tile.cols), np.uint16)
    full[: data.shape[0], : data.shape[1]] = data
    addr = tma_byte_addresses(tile.rows, tile.cols, base_byte)
    if addr.max() + 2 > smem.size:
        raise ValueError(f"tma_fill: {tile.name} at {base_byte} does not fit the {smem.size}-byte image")
    lo, hi = rows if rows is not None else (0, tile.rows)
    smem.view("<u2")[addr[lo:hi] // 2] = full[lo:hi]


def tma_read(smem: np.ndarray, tt: TmaTile, base_byte: int, rows: tuple[int, int] | None = None) -> np.ndarray:
    """What the TMA stores of ``tt``'s boxes read from the uint8 image: uint16 ``[tile rows, cols]``.

    Each box (``tt.boxes``: its tile origin and byte offset) is read with the 128B-swizzle byte
    rule at ``base_byte + box.smem_offset``; ``rows = (lo, hi)`` reads only the boxes starting
    in those tile rows (one consumer's stores), the other rows stay 0.
    """
    _check_tma(smem, tt, "tma_read")
    lo, hi = rows if rows is not None else (0, tt.tile.rows)
    out = np.zeros((tt.tile.rows, tt.tile.cols), np.uint16)
    img = smem.view("<u2")
    for b in tt.boxes:
        if not lo <= b.row0 < hi:
            continue
        addr = tma_byte_addresses(tt.tma.box_rows, tt.tma.box_cols, base_byte + b.smem_offset)
        if addr.max() + 2 > smem.size:
            raise ValueError(f"tma_read: a {tt.tile.name} box at {base_byte + b.smem_offset} does not fit the {smem.size}-byte image")
        out[b.row0: b.row0 + tt.tma.box_rows, b.col0: b.col0 + tt.tma.box_cols] = img[addr // 2]
    return out


def read16(smem: np.ndarray, addr: np.ndarray, dtype) -> np.ndarray:
    """float64 values of the 16-bit elements at byte addresses ``addr`` (NaN outside the image)."""
    idx = np.asarray(addr) // 2
    img = smem.view("<u2")
    inside = (idx >= 0) & (idx < img.size)
    out = hw.decode(img[np.where(inside, idx, 0)], dtype).astype(np.float64)
    return np.where(inside, out, np.nan)


# ---------------------------------------------------------------------- maps


@attrs.frozen
class _TV:
    """A TVMap evaluated: ``rows[t, v]``, ``cols[t, v]``."""

    rows: np.ndarray
    cols: np.ndarray


def _eval_tv(tv) -> _TV:
    rows, cols = tv.tables()
    return _TV(rows.copy(), cols.copy())


@functools.lru_cache(maxsize=None)
def c_table(atom: WGMMA_64xNx16) -> _TV:
    return _eval_tv(atom.c_map)


@functools.lru_cache(maxsize=None)
def a_table(atom: WGMMA_64xNx16) -> _TV:
    return _eval_tv(atom.a_map)


def phase_passed(phases: dict, barrier: tuple, parity: int) -> bool:
    """``mbarrier.try_wait.parity`` on ``barrier`` (``phases``: barrier -> phases completed): the phase of
    this parity completed, i.e. the phase in progress has the other one (a fresh barrier is in phase 0:
    parity 1 passes at once)."""
    return (phases.get(barrier, 0) & 1) != parity


def wgmma_k16(acc: np.ndarray, a: np.ndarray, b: np.ndarray, c: _TV) -> np.ndarray:
    """One k16 wgmma: ``acc [thread, value]`` (fp32 values held in float64) plus ``A B^T`` (``a [64, 16]``,
    ``b [N, 16]`` float64, the 16-term products summed in float64) at the accumulator map ``c``'s
    (row, col) of each value, rounded to fp32."""
    d = a @ b.T
    return (acc + d[c.rows, c.cols]).astype(np.float32).astype(np.float64)


@functools.lru_cache(maxsize=None)
def _register_load_map(load, a_atom: WGMMA_64xNx16) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """What ``load`` (ldmatrix.x4 per warp and k16 step) puts where the wgmma reads A.

    For step ``kk``, thread ``t`` = 32 warp + lane and A value ``v`` = 2 register + half: the tile
    (row, col) the value comes from (row relative to the consumer's first) and the (row, col) of the
    64x16 A tile the atom's ``a_map`` assigns that value. ldmatrix: matrix m's rows are addressed by
    lanes 8m..8m+7; lane l's register m holds row l/4 of matrix m, columns 2 (l % 4) + {0, 1}.
    """
    part, (kk,) = load.partition, load.partition.loops
    a = a_table(a_atom)
    src_r = np.zeros((kk.extent, WG, 8), np.int64)
    src_c = np.zeros_like(src_r)
    for k in range(kk.extent):
        for warp in range(WARPS_PER_WG):
            addr = [part.coord(lane, 0, warp=warp, **{kk.name: k}) for lane in range(32)]
            for lane in range(32):
                for m in range(4):
                    r, c0 = addr[8 * m + lane // 4]
                    for half in range(2):
                        src_r[k, 32 * warp + lane, 2 * m + half] = r
                        src_c[k, 32 * warp + lane, 2 * m + half] = c0 + 2 * (lane % 4) + half
    return src_r, src_c, a.rows, a.cols


def _row_slots(c: _TV) -> tuple[np.ndarray, np.ndarray]:
    """Per thread its distinct accumulator rows ``[128, 2]`` and each value's slot ``[128, n]``.

    The softmax keeps one max/sum per row a thread holds; an m64 accumulator gives each
    thread exactly two rows.
    """
    lo = c.rows.min(axis=1)
    hi = c.rows.max(axis=1)
    if not np.all((c.rows == lo[:, None]) | (c.rows == hi[:, None])) or np.any(lo == hi):
        raise ValueError("an accumulator map must give every thread exactly two rows")
    return np.stack([lo, hi], axis=1), (c.rows == hi[:, None]).astype(np.int64)


def walk_consumers(consumers, step, produce, flag, greedy: bool) -> None:
    """Step ``consumers`` (each with ``done``, ``w``, ``pc`` and ``steps``) in turn until all are done, the
    producer (``produce``) after every step that ran; ``step(c)`` False: ``c`` has to wait. ``greedy``: each
    goes as far as it can in its turn, else one step. A round in which none moves is a deadlock (``flag``)."""
    produce()
    while not all(c.done for c in consumers):
        progressed = False
        for c in consumers:
            while not c.done and step(c):
                progressed = True
                produce()
                if not greedy:
                    break
        if not progressed:
            blocked = "; ".join(f"consumer {c.w} at {c.steps[c.pc][0]}" for c in consumers if not c.done)
            flag("deadlock", f"no warpgroup can proceed ({blocked})")
            return


# ---------------------------------------------------------------------- report


@attrs.define
class HopperReport:
    """``hazards``: problems found (empty = clean); ``j_begin``/``j_end``: the key blocks
    visited; ``groups``: wgmma groups committed; ``pingpong``: per consumer counts of
    ``turn`` and ``pass`` issued, and ``absorbed``: the leftover pass consumer 0 takes before exit."""

    hazards: list[str]
    j_begin: int
    j_end: int
    groups: int = 0
    pingpong: dict = attrs.Factory(dict)
    #: (query block, part) of each tile walked, in order (part -1: the whole tile)
    tiles: list = attrs.Factory(list)
    #: per consumer, the (tile, key block) of each S GEMM it executed, in order: the blocks walked
    visited: dict = attrs.Factory(dict)

    @property
    def ok(self) -> bool:
        return not self.hazards


@attrs.define
class _Group:
    """One committed wgmma group: what it writes/reads and how to execute it at retirement."""

    what: str  # "S[j]" / "O[j]"
    writes: frozenset
    reads: frozenset
    smem: tuple  # (tensor, block, stage)
    run: Callable[[], None]


# ---------------------------------------------------------------------- the CTA


class _Consumer:
    """One consumer warpgroup: its flattened steps, registers and in-flight groups."""

    def __init__(self, w: int, steps: list, n_s: int, n_o: int, k_steps: int):
        self.w = w
        self.steps = steps  # [(where, Step, block)]
        self.pc = 0
        self.groups: list[_Group] = []
        self.s_acc = np.zeros((WG, n_s), np.float32)
        self.o_acc = np.zeros((WG, n_o), np.float32)
        self.p_frag = np.zeros((WG, k_steps, 4, 2), np.uint16)
        self.q_frag: tuple | None = None  # (tile, [k16 step, thread, A value] float64) when S reads A from registers
        self.row_max = np.full((WG, 2), -np.inf, np.float32)
        self.row_sum = np.zeros((WG, 2), np.float32)
        self.corr = np.ones((WG, 2), np.float32)
        self.full_seen: set = set()
        self.released: set = set()
        # dataflow: S holds ("raw"|"P", block); P holds block; O scaled to a block's max
        self.s_state: tuple | None = None
        self.p_block: int | None = None
        self.o_scale: int | None = None
        self.max_block: int | None = None
        self.corr_from: int | None = None
        self.turns = self.passes = self.absorbed = 0
        self.fin: tuple | None = None  # (tile, 1/l) between finish_rows and store_O
        self.partial: dict = {}  # tile -> (row_max, row_sum, o_acc) as finished, before the output steps

    @property
    def done(self) -> bool:
        return self.pc >= len(self.steps)


@attrs.frozen
class _Tile:
    """One output tile of the CTA's walk: query rows from ``q_row0``, key blocks ``[jb, je)`` of which it
    visits ``walk`` (:func:`flashgen.sim.block_mask.walk`: all of them without a block mask)."""

    q_row0: int
    jb: int
    je: int
    walk: tuple = ()

    @classmethod
    def of(cls, q_row0: int, row: "np.ndarray | None", jb: int, je: int) -> "_Tile":
        """The tile as ``tile_at`` (and, for a part of a split tile, ``cta_work``) leaves it: ``[jb, je)``
        clipped to the block mask's ``row``, the empty blocks between skipped."""
        jb, je = bm.clip(row, jb, je)
        return cls(q_row0, jb, je, tuple(bm.walk(row, jb, je)))

    @property
    def n(self) -> int:
        """The key blocks walked: the K/V ring's uses of the tile."""
        return len(self.walk)


@attrs.frozen
class _Mods:
    """What a plan's score_mod / mask_mod need of a launch: the batch ``b`` and query head ``h`` of the
    CTA's tiles, the mods' values (score, mask) and the call's block mask (None: every block partial)."""

    b: int = 0
    h: int = 0
    values: tuple = ({}, {})
    block_mask: "np.ndarray | None" = attrs.field(default=None, eq=False)

    @classmethod
    def of(cls, plan: HopperPlan, b: int, h: int, mod_values: tuple, block_mask: "np.ndarray | None") -> "_Mods":
        check_mods(plan.score_mask, mod_values, block_mask)
        return cls(b, h, tuple({} if x is None else x for x in mod_values), block_mask)

    def row(self, plan: HopperPlan, q_block: int) -> "np.ndarray | None":
        return None if plan.score_mask.mods is None else bm.row(plan.score_mask, self.block_mask, self.b, self.h, q_block)

    def blocks(self, plan: HopperPlan, q_block: int, seq_q: int, seq_k: int, mask_args: tuple) -> tuple[int, int]:
        """A tile's key blocks as ``tile_at`` gives them: the built-in range clipped to the block mask's row."""
        return bm.clip(self.row(plan, q_block), *plan.score_mask.block_range(q_block * plan.cfg.B_r, seq_q, seq_k, *mask_args))


class _Cta:
    def __init__(self, plan: HopperPlan, q: np.ndarray, k: np.ndarray, v: np.ndarray, q_blocks: list[int], seq_q: int,
                 seq_k: int, scale: float, mask_args: tuple[int, int, int], ranges: list | None = None, mods: _Mods = _Mods()):
        self.plan, self.cfg = plan, plan.cfg
        cfg = plan.cfg
        self.dtype = cfg.dtype
        self.q, self.k, self.v = q, k, v
        self.seq_q, self.seq_k, self.mask_args, self.mods = seq_q, seq_k, mask_args, mods
        # with a score_mod the softmax takes the modded scores at scale 1 (the mod saw softmax_scale), except where
        # it adds a bias (the accumulator holds the bias over the scale: ScoreMask.forward_softmax_scale)
        self.mod_scale = np.float32(scale)
        self.scale = np.float32(plan.score_mask.forward_softmax_scale(scale))
        self.scale_log2 = np.float32(self.scale * np.float32(LOG2E))
        self.block_rows = [mods.row(plan, qb) for qb in q_blocks]
        if ranges is None:
            ranges = [mods.blocks(plan, qb, seq_q, seq_k, mask_args) for qb in q_blocks]
        # parts of split tiles: key-block ranges given (tail_split.ranges), clipped again as cta_work does
        self.tiles = [_Tile.of(qb * cfg.B_r, row, jb, je) for qb, row, (jb, je) in zip(q_blocks, self.block_rows, ranges, strict=True)]
        if len(self.tiles) > 1 and "q_empty" not in plan.barriers:
            raise ValueError(f"{cfg.short_form()}: only a persistent plan (q_empty barrier) walks several tiles")
        # key blocks in the order the CTA visits them: global index g (the K/V ring's use) -> (tile, key block);
        # the rings count uses over the tiles as the emitted kv_it and q_it do (tiles without key blocks use none)
        self.kv_ring, self.q_ring = plan.kv_ring, plan.q_ring
        # (the rings count a tile's uses along its walk: position u of the walk is use first_g + u)
        self.blocks = [(ti, j) for ti, t in enumerate(self.tiles) for j in t.walk]
        self.first_g, self.q_use = [0], [0]
        for t in self.tiles:
            self.first_g.append(self.kv_ring.after_tile(self.first_g[-1], 0, t.n) if t.n else self.first_g[-1])
            self.q_use.append(self.q_ring.after_tile(self.q_use[-1], 0, t.n) if t.n else self.q_use[-1])
        self.jb, self.je = self.tiles[0].jb, self.tiles[0].je
        self.hazards: list[str] = []
        self.visited: dict[int, list] = {}  # consumer -> (tile, key block) of each S GEMM executed
        self.smem = np.zeros(plan.smem_bytes, np.uint8)  # base 0 stands for the 1024-aligned dynamic base
        self.n_groups = 0
        self.counts: dict = {}  # (consumer, "S"|"softmax"|"O", g) or (consumer, "finish_rows"|"store_O", tile) -> times done
        # ring state
        self.stage_block = {"K": [None] * cfg.stages, "V": [None] * cfg.stages}
        self.q_tile: int | None = None  # whose Q is in shared memory
        self.arrivals: dict = {}  # (tensor, block or tile) -> releases' arrivals, for the messages
        # the mbarriers: (tensor, slot) -> phases completed (full: fills landed; empty: slots released) and
        # the arrivals of the empty barrier's phase in progress
        self.full_phases: dict = {}
        self.empty_phases: dict = {}
        self.empty_arrivals: dict = {}
        self.prod_ops = []
        for ti, t in enumerate(self.tiles):  # the emitted producer skips tiles without key blocks
            g0 = self.first_g[ti]
            if t.n:
                self.prod_ops += [("Q", ti)] + [(x, g) for g in range(g0, self.first_g[ti + 1]) for x in ("K", "V")]
        self.prod_pc = 0
        self.pending = [0] * cfg.consumers  # named-barrier arrivals waiting for each consumer's turn
        # outputs per tile: 16-bit O patterns and lse of the rows below seq_q
        rows = [max(0, min(cfg.B_r, seq_q - t.q_row0)) for t in self.tiles]
        self.o = [np.zeros((r, cfg.d_head), np.uint16) for r in rows]
        self.lse = [np.full(r, np.nan, np.float32) for r in rows]
        # maps
        self.cs, self.co = c_table(plan.gemm_S.atom), c_table(plan.gemm_O.atom)
        self.a = a_table(plan.gemm_O.atom)
        self.s_rows, self.s_slot = _row_slots(self.cs)
        o_rows, _ = _row_slots(self.co)
        if not np.array_equal(o_rows, self.s_rows):
            self.hazards.append("the O accumulator rows of a thread differ from its S rows: "
                                "rescale and normalisation would use another row's max")
        self.o_slot = (self.co.rows == self.s_rows[:, 1:2]).astype(np.int64)
        self.softmax_rule, self.epilogue_rule = online_softmax(plan), epilogue(plan)
        for what, slot in (("S", self.s_slot), ("O", self.o_slot)):  # the softmax's fragment rule: value 4c + 2h + e
            if not np.array_equal(slot, np.broadcast_to((np.arange(slot.shape[1]) // 2) % 2, slot.shape)):
                self.hazards.append(f"the {what} accumulator's row halves are not the softmax's (value 4 c + 2 h + e in half h)")
        cover = np.zeros((64, 16), np.int64)
        np.add.at(cover, (self.a.rows, self.a.cols), 1)
        if not np.all(cover == 1):
            self.hazards.append("the A-register map does not cover the 64x16 A tile exactly once")
        # element index of (CTA row, col) in the image; flat layout index = row + B_r * col (colex)
        self.o_stage = plan.tiles["O"].offset // 2 + offsets(plan.o_stage).reshape(cfg.d_head, cfg.B_r).T
        self._foreign: dict[int, np.ndarray] = {}  # consumer -> elements its output staging must not touch
        self._q_frag_addr: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # consumer -> (byte addresses, inside the tile)
        self.consumers = [self._consumer(w) for w in range(cfg.consumers)]

    # -- setup
    def name(self, g: int | None) -> str:
        """A key block as messages show it: ``j``, or ``j@tile`` when the walk has several tiles."""
        if g is None:
            return "none"
        ti, j = self.blocks[g]
        return str(j) if len(self.tiles) == 1 else f"{j}@{ti}"

    def _flat_steps(self) -> list:
        """(where, step, block g, tile) for each tile: the Q wait, prologue, body per block, epilogue,
        then the output steps; blocks resolved to global indices. Steps, guards and blocks are evaluated
        at a block's position ``u`` in the tile's walk (block ``j + 1``: the walk's next one)."""
        p = self.plan
        out = []

        def add(where, steps, ti, u):
            n = self.tiles[ti].n
            for i, s in enumerate(steps):
                if runs(s.guard, u, 0, n):
                    out.append((f"{where} step {i} ({_text(s)})", s, self._block(s, ti, u), ti))

        for ti, t in enumerate(self.tiles):
            at = f"tile {ti} " if len(self.tiles) > 1 else ""
            if t.n:
                add(f"{at}start j={t.jb}", p.tile_start, ti, 0)
                add(f"{at}prologue j={t.jb}", p.prologue, ti, 0)
            for u in range(1 if p.prologue else 0, t.n):
                add(f"{at}body j={t.walk[u]}", p.body, ti, u)
            if t.n:
                add(f"{at}epilogue", p.epilogue, ti, t.n - 1)
            add(f"{at}output", p.tile_output, ti, t.n - 1)
        return out

    def _block(self, s: Step, ti: int, u: int) -> int | None:
        """Global index of the block a step names at position ``u`` of tile ``ti``'s walk (``last``: the
        tile's last; None if it has none)."""
        t, block = self.tiles[ti], s.block or J
        if block.base == "end" and not t.n:
            return None
        return self.kv_ring.use(self.first_g[ti], block.index(u, 0, t.n), 0)

    def _consumer(self, w: int) -> _Consumer:
        g = self.plan
        return _Consumer(w, self._flat_steps(), g.gemm_S.atom.c_regs, g.gemm_O.atom.c_regs, g.gemm_O.k_steps)

    def flag(self, where: str, msg: str) -> None:
        text = f"{where}: {msg}"
        if text not in self.hazards:
            self.hazards.append(text)

    # -- producer
    def produce(self) -> None:
        """Issue loads in program order while each one's slot is free (Q: every consumer warp
        released the previous tile's; K/V: the stage's previous block released)."""
        cfg, plan = self.cfg, self.plan
        while self.prod_pc < len(self.prod_ops):
            t, x = self.prod_ops[self.prod_pc]
            ring, it = (self.q_ring, self.q_use[x]) if t == "Q" else (self.kv_ring, x)
            st = ring.stage(it)
            # the emitted producer waits for Q's empty barrier only when persistent (one tile otherwise)
            if (t != "Q" or "q_empty" in plan.barriers) and not phase_passed(self.empty_phases, (t, st), ring.empty_phase(it)):
                return
            if t == "Q":
                tile = self.tiles[x]
                tma_fill(self.smem, plan.loads["Q"], plan.tiles["Q"].offset,
                         self.q[tile.q_row0: min(tile.q_row0 + cfg.B_r, self.seq_q)])
                self.q_tile = x
            else:
                j = self.blocks[x][1]
                rows = getattr(self, t.lower())[j * cfg.B_c: (j + 1) * cfg.B_c]
                tma_fill(self.smem, plan.loads[t], plan.loads[t].tile.stage_offset(st), rows)
                self.stage_block[t][st] = x
            self.full_phases[(t, st)] = self.full_phases.get((t, st), 0) + 1  # the fill's bytes landed
            self.prod_pc += 1

    # -- the walk
    def run(self) -> None:
        if self.cfg.pingpong:
            if self.cfg.consumers < 2:
                self.flag("start", f"pingpong needs 2 or more consumer warpgroups, the plan has {self.cfg.consumers}")
            else:
                self.pending[0] += 1  # the last consumer hands consumer 0 the first turn (before the tile loop)
        walk_consumers(self.consumers, self.step, self.produce, self.flag, greedy=False)
        for c in self.consumers:
            self.finish(c)
        self.final_checks()

    def step(self, c: _Consumer) -> bool:
        """Execute ``c``'s next step; False when it has to wait."""
        where, s, b, ti = c.steps[c.pc]
        run = _STEPS.get(type(s))
        if run is None:
            self.flag(where, f"no simulation of consumer step {type(s).__name__}")
        elif run(self, c, s, b, ti, where) is False:
            return False
        c.pc += 1
        return True

    def slot(self, tensor: str, block: "Block | None", b: int, ti: int) -> tuple[int, int]:
        """(slot, full parity) the emitted code computes for ``tensor``'s ``block`` (use ``b``) of tile ``ti``:
        Q's from the tile's use; K/V's from the loop's block ``j`` (use ``it``), for block j - 1 (the last
        block after the loop, ``j = j_end``) the ring's ``prev`` rule of ``it``."""
        if tensor == "Q":
            return self.q_ring.stage(self.q_use[ti]), self.q_ring.phase(self.q_use[ti])
        ring = self.kv_ring
        if block is not None and block.offset == -1:
            return ring.prev_stage(b + 1), ring.prev_phase(b + 1)
        return ring.stage(b), ring.phase(b)

    def wait_full(self, c: _Consumer, s: WaitFull, b: int, ti: int, where: str) -> bool:
        """False while the full barrier's phase of this use has not completed; a wait that passes on a slot
        holding other data (a phase or slot off) is a hazard."""
        key = ("Q", ti) if s.arg == "Q" else (s.arg, b)
        if s.arg != "Q" and not (b is not None and 0 <= b < len(self.blocks)):
            self.flag(where, f"waits for {s.arg}_{b}, outside the visited blocks")
        else:
            st, parity = self.slot(s.arg, s.block, b, ti)
            if not phase_passed(self.full_phases, (s.arg, st), parity):
                return False
            held = self.q_tile if s.arg == "Q" else self.stage_block[s.arg][st]
            if held != key[1]:
                what = "nothing" if held is None else (f"the Q of tile {held}" if s.arg == "Q" else f"{s.arg}_{self.name(held)}")
                self.flag(where, f"consumer {c.w}: the wait for {s.arg}_{self.name(b) if s.arg != 'Q' else ti} on slot {st}, "
                                 f"parity {parity}, passes while the slot holds {what}")
        c.full_seen.add(key)
        if s.arg == "Q" and self.plan.q_load is not None:
            c.q_frag = (ti, self.load_q_frags(c))
        return True

    def turn(self, c: _Consumer, where: str) -> bool:
        """False until the previous consumer passed (pingpong)."""
        if not self.cfg.pingpong:
            self.flag(where, "turn step in a plan without pingpong")
        elif self.pending[c.w] == 0:
            return False
        else:
            self.pending[c.w] -= 1
        c.turns += 1
        return True

    def pass_turn(self, c: _Consumer, where: str) -> None:
        if not self.cfg.pingpong:
            self.flag(where, "pass step in a plan without pingpong")
            return
        other = (c.w + 1) % self.cfg.consumers  # the ring's next consumer
        self.pending[other] += 1
        c.passes += 1
        if self.pending[other] > 1:
            self.flag(where, f"consumer {c.w} arrives twice on consumer {other}'s turn barrier before it synced (over-arrival)")

    def wgmma_wait(self, c: _Consumer, keep: int, where: str) -> None:
        while len(c.groups) > keep:
            self.retire(c, where)

    # -- hazards
    def touch(self, c: _Consumer, reads: set, writes: set, where: str) -> None:
        for g in c.groups:
            bad = ((reads | writes) & g.writes) | (writes & g.reads)
            if bad:
                self.flag(where, f"consumer {c.w} touches {'/'.join(sorted(bad))} registers while wgmma group {g.what} is in flight")

    def release(self, c: _Consumer, t: str, b: int, ti: int, st: int, where: str) -> None:
        """One arrival per warp on the empty barrier of slot ``st`` (Q's slot, or the K/V ring's slot of ``b``)."""
        if f"{t.lower()}_empty" not in self.plan.barriers:
            self.flag(where, f"consumer {c.w} releases {t} but the plan has no {t.lower()}_empty barrier")
            return
        if t == "Q":  # Q has one slot, read by every S GEMM of the tile (or once, into the fragments, at its wait)
            key, what = ("Q", ti), "Q"
            if ("Q", ti) not in c.full_seen:
                self.flag(where, f"consumer {c.w} releases Q it never waited for")
            for g in c.groups if self.plan.gemm_S.a_from == "smem" else ():
                if g.what.startswith("S"):
                    self.flag(where, f"consumer {c.w} releases Q while wgmma group {g.what} still reads it")
        else:
            key, what = (t, b), f"{t}_{self.name(b)}"
            for g in c.groups:
                if g.smem[:2] == (t, b):
                    self.flag(where, f"consumer {c.w} releases {what} while wgmma group {g.what} still reads it")
            if (t, b) not in c.full_seen:
                self.flag(where, f"consumer {c.w} releases {what} it never waited for")
        if key in c.released:
            self.flag(where, f"consumer {c.w} releases {what} twice")
        c.released.add(key)
        need = self.plan.barriers[f"{t.lower()}_empty"][0].arrive_count
        n = self.arrivals.get(key, 0) + WARPS_PER_WG  # one arrival per warp
        if n > need:
            self.flag(where, f"{t.lower()}_empty of {what} gets {n} arrivals, more than its count {need}")
        self.arrivals[key] = n
        bar = (t, st)  # the slot the emitted code arrives on; its phase completes with the count's last arrival
        self.empty_arrivals[bar] = self.empty_arrivals.get(bar, 0) + WARPS_PER_WG
        if self.empty_arrivals[bar] >= need:
            self.empty_arrivals[bar] = 0
            self.empty_phases[bar] = self.empty_phases.get(bar, 0) + 1

    def _check_stage(self, c: _Consumer, t: str, b: int, st: int, where: str, when: str) -> None:
        held = self.stage_block[t][st]
        if held != b:
            what = "nothing" if held is None else f"{t}_{self.name(held)}"
            self.flag(where, f"consumer {c.w}: wgmma {when} stage {st} for {t}_{self.name(b)} but it holds {what}")

    # -- GEMMs
    def issue(self, c: _Consumer, which: str, b: int, ti: int, st: int, where: str) -> None:
        """Commit a wgmma group reading ring slot ``st`` (the emitted descriptor's) for block ``b``."""
        t = _GEMM_B[which]
        if (t, b) not in c.full_seen:
            self.flag(where, f"consumer {c.w}: gemm {which} reads {t}_{self.name(b)} without its wait_full")
        if (t, b) in c.released:
            self.flag(where, f"consumer {c.w}: gemm {which} reads {t}_{self.name(b)} after releasing it")
        q_smem = which == "S" and self.plan.gemm_S.a_from == "smem"  # else S reads the fragments loaded at the Q wait
        if q_smem and ("Q", ti) in c.released:
            self.flag(where, f"consumer {c.w}: gemm S reads Q after releasing it (the producer may load the next tile's)")
        if which == "S" and ("Q", ti) not in c.full_seen:
            self.flag(where, f"consumer {c.w}: gemm S reads Q without its wait_full")
        self._check_stage(c, t, b, st, where, "issued on")
        if which == "S":
            g = _Group(f"S[{self.name(b)}]", frozenset({"S"}), frozenset(), (t, b, st), lambda: self.exec_s(c, b, ti, st, where))
        else:
            if c.p_block != b:
                self.flag(where, f"consumer {c.w}: gemm O of block {self.name(b)} but the P registers hold block {self.name(c.p_block)}")
            if c.o_scale is not None and c.o_scale != b:
                self.flag(where, f"consumer {c.w}: O (scaled to block {self.name(c.o_scale)}'s max) += P_{self.name(b)} "
                                 f"(block {self.name(b)}'s max): a rescale is missing")
            c.o_scale = b
            g = _Group(f"O[{self.name(b)}]", frozenset({"O"}), frozenset({"P", "O"}), (t, b, st), lambda: self.exec_o(c, b, st, where))
        c.groups.append(g)
        self.n_groups += 1

    def retire(self, c: _Consumer, where: str) -> None:
        g = c.groups.pop(0)
        self._check_stage(c, *g.smem, f"{where} (retiring {g.what})", "executed on")
        g.run()

    def load_q_frags(self, c: _Consumer) -> np.ndarray:
        """Consumer ``c``'s Q fragments as the plan's ldmatrix load reads them from the image now."""
        if c.w not in self._q_frag_addr:  # the addresses are the same every tile
            ld = self.plan.q_load
            tile = self.plan.tiles[ld.tile]
            src_r, src_c, _, _ = _register_load_map(ld, self.plan.gemm_S.atom)
            table = tile_table(tile)  # [row, col] -> element offset
            rows = 64 * c.w + src_r
            inside = (rows < tile.rows) & (src_c < tile.cols)
            self._q_frag_addr[c.w] = (tile.offset + 2 * table[np.where(inside, rows, 0), np.where(inside, src_c, 0)], inside)
        addr, inside = self._q_frag_addr[c.w]
        return np.where(inside, read16(self.smem, addr, self.dtype), np.nan)

    def exec_s(self, c: _Consumer, b: int, ti: int, st: int, where: str) -> None:
        """S = Q K_b^T: ``k_steps`` wgmma; step 0 has scale-d 0 (fresh accumulator). A is Q's tile in
        shared memory (descriptors) or, with ``plan.q_load``, the fragments loaded at the tile's Q wait."""
        g, dt = self.plan.gemm_S, self.dtype
        if g.a_from == "regs":
            if c.q_frag is None or c.q_frag[0] != ti:
                self.flag(where, f"consumer {c.w}: S[{self.name(b)}] of tile {ti} reads Q fragments of tile "
                                 f"{None if c.q_frag is None else c.q_frag[0]}")
        elif self.q_tile != ti:
            self.flag(where, f"consumer {c.w}: S[{self.name(b)}] of tile {ti} executes on the Q of tile {self.q_tile}")
        q_base, k_base = self.plan.tiles["Q"].offset, self.plan.tiles["K"].stage_offset(st)
        acc = np.zeros(c.s_acc.shape, np.float64)
        if g.a_from == "regs":
            _, _, a_rows, a_cols = _register_load_map(self.plan.q_load, g.atom)
        for s in range(g.k_steps):
            if g.a_from == "regs":
                a = np.full((64, 16), np.nan)
                a[a_rows, a_cols] = c.q_frag[1][s] if c.q_frag is not None else np.nan
            else:
                a = read16(self.smem, descriptor_addresses(g.a.descriptor(q_base, s, c.w), 64, 16, dt), dt)
            bm = read16(self.smem, descriptor_addresses(g.b.descriptor(k_base, s), g.atom.N, 16, dt), dt)
            acc = wgmma_k16(acc, a, bm, self.cs)
        c.s_acc = acc.astype(np.float32)
        c.s_state = ("raw", b)
        self.count(c, "S", b)
        self.visited.setdefault(c.w, []).append(self.blocks[b])

    def exec_o(self, c: _Consumer, b: int, st: int, where: str) -> None:
        """O += P V_b: A (64x16 per k16 step) from the P registers via the A map, B = V MN-major."""
        g, dt = self.plan.gemm_O, self.dtype
        v_base = self.plan.tiles["V"].stage_offset(st)
        acc = c.o_acc.astype(np.float64)
        for t in range(g.k_steps):
            a = np.zeros((64, 16))
            regs = c.p_frag[:, t]  # [thread, reg, half]
            a[self.a.rows, self.a.cols] = hw.decode(regs.reshape(WG, 8), dt)  # value v = 2*reg + half
            bm = read16(self.smem, descriptor_addresses_mn(g.b.descriptor(v_base, t), g.atom.N, 16, dt), dt)
            acc = wgmma_k16(acc, a, bm, self.co)
        c.o_acc = acc.astype(np.float32)
        self.count(c, "O", b)

    def count(self, c: _Consumer, what: str, b: int) -> None:
        key = (c.w, what, b)
        self.counts[key] = self.counts.get(key, 0) + 1

    # -- softmax
    def _normalized(self, o_acc: np.ndarray, inv: np.ndarray) -> np.ndarray:
        """O's accumulators ``[thread, value]`` times ``1/l`` of their row half (the epilogue's normalisation)."""
        for h in range(2):
            o_acc = self.epilogue_rule.normalize(o_acc, h, inv[:, h])
        return o_acc

    def _check_rows_agree(self, x: np.ndarray, what: str, where: str) -> None:
        """After the butterfly every thread holding a row must have the same value."""
        for h in range(2):
            for r in np.unique(self.s_rows[:, h]):
                vals = x[self.s_rows == r]
                if not (np.all(vals == vals[0]) or np.all(np.isnan(vals))):
                    self.flag(where, f"row_reduce_lanes {self.plan.row_reduce_lanes} leave threads of row {r} with different {what}")
                    return

    def softmax(self, c: _Consumer, g: int, ti: int, first: bool, where: str) -> None:
        f32 = np.float32
        if c.s_state != ("raw", g):
            state = None if c.s_state is None else (c.s_state[0], self.name(c.s_state[1]))
            self.flag(where, f"consumer {c.w}: softmax of block {self.name(g)} but S holds {state}")
        if first and c.max_block is not None:
            self.flag(where, f"consumer {c.w}: the first softmax of tile {ti} starts from the statistics of block "
                             f"{self.name(c.max_block)} (no finish_rows reset them)")
        self.count(c, "softmax", g)
        s = c.s_acc.copy()
        mask, j, q_row0 = self.plan.score_mask, self.blocks[g][1], self.tiles[ti].q_row0
        masked = mask.masked_path(j, q_row0, self.seq_q, self.seq_k, *self.mask_args, row=self.block_rows[ti])
        if masked or mask.score_mod is not None:  # the plan's score rule, on the C map's rows and columns
            s = mask.apply(s, q_row0 + 64 * c.w + self.cs.rows, j * self.cfg.B_c + self.cs.cols, masked, b=self.mods.b,
                           h=self.mods.h, seq_q=self.seq_q, seq_k=self.seq_k, mask_args=self.mask_args,
                           mod_values=self.mods.values, scale=self.mod_scale, forward=True).astype(f32)
        sm = self.softmax_rule
        mx = np.stack([sm.row_max(s, h) for h in range(2)], axis=1)
        self._check_rows_agree(mx, "row maxima", where)
        p = s
        for h in range(2):
            p, c.row_max[:, h], c.row_sum[:, h], corr = sm.update(p, h, c.row_max[:, h], c.row_sum[:, h], self.scale_log2, first)
            if not first:  # the emitted first block keeps no factor (the prologue has no rescale_O)
                c.corr[:, h] = corr
        c.corr_from = None if first else c.max_block
        c.max_block = g
        c.s_acc = p
        c.s_state = ("P", g)

    def convert_p(self, c: _Consumer, where: str) -> None:
        """``p_frag[t][r] = pack2(s_acc[lo], s_acc[hi])`` exactly as ``plan.p_from_s`` says."""
        if c.s_state is None or c.s_state[0] != "P":
            self.flag(where, f"consumer {c.w}: convert_P but S holds {c.s_state} (no softmax since the last S)")
        idx = np.array(self.plan.p_from_s, dtype=np.int64)  # [k_steps, 4, 2]
        c.p_frag = hw.encode(c.s_acc[:, idx], self.dtype)
        c.p_block = c.s_state[1] if c.s_state else None

    def rescale(self, c: _Consumer, where: str) -> None:
        if c.o_scale is not None and c.o_scale != c.corr_from:
            self.flag(where, f"consumer {c.w}: rescale_O applies the correction from block {self.name(c.corr_from)}'s max "
                             f"to O scaled to block {self.name(c.o_scale)}'s")
        for h in range(2):
            c.o_acc = scale_row(c.o_acc, h, c.corr[:, h])
        c.o_scale = c.max_block

    # -- a tile's output
    def _last(self, ti: int) -> int | None:
        t = self.tiles[ti]
        return self.first_g[ti] + t.n - 1 if t.n else None

    def _finish(self, row_max: np.ndarray, row_sum: np.ndarray, what: str, where: str) -> tuple[np.ndarray, np.ndarray]:
        """The emitted rows' finish: row sums quad-reduced (checked to agree), ``1/l`` (0 for a row
        without keys) and each row's LSE (-inf there), per thread and row half."""
        ep = self.epilogue_rule
        l = ep.row_sum(row_sum.T).T  # [thread, row half]
        self._check_rows_agree(l, what, where)
        return ep.inv(l), ep.lse(row_max, l, self.scale)

    def _lse_rows(self, row_lse: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The LSE the writer threads store (one lane per quad): (rows within the warpgroup, values)."""
        writer = (np.arange(WG) % 32 & sum(self.plan.row_reduce_lanes)) == 0
        return self.s_rows[writer].ravel(), row_lse[writer].ravel()

    def finish_rows(self, c: _Consumer, ti: int, where: str) -> None:
        """Row sums quad-reduced, 1/l kept for store_O, lse written; row statistics reset for the next tile."""
        if c.max_block != self._last(ti):
            self.flag(where, f"consumer {c.w}: finish_rows of tile {ti} with the statistics of block "
                             f"{self.name(c.max_block)}, not of its last block {self.name(self._last(ti))}")
        self.count(c, "finish_rows", ti)
        inv, row_lse = self._finish(c.row_max, c.row_sum, "row sums", where)
        rows, vals = self._lse_rows(row_lse)
        rr = 64 * c.w + rows
        ok = rr < self.lse[ti].size
        self.lse[ti][rr[ok]] = vals[ok]
        c.fin = (ti, inv)
        c.partial[ti] = (c.row_max.copy(), c.row_sum.copy(), c.o_acc.copy())
        c.row_max[:] = -np.inf
        c.row_sum[:] = 0
        c.max_block = None

    def store_o(self, c: _Consumer, ti: int, where: str) -> None:
        """O /= l staged through ``plan.o_stage`` and read back by the TMA stores of ``plan.stores``, as the
        emitted code does; O reset."""
        f32 = np.float32
        self.count(c, "store_O", ti)
        if c.fin is None or c.fin[0] != ti:
            self.flag(where, f"consumer {c.w}: store_O of tile {ti} without its finish_rows")
            inv = np.zeros((WG, 2), f32)
        else:
            inv = c.fin[1]
        for g in range(self.first_g[ti], self.first_g[ti + 1]):
            if self.counts.get((c.w, "O", g), 0) != 1:
                self.flag(where, f"consumer {c.w}: store_O of tile {ti} before gemm O of block {self.name(g)} ran")
                break
        if c.o_scale is not None and c.o_scale != self._last(ti):
            self.flag(where, f"consumer {c.w}: O is scaled to block {self.name(c.o_scale)}'s max, the statistics to "
                             f"block {self.name(self._last(ti))}'s")
        val = self._normalized(c.o_acc, inv)
        img, o_stage, o = self.smem.view("<u2"), self.o_stage, self.o[ti]
        # st.shared.b32 of pack2(value i, value i+1), i even, at o_stage(c_map(thread, i))
        ev = np.arange(0, val.shape[1], 2)
        dst = o_stage[64 * c.w + self.co.rows[:, ev], self.co.cols[:, ev]]
        if dst.min() < 0 or dst.max() + 1 >= img.size:
            self.flag(where, f"consumer {c.w}: o_stage addresses fall outside the {self.smem.size}-byte shared memory")
        else:
            clash = self._foreign_elements(c.w)[np.concatenate([dst.ravel(), dst.ravel() + 1])].sum()
            if clash:
                self.flag(where, f"consumer {c.w} stages O over {clash} element(s) another warpgroup or the "
                                 "producer may still use (other consumers' Q or O rows, the K/V ring, the mbarriers)")
            img[dst] = self.epilogue_rule.convert(val[:, ev], self.dtype)
            img[dst + 1] = self.epilogue_rule.convert(val[:, ev + 1], self.dtype)
            # the TMA stores of this consumer's boxes (plan.stores) read the rows back; rows past
            # the sequence end are not written
            rows = np.arange(64 * c.w, 64 * c.w + 64)
            rows = rows[rows < o.shape[0]]
            store = self.plan.stores["O"]
            staged = tma_read(self.smem, store, store.tile.offset, (64 * c.w, 64 * c.w + 64))
            o[rows] = staged[rows]
        c.o_acc[:] = 0
        c.o_scale = None
        c.fin = None

    # -- the end
    def finish(self, c: _Consumer) -> None:
        where = f"end of consumer {c.w}"
        if c.groups:
            names = ", ".join(g.what for g in c.groups)
            self.flag(where, f"{len(c.groups)} wgmma group(s) still in flight ({names}) at exit")
            while c.groups:
                self.retire(c, where)
        for g in range(len(self.blocks)):
            for what in ("S", "softmax", "O"):
                n = self.counts.get((c.w, what, g), 0)
                if n != 1:
                    name = what if what == "softmax" else f"gemm {what}"
                    self.flag(where, f"consumer {c.w}: {name} ran {n} time(s) for block {self.name(g)} (expected once)")
            for t in ("K", "V"):
                if (t, g) not in c.released:
                    self.flag(where, f"consumer {c.w} never releases {t}_{self.name(g)}")
        for ti, t in enumerate(self.tiles):
            for what in ("finish_rows", "store_O"):
                n = self.counts.get((c.w, what, ti), 0)
                if n != 1:
                    self.flag(where, f"consumer {c.w}: {what} ran {n} time(s) for tile {ti} (expected once)")
            if "q_empty" in self.plan.barriers and t.n and ("Q", ti) not in c.released:
                self.flag(where, f"consumer {c.w} never releases Q: a persistent producer waits forever for the next tile")

    def final_checks(self) -> None:
        if self.prod_pc < len(self.prod_ops):
            t, x = self.prod_ops[self.prod_pc]
            what = f"the Q of tile {x}: Q was" if t == "Q" else f"{t}_{self.name(x)}: its stage was"
            self.flag("producer", f"never issues {what} not released by every consumer warp")
        if self.cfg.pingpong and self.cfg.consumers >= 2:
            # before exit consumer 0 takes the pass the last consumer gave last (or its initial one)
            if self.pending[0]:
                self.pending[0] -= 1
                self.consumers[0].absorbed += 1
            for w, n in enumerate(self.pending):
                if n:
                    self.flag("exit", f"consumer {w}'s turn barrier has {n} unmatched pass(es): turns and passes do not balance")

    def _foreign_elements(self, w: int) -> np.ndarray:
        """Mask over the image's 16-bit elements consumer ``w``'s epilogue must not write: the
        other consumers' Q rows and O staging rows, every K/V stage and the mbarriers (its own Q
        rows are free: its S GEMMs have all retired). Built once per consumer (every tile reuses it)."""
        if w in self._foreign:
            return self._foreign[w]
        cfg, plan, o_stage = self.cfg, self.plan, self.o_stage
        bad = np.zeros(self.smem.size // 2, bool)
        others = np.ones(cfg.B_r, bool)
        others[64 * w: 64 * (w + 1)] = False
        bad[tma_byte_addresses(cfg.B_r, cfg.d_head, plan.tiles["Q"].offset)[others] // 2] = True
        bad[o_stage[others]] = True
        for t in ("K", "V"):
            tile = plan.tiles[t]
            bad[tile.offset // 2: (tile.offset + tile.stages * tile.stage_bytes) // 2] = True
        for _, off, stages in plan.barriers.values():
            bad[off // 2: (off + 8 * stages) // 2] = True
        self._foreign[w] = bad
        return bad


    # -- the wave-tail split
    def merge_parts(self, parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]], w: int) -> tuple[np.ndarray, np.ndarray]:
        """Consumer ``w``'s merge of a split tile's parts as the emitted counting-last warp does it (per
        thread, fp32): max over the parts; per part in order ``c = ex2(fma(m_k, scale*log2e, -M*scale*log2e))``,
        ``l = fma(l_k, c, l)``, ``o = fma(o_k, c, o)``; then the quad-reduced ``l``, ``1/l``, LSE and the
        rows written straight from the accumulator map. ``parts``: ``(row_max, row_sum, o_acc)`` of
        each part. Returns ``(o [64, d] uint16, lse [64])`` of the warpgroup's rows."""
        f32 = np.float32
        m = parts[0][0].copy()
        for mk, _, _ in parts:
            m = np.fmax(m, mk)
        sm = self.softmax_rule
        neg = sm.neg_max(m, self.scale_log2)
        l = np.zeros_like(m)
        o = np.zeros_like(parts[0][2])
        for mk, lk, ok in parts:
            c = sm.rescale_factor(mk, self.scale_log2, neg)
            l = hw.fma32(lk, c, l)
            o = hw.fma32(ok, np.take_along_axis(c, self.o_slot, axis=1), o)
        inv, row_lse = self._finish(m, l, "merged row sums", f"merge of consumer {w}")
        lse = np.full(64, np.nan, f32)
        rows, vals = self._lse_rows(row_lse)
        lse[rows] = vals
        out = np.zeros((64, self.cfg.d_head), np.uint16)
        out[self.co.rows, self.co.cols] = self.epilogue_rule.convert(self._normalized(o, inv), self.dtype)
        return out, lse


def _touching(reads: set, writes: set, then):
    """A step that touches registers (checked against the wgmma groups in flight), then runs ``then``."""
    def run(cta: _Cta, c: _Consumer, s: Step, b: int, ti: int, where: str) -> None:
        cta.touch(c, reads, writes, where)
        then(cta, c, s, b, ti, where)
    return run


#: the ring tensor each GEMM reads (its B operand)
_GEMM_B = {"S": "K", "O": "V"}

#: consumer step class -> how a consumer executes it (False: it has to wait); see flashgen.dsl.steps
_STEPS = {
    WaitFull: _Cta.wait_full,
    Turn: lambda cta, c, s, b, ti, where: cta.turn(c, where),
    Pass: lambda cta, c, s, b, ti, where: cta.pass_turn(c, where),
    Gemm: lambda cta, c, s, b, ti, where: cta.issue(c, s.arg, b, ti, cta.slot(_GEMM_B[s.arg], s.block, b, ti)[0], where),
    WgmmaWait: lambda cta, c, s, b, ti, where: cta.wgmma_wait(c, int(s.arg), where),
    Release: lambda cta, c, s, b, ti, where: cta.release(c, s.arg, b, ti, cta.slot(s.arg, s.block, b, ti)[0], where),
    Softmax: _touching({"S"}, {"S"}, lambda cta, c, s, b, ti, where: cta.softmax(c, b, ti, s.arg == "first", where)),
    ConvertP: _touching({"S"}, {"P"}, lambda cta, c, s, b, ti, where: cta.convert_p(c, where)),
    RescaleO: _touching({"O"}, {"O"}, lambda cta, c, s, b, ti, where: cta.rescale(c, where)),
    FinishRows: lambda cta, c, s, b, ti, where: cta.finish_rows(c, ti, where),
    StoreO: _touching({"O"}, {"O"}, lambda cta, c, s, b, ti, where: cta.store_o(c, ti, where)),
}


def _text(s: Step) -> str:
    return s.op + (f" {s.arg}" if s.arg else "") + (f" {s.block}" if s.block else "")


# ---------------------------------------------------------------------- entry points


def _encode_inputs(plan: HopperPlan, q, k, v, seq_q, seq_k):
    cfg = plan.cfg
    q, k, v = (hw.operand_rows(name, x, cfg.dtype, cfg.d_head) for name, x in (("q", q), ("k", k), ("v", v)))
    seq_q = q.shape[0] if seq_q is None else seq_q
    seq_k = k.shape[0] if seq_k is None else seq_k
    if q.shape[0] < seq_q or k.shape[0] < seq_k or v.shape != k.shape:
        raise ValueError(f"q/k/v shapes {q.shape}, {k.shape}, {v.shape} do not cover seq_q={seq_q}, seq_k={seq_k}")
    return q[:seq_q], k[:seq_k], v[:seq_k], seq_q, seq_k


def _check_q_blocks(plan: HopperPlan, q_blocks, seq_q: int) -> None:
    for qb in q_blocks:
        if not 0 <= qb * plan.cfg.B_r < seq_q:
            raise ValueError(f"q_block {qb} starts at row {qb * plan.cfg.B_r}, outside seq_q={seq_q}")


def simulate_tiles(plan: "HopperPlan", q: np.ndarray, k: np.ndarray, v: np.ndarray, sms: int = 1, cta: int = 0,
                   seq_q: int | None = None, seq_k: int | None = None, scale: float | None = None, *,
                   mask_offset: int = 0, window_left: int = -1, window_right: int = -1, b: int = 0, h: int = 0,
                   mod_values: tuple = (None, None), block_mask: "np.ndarray | None" = None
                   ) -> tuple[list[np.ndarray], list[np.ndarray], HopperReport]:
    """CTA ``cta`` of a launch of one head on ``sms`` SMs, walking the tiles the plan's scheduler gives
    it (``plan.scheduler``: grid, rounds, order; parts of a split tail tile walk their key ranges):
    ``(o per tile, lse per tile, report)``, ``report.tiles`` naming each tile's query block and part.
    A part's rows are its unmerged share (:func:`simulate_split_tile` merges). Arguments as
    :func:`simulate_cta`; the head is ``h`` of batch ``b``. The grid comes from the built-in rule's key
    blocks (the launch's host code has no block mask), each tile's blocks are clipped to the block mask."""
    if not isinstance(plan, HopperPlan):
        plan = make_hopper_plan(plan)
    cfg, sched = plan.cfg, plan.scheduler
    q, k, v, seq_q, seq_k = _encode_inputs(plan, q, k, v, seq_q, seq_k)
    scale = 1.0 / np.sqrt(cfg.d_head) if scale is None else scale
    mask_args = (mask_offset, window_left, window_right)
    n_q = sched.n_q_blocks(seq_q)
    mods = _Mods.of(plan, b, h, mod_values, block_mask)
    blocks = [plan.score_mask.block_range(qb * cfg.B_r, seq_q, seq_k, *mask_args) for qb in range(n_q)]
    lengths = [max(0, je - jb) for jb, je in blocks]
    ctas, parts = sched.grid(n_q, sms, min(lengths), n_q, min(lengths) == max(lengths))
    if not 0 <= cta < ctas:
        raise ValueError(f"cta {cta} is outside the launch's {ctas} CTA(s)")
    walk = [(sched.coords(t, n_q, 1)[0], part) for t, part in sched.work(cta, ctas, n_q, parts)]
    clipped = [mods.blocks(plan, qb, seq_q, seq_k, mask_args) for qb in range(n_q)]
    ranges = [clipped[qb] if part < 0 else sched.tail.ranges(*clipped[qb], parts)[part] for qb, part in walk]
    run = _Cta(plan, q, k, v, [qb for qb, _ in walk], seq_q, seq_k, scale, mask_args, ranges=ranges, mods=mods)
    run.run()
    pp = {c.w: {"turn": c.turns, "pass": c.passes, "absorbed": c.absorbed} for c in run.consumers}
    return run.o, run.lse, HopperReport(run.hazards, run.jb, run.je, run.n_groups, pp, walk, run.visited)


def simulate_split_tile(plan: "HopperPlan", q: np.ndarray, k: np.ndarray, v: np.ndarray, parts: int, q_block: int = 0,
                        seq_q: int | None = None, seq_k: int | None = None, scale: float | None = None, *,
                        mask_offset: int = 0, window_left: int = -1, window_right: int = -1, b: int = 0, h: int = 0,
                        mod_values: tuple = (None, None), block_mask: "np.ndarray | None" = None
                        ) -> tuple[np.ndarray, np.ndarray, HopperReport]:
    """One wave-tail tile split into ``parts`` (``plan.tail_split``): each part a CTA walking its key
    blocks (:meth:`TailSplit.ranges`) and publishing its consumers' row max, row sums and O
    accumulators; then every consumer's merge (:meth:`_Cta.merge_parts`). ``(o, lse, report)`` as
    :func:`simulate_cta`; the report joins the parts' hazards."""
    if not isinstance(plan, HopperPlan):
        plan = make_hopper_plan(plan)
    cfg = plan.cfg
    q, k, v, seq_q, seq_k = _encode_inputs(plan, q, k, v, seq_q, seq_k)
    _check_q_blocks(plan, [q_block], seq_q)
    if parts < 1:
        raise ValueError(f"parts must be at least 1, got {parts}")
    scale = 1.0 / np.sqrt(cfg.d_head) if scale is None else scale
    mask_args = (mask_offset, window_left, window_right)
    mods = _Mods.of(plan, b, h, mod_values, block_mask)
    jb, je = mods.blocks(plan, q_block, seq_q, seq_k, mask_args)
    ranges = plan.tail_split.ranges(jb, je, parts)
    if any(b >= e for b, e in ranges):
        raise ValueError(f"{parts} parts of key blocks [{jb}, {je}) leave a part empty (the launcher's rule never does)")
    ctas = [_Cta(plan, q, k, v, [q_block], seq_q, seq_k, scale, mask_args, ranges=[r], mods=mods) for r in ranges]
    hazards: list[str] = []
    for n, cta in enumerate(ctas):
        cta.run()
        hazards += [f"part {n}: {h}" for h in cta.hazards]
    rows = max(0, min(cfg.B_r, seq_q - q_block * cfg.B_r))
    o = np.zeros((cfg.B_r, cfg.d_head), np.uint16)
    lse = np.full(cfg.B_r, np.nan, np.float32)
    before = len(ctas[-1].hazards)
    for w in range(cfg.consumers):
        ow, lw = ctas[-1].merge_parts([cta.consumers[w].partial[0] for cta in ctas], w)
        o[64 * w: 64 * w + 64], lse[64 * w: 64 * w + 64] = ow, lw
    hazards += ctas[-1].hazards[before:]
    visited = {w: [blk for cta in ctas for blk in cta.visited.get(w, [])] for w in range(cfg.consumers)}
    return o[:rows], lse[:rows], HopperReport(hazards, jb, je, sum(c.n_groups for c in ctas), visited=visited)


def simulate_cta(plan: "HopperPlan", q: np.ndarray, k: np.ndarray, v: np.ndarray, q_block: int = 0,
                 seq_q: int | None = None, seq_k: int | None = None, scale: float | None = None, *,
                 mask_offset: int = 0, window_left: int = -1, window_right: int = -1, b: int = 0, h: int = 0,
                 mod_values: tuple = (None, None), block_mask: "np.ndarray | None" = None
                 ) -> tuple[np.ndarray, np.ndarray, HopperReport]:
    """One CTA (query rows ``q_block * B_r ...``) of the Hopper plan: ``(o, lse, report)``.

    ``q``: ``[seq_q, d]``, ``k``/``v``: ``[seq_k, d]``, 16-bit patterns (uint16) or floats
    (rounded to the dtype). ``o``: ``[rows, d]`` uint16 patterns of the CTA's rows below
    ``seq_q``; ``lse``: natural-log log-sum-exp (``-inf`` for a row with no kept score).
    ``scale`` defaults to ``1/sqrt(d)``. A plan built with a score_mod / mask_mod: ``b``, ``h`` the
    tile's batch and query head, ``mod_values`` the mods' values (score, mask:
    :meth:`~flashgen.mods.ModArgs.values`), ``block_mask`` the call's whole block mask
    (:func:`flashgen.sim.block_mask.block_mask`) or None (every block partial, none skipped).
    """
    if not isinstance(plan, HopperPlan):
        plan = make_hopper_plan(plan)
    q, k, v, seq_q, seq_k = _encode_inputs(plan, q, k, v, seq_q, seq_k)
    _check_q_blocks(plan, [q_block], seq_q)
    scale = 1.0 / np.sqrt(plan.cfg.d_head) if scale is None else scale
    mods = _Mods.of(plan, b, h, mod_values, block_mask)
    run = _Cta(plan, q, k, v, [q_block], seq_q, seq_k, scale, (mask_offset, window_left, window_right), mods=mods)
    run.run()
    pp = {c.w: {"turn": c.turns, "pass": c.passes, "absorbed": c.absorbed} for c in run.consumers}
    return run.o[0], run.lse[0], HopperReport(run.hazards, run.jb, run.je, run.n_groups, pp, [(q_block, -1)], run.visited)


def check_schedule(plan: "HopperPlan", n_blocks: int = 3, seed: int = 0, tiles: int = 1) -> list[str]:
    """Hazards of CTA 0 of a launch of ``tiles`` tiles of ``n_blocks`` key blocks each on one SM (random
    data, no mask): a persistent CTA walks every tile, one of a grid of one CTA per tile walks one."""
    if not isinstance(plan, HopperPlan):
        plan = make_hopper_plan(plan)
    cfg = plan.cfg
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((tiles * cfg.B_r, cfg.d_head))
    kv = rng.standard_normal((n_blocks * cfg.B_c, cfg.d_head))
    return simulate_tiles(plan, q, kv, kv, sms=1)[2].hazards
