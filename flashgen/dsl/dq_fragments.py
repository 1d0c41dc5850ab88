"""The mma.sync backward's fp32 dQ buffer in fragment order: where each warp's dQ adds land.

The buffer holds, per (batch, query head), one chunk of ``rows x cols`` floats per query block (``rows`` = B_r,
``cols`` = the columns dQ's warps make, d_head's and any padding), in the order the warps hold the values: warp
``w``'s 16 x 8 accumulator tile ``(mi, nt)`` is tile ``t = (w * m_tiles + mi) * n_tiles + nt`` of the chunk, and its
four values of lane ``l`` are the 16 bytes at float ``4 (32 t + l)`` (:meth:`DqFragments.slot`). So one warp's
``red.global.add.v4.f32`` of a tile covers 512 contiguous bytes: four 128-byte lines, where a row-major buffer spread
an 8-byte reduction of each lane over eight rows, eight lines, each one request to L2.

The dQ conversion reads the chunk in *units* of four slots (64 contiguous bytes): lanes ``4g .. 4g + 3`` of a tile,
which hold eight adjacent columns of two rows, ``r`` and ``r + 8`` (values 0, 1 and 2, 3 of the m16n8 C fragment):
unit ``u`` is tile ``u // 8``, lane group ``u % 8`` (:meth:`DqFragments.place`). The constructor checks that the
dQ reduction's partition has that shape and covers the chunk's every element once.
"""
from __future__ import annotations

import attrs
import numpy as np

from .plan import TiledCopy

#: lanes of a lane group (one unit), and the m16n8 C fragment's values per lane
_GROUP, _VALUES = 4, 4


