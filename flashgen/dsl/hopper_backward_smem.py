"""Shared-memory placement of the wgmma backward (sm_90a): its tiles, statistics, staged dQ and mbarriers, and
how the two tiles the consumers write from registers (dS, dQ) take their accumulators.

Kept apart from :mod:`flashgen.dsl.hopper_backward_plan` so that :class:`~flashgen.dsl.backward_config.BackwardConfig`
can size a config (``smem_bytes``) without building its plan. ``cfg`` is a wgmma ``BackwardConfig``.
"""
from __future__ import annotations

from typing import Any

import attrs

from .atoms.copy import RF2SM, CopyAtom, RF2SM_stmatrix
from .atoms.hopper import kmajor_tile_layout
from .config import WGMMA_M
from .hopper_plan import SMEM_ALIGN, SWIZZLE, SmemTile

#: bytes of one query block's lse or D (fp32 per row), one bulk copy each
STAT = 4


@attrs.frozen
class DqStage:
    """How a consumer's dQ of a query block reaches the fp32 buffer, in fragment order: the ``vec`` 32-bit
    values from ``vec p`` of thread ``t`` at slot ``128 p + t`` (of ``4 vec`` bytes) of the consumer's region
    of the chunk for (batch, head, query block), so that each warp's access covers ``128 vec`` contiguous bytes.

    A consumer's dQ is one ``rows x cols`` wgmma tile (``rows`` = 64, its M) of the ``B_r x d_head`` block:
    split by columns (``by_rows`` false: a 64-row query block, consumer ``w`` makes every row of columns
    ``[w cols, (w + 1) cols)``) or by rows (``by_rows``: 64 query rows per consumer, consumer ``w`` makes
    rows ``[64 w, 64 w + 64)`` of every column), or transposed (``transposed``: an 80-row query block, the
    tile is dQ^T, 64 columns of d_head x 80 query rows, consumer ``w`` makes columns ``[64 w, 64 w + 64)`` of
    every row). Each way consumer ``w``'s region is the ``w``-th of the chunk.

    Unordered adds go straight from the accumulators with ``red.global.add.v4.f32`` (no shared memory,
    no barrier: on an H100 8-10% less backward time at d_head 64 and 0.5-2.5% at 128 than staging them; on an
    H200, staged with one thread's bulk reduction and the dS handoff's barrier freeing the region, 1-8% more time
    at d_head 128 and 1-4% at 64),
    ``vec`` 4: an 8-column group's two columns of two rows. Ordered adds (``staged``, the deterministic
    backward) stage the region in shared memory at ``offset`` in 8-byte slots (``vec`` 2: conflict-free
    stores; 16-byte ones spilled at d_head 128 with a window) and add it with one ``cp.reduce.async.bulk``, whose
    completion a consumer can wait for before passing its turn. The buffer is flashgen's own workspace;
    the dQ conversion finds element (row, col) of a query block with :meth:`index_cpp`, the inverse of
    the accumulator map.

    ``by_producer`` (unordered adds of the transposed tile, dQ^T at 80-row query blocks): the consumers
    store their region in the direct adds' slots (``vec`` 4, so the chunk's layout is the same) and the
    producer thread adds the regions with one bulk reduction each once the item's stages come back, an
    mbarrier (``dq_empty``) freeing them for the next item. On an H200 (bf16, seq 2048 / 8192, two A/Bs
    against the direct adds in swapped order) 2-4% less backward time at d_head 128 unmasked; under a
    causal mask (64-row blocks) 0-1% more, at d_head 64 0-1.5% more, so only the transposed tile takes it.
    Its slots for the items' chunk indices (:attr:`chunk_slots`, one per ring stage) follow the regions."""

    offset: int  # bytes from the aligned shared-memory base: consumer w's region at offset + w * region_bytes (staged)
    rows: int  # a consumer's dQ tile's rows (a wgmma's M): query rows, or columns of d_head where ``transposed``
    cols: int  # its columns (the wgmma's N): columns of d_head, or query rows where ``transposed``
    consumers: int
    staged: bool
    by_rows: bool = False  # consumers side by side down the query rows (else along the columns)
    #: the consumer's tile is dQ^T (``rows`` columns of d_head x ``cols`` query rows: dQ^T = K^T dS^T, for query blocks
    #: that are no multiple of a wgmma's M); consumer ``w`` makes columns ``[w rows, (w + 1) rows)`` of every query row
    transposed: bool = False
    #: the consumers store their regions and the producer adds them (unordered adds only)
    by_producer: bool = False

    def __attrs_post_init__(self) -> None:
        if self.staged and self.by_producer:
            raise ValueError("DqStage: ordered adds (staged) are the consumers' own; by_producer is for unordered ones")

    @property
    def vec(self) -> int:
        """Accumulator values in one slot: one 16-byte reduction or store (4) or 8-byte shared-memory store (2, ``staged``)."""
        return 2 if self.staged else 4

    @property
    def in_smem(self) -> bool:
        """The consumers' regions are in shared memory (ordered adds, or the producer's)."""
        return self.staged or self.by_producer

    @property
    def chunk_slots(self) -> int:
        """Offset of the producer's chunk indices (``by_producer``): one 32-bit slot per ring stage after the regions."""
        return self.offset + self.consumers * self.region_bytes

    @property
    def region_bytes(self) -> int:
        return 4 * self.rows * self.cols

    def row0(self, consumer: int) -> int:
        """The first query row (of the block) of consumer ``consumer``'s dQ."""
        return consumer * self.rows if self.by_rows else 0

    def col0(self, consumer: int) -> int:
        """The first column of consumer ``consumer``'s dQ."""
        if self.transposed:
            return consumer * self.rows
        return 0 if self.by_rows else consumer * self.cols

    def element(self, consumer: int, tile_row, tile_col):
        """(query row of the block, column of d_head) of element (``tile_row``, ``tile_col``) of consumer
        ``consumer``'s dQ tile (ints or numpy arrays)."""
        q, c = (tile_col, tile_row) if self.transposed else (tile_row, tile_col)
        return self.row0(consumer) + q, self.col0(consumer) + c

    def slot(self, thread: int, value: int) -> int:
        """The fp32 index, in a consumer's region, of accumulator value ``value`` of thread ``thread``."""
        return self.vec * (128 * (value // self.vec) + thread) + value % self.vec

    def slot_cpp(self, thread: str, value: str) -> str:
        """:meth:`slot` in C++ for a ``value`` divisible by :attr:`vec` (the first of those one access moves)."""
        return f"{self.vec}u * (128u * ({value} / {self.vec}u) + {thread})"

    def index_cpp(self) -> str:
        """``dq_chunk_index(r, c)``: the fp32 index of dQ element (row ``r`` of the query block, column ``c``)
        within the block's chunk (every consumer's region in order): the consumer whose tile holds it (:meth:`row0`,
        :meth:`col0`), then the accumulator map of a 64 x n wgmma inverted (tile row ``16 w + 8 h + g``: warp ``w``,
        half ``h``, lane group ``g``; tile column ``8 j + 2 q + e``: thread ``32 w + 4 g + q`` holds it as value
        ``4 j + 2 h + e``)."""
        if self.transposed:  # tile row: the column of d_head; tile column: the query row
            place, r = f"const uint32_t consumer = c / {self.rows}u, rr = c % {self.rows}u, cc = r;", "rr"
        elif self.by_rows:
            place, r = f"const uint32_t consumer = r / {self.rows}u, rr = r % {self.rows}u, cc = c;", "rr"
        else:
            place, r = f"const uint32_t consumer = c / {self.cols}u, cc = c % {self.cols}u;", "r"
        return f"""// the fp32 index of dQ element (r, c) of a query block in its chunk of the dQ buffer (DqStage's fragment order),
// slots of DQ_VEC floats
constexpr uint32_t DQ_VEC = {self.vec};
__host__ __device__ __forceinline__ uint32_t dq_chunk_index(uint32_t r, uint32_t c) {{
    {place}
    const uint32_t thread = 32u * ({r} / 16u) + 4u * ({r} % 8u) + (cc % 8u) / 2u;
    const uint32_t value = 4u * (cc / 8u) + 2u * (({r} % 16u) / 8u) + cc % 2u;
    return consumer * {self.rows * self.cols}u + {self.vec}u * (128u * (value / {self.vec}u) + thread) + value % {self.vec}u;
}}"""


@attrs.frozen
class DsStore:
    """How a consumer's dS^T accumulators (its 64 key rows x ``B_r`` query columns, S^T's accumulator map) reach
    the dS tile of the buffer.

    ``trans`` false: the tile is dS^T, ``[key][query]``; values ``i``, ``i + 1`` (``i`` even, adjacent columns)
    as one 32-bit store at ``layout(64 w + row(i), col(i))``.

    ``trans``: the tile is dS, ``[query][key]`` (dQ^T's K-major B); ``stmatrix.x4.trans``, instruction ``t`` of
    ``B_r / 16`` storing four 8x8 blocks of the warp's 16 x B_r slice: block ``m`` is key half ``m % 2`` and query
    chunk ``2 t + m / 2``, whose fragment pairs are values ``8 t + 2 m`` and ``8 t + 2 m + 1``; lane ``l`` gives the
    address of row ``l % 8`` of block ``l / 8``, i.e. query ``8 (2 t + (l / 8) / 2) + l % 8`` at keys from
    ``64 w + 16 warp + 8 ((l / 8) % 2)`` (8 contiguous 16-bit elements of a K-major row)."""

    trans: bool
    query_cols: int  # B_r

    @property
    def atom(self) -> CopyAtom:
        """The store instruction: ``stmatrix.x4.trans`` (``trans``), else a 32-bit ``st.shared.b32`` per pair."""
        return RF2SM_stmatrix(4, trans=True) if self.trans else RF2SM()

    @property
    def instructions(self) -> int:
        """stmatrix.x4 per thread (``trans``)."""
        return self.query_cols // 16

    def regs(self, t: int) -> tuple[tuple[int, int], ...]:
        """The accumulator values (lo, hi) each of instruction ``t``'s four 32-bit registers packs."""
        return tuple((8 * t + 2 * m, 8 * t + 2 * m + 1) for m in range(4))

    def lane_row(self, t: int, lane: int, warp: int, consumer: int) -> tuple[int, int]:
        """(query, first key) of the row lane ``lane`` addresses in instruction ``t``."""
        m = lane // 8
        return 8 * (2 * t + m // 2) + lane % 8, 64 * consumer + 16 * warp + 8 * (m % 2)

    def lane_row_cpp(self) -> tuple[str, str]:
        """:meth:`lane_row` in C++ of ``t``, ``lane``, ``wtid`` (warp ``wtid / 32``) and ``cw``."""
        return ("8u * (2u * t + lane / 16u) + lane % 8u", "64u * cw + 16u * (wtid / 32u) + 8u * ((lane / 8u) % 2u)")


def _kmajor(name: str, rows: int, cols: int, dtype, offset: int, stages: int) -> SmemTile:
    return SmemTile(name, rows, cols, kmajor_tile_layout(rows, cols, dtype, SWIZZLE), offset, stages, rows * cols * dtype.size)


def smem_plan(cfg: Any) -> tuple[dict, int]:
    """(name -> SmemTile or (offset, stages, stage bytes), total bytes with the alignment slack).

    Order: K, V (resident), Q and dO (``stages`` each), dS^T (2 buffers), lse and D (``stages`` each),
    the consumers' staged dQ (:class:`DqStage`; ordered adds, or the producer's), the mbarriers. Every 16-bit tile starts on the 1024-byte swizzle pattern."""
    d, B_r, B_c, st, dt = cfg.d_head, cfg.B_r, cfg.B_c, cfg.stages, cfg.dtype
    tiles, off = {}, 0
    transposed = B_r % WGMMA_M != 0  # dQ^T = K^T dS^T reads dS K-major: the tile is stored [query][key]
    ds = (B_r, B_c) if transposed else (B_c, B_r)
    for name, rows, cols, stages in (("K", B_c, d, 1), ("V", B_c, d, 1), ("Q", B_r, d, st), ("dO", B_r, d, st), ("dS", *ds, 2)):
        tiles[name] = _kmajor("s" + name, rows, cols, dt, off, stages)
        off += stages * tiles[name].stage_bytes
    for name in ("LSE", "D"):
        tiles[name] = (off, st, B_r * STAT)
        off += st * B_r * STAT
    by_rows = B_r > WGMMA_M and not transposed  # a query block of several wgmma M: a consumer's dQ is its share of the rows
    cols = B_r if transposed else d if by_rows else d // cfg.consumers
    tiles["dS_store"] = DsStore(transposed, B_r)
    by_producer = transposed and not cfg.deterministic
    dq = tiles["dQ"] = DqStage(off, WGMMA_M, cols, cfg.consumers, staged=cfg.deterministic, by_rows=by_rows, transposed=transposed,
                               by_producer=by_producer)
    off += cfg.consumers * dq.region_bytes if dq.in_smem else 0
    off += -(-4 * st // 16) * 16 if by_producer else 0  # the chunk slots, whole 16 bytes
    tiles["barriers"] = (off, 0, 8)
    off += 8 * (1 + 4 * st + by_producer)  # kv_full; q_full, do_full, q_empty, do_empty per stage; dq_empty
    return tiles, off + SMEM_ALIGN