@attrs.frozen
class DqFragments:
    """The fragment order of the dQ adds of ``red`` (the plan's ``red_dQ``): ``warps`` warps, each ``m_tiles x
    n_tiles`` accumulator tiles, over a chunk of ``rows x cols`` floats per query block."""

    red: TiledCopy
    warps: int
    rows: int
    cols: int

    def __attrs_post_init__(self) -> None:
        r, c = self.coords()
        if r.shape[1:3] != (32, _VALUES):
            raise ValueError(f"{self.red.name}: {r.shape[2]} values a lane; the fragment order takes the m16n8 C fragment's 4")
        r0, c0 = r[:, :, :1], c[:, :, :1]  # each lane's value 0
        lane_c = 2 * (np.arange(32) % _GROUP)[None, :, None, None, None]
        same_group = (r0 == np.repeat(r0[:, ::_GROUP], _GROUP, axis=1)) & (c0 == np.repeat(c0[:, ::_GROUP], _GROUP, axis=1) + lane_c)
        step_r, step_c = (np.array(x)[None, None, :, None, None] for x in ([0, 0, 8, 8], [0, 1, 0, 1]))
        values = (r == r0 + step_r) & (c == c0 + step_c)
        if not (same_group.all() and values.all()):
            raise ValueError(f"{self.red.name}: a lane group's values are not eight adjacent columns of rows r and r + 8")
        if self.chunk_floats != self.warps * self.m_tiles * self.n_tiles * 32 * _VALUES:
            raise ValueError(f"{self.red.name}: {self.warps} warps' tiles do not fill a {self.rows} x {self.cols} chunk")
        flat = (r * self.cols + c).ravel()
        if r.max() >= self.rows or c.max() >= self.cols or np.unique(flat).size != flat.size:
            raise ValueError(f"{self.red.name}: the warps' dQ tiles do not cover the {self.rows} x {self.cols} chunk once")

    @property
    def m_tiles(self) -> int:
        return self.red.partition.loops[0].extent

    @property
    def n_tiles(self) -> int:
        return self.red.partition.loops[1].extent

    @property
    def chunk_floats(self) -> int:
        return self.rows * self.cols

    @property
    def units(self) -> int:
        """Units (four slots: eight columns of two rows) of a chunk."""
        return self.chunk_floats // (_GROUP * _VALUES)

    def coords(self) -> tuple[np.ndarray, np.ndarray]:
        """(row, column) of every value in the block: arrays ``[warp, lane, value, mi, nt]``."""
        lanes = np.tile(np.arange(32), self.warps)
        warps = np.repeat(np.arange(self.warps), 32)
        r, c = self.red.partition.coords(lanes, warps)
        shape = (self.warps, 32) + r.shape[1:]
        return r.reshape(shape), c.reshape(shape)

    def slot(self, warp, lane, mi, nt):
        """The chunk's float index of value 0 of lane ``lane``'s tile ``(mi, nt)`` of warp ``warp`` (values 1-3 follow)."""
        return _VALUES * (32 * ((warp * self.m_tiles + mi) * self.n_tiles + nt) + lane)

    def place(self, unit):
        """(row, first column) of unit ``unit``'s upper row: its eight columns from there, and the same of row + 8."""
        tile, group = np.divmod(unit, 32 // _GROUP)
        rest, nt = np.divmod(tile, self.n_tiles)
        warp, mi = np.divmod(rest, self.m_tiles)
        r, c = self.coords()
        return r[warp, _GROUP * group, 0, mi, nt], c[warp, _GROUP * group, 0, mi, nt]

    def element(self, index):
        """(row, column) of the block that the conversion reads from float ``index`` of a chunk: in its unit's four
        slots, slot ``q`` holds columns ``2q``, ``2q + 1`` of the upper row, then the same of the lower one."""
        unit, within = np.divmod(index, _GROUP * _VALUES)
        q, v = np.divmod(within, _VALUES)
        r, c = self.place(unit)
        return r + 8 * (v // 2), c + 2 * q + v % 2

    def to_cpp(self) -> str:
        """``dq_slot(lane, warp, mi, nt)`` (the kernel's adds) and ``dq_unit_row(u)`` / ``dq_unit_col(u)`` (the
        conversion's reads), after the reduction's ``<red>_row`` / ``_col`` index functions."""
        name, m, n = self.red.name, self.m_tiles, self.n_tiles
        uses_warp = self.red.partition.uses_warp
        warp = ", warp" if uses_warp else ""
        unit = (f"const uint32_t tile = u / {32 // _GROUP}u, lane = {_GROUP}u * (u % {32 // _GROUP}u), nt = tile % {n}u, "
                f"mi = tile / {n}u % {m}u, warp = tile / {n * m}u;" + ("" if uses_warp else "\n    (void)warp;"))
        return f"""// the dQ buffer's fragment order (DqFragments): chunks of {self.rows} x {self.cols} floats per query block
constexpr uint32_t DQ_CHUNK = {self.chunk_floats}, DQ_UNITS = {self.units};
// the chunk's float index of value 0 of lane `lane`'s accumulator tile (mi, nt) of warp `warp` (values 1-3 follow)
__host__ __device__ __forceinline__ uint32_t dq_slot(uint32_t lane, uint32_t warp, uint32_t mi, uint32_t nt) {{
    return {_VALUES}u * (32u * ((warp * {m}u + mi) * {n}u + nt) + lane);
}}
// unit u of a chunk (floats [16 u, 16 u + 16)): eight columns from dq_unit_col(u) of rows dq_unit_row(u) and that + 8
__host__ __device__ __forceinline__ uint32_t dq_unit_row(uint32_t u) {{
    {unit}
    return {name}_row(lane, 0u{warp}, mi, nt);
}}
__host__ __device__ __forceinline__ uint32_t dq_unit_col(uint32_t u) {{
    {unit}
    return {name}_col(lane, 0u{warp}, mi, nt);
}}
// a head's rows of D_HEAD floats in the buffer: its query blocks' chunks, rounded up to whole rows
__host__ __device__ __forceinline__ int64_t dq_head_rows(int seq_q) {{
    return ((int64_t(seq_q) + B_r - 1) / B_r * DQ_CHUNK + D_HEAD - 1) / D_HEAD;
}}"""
