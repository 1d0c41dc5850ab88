"""Where the wgmma backward's shared-memory tiles put their elements, for the simulator and the proofs: a tile's
``[row, col]`` -> element table, and the element each dS^T accumulator value of a consumer is stored at.

The dS store is evaluated from the plan's :class:`~flashgen.dsl.hopper_backward_smem.DsStore` (which lanes address
which rows, which values each register packs) through the instruction's ISA semantics
(:func:`~flashgen.sim.hardware.stmatrix_offsets`), so a wrong lane or register rule lands elsewhere.
"""
from __future__ import annotations

import numpy as np

from flashgen.dsl.config import WARPGROUP as WG
from flashgen.dsl.hopper_backward_plan import HopperBackwardPlan
from flashgen.sim import hardware as hw
from flashgen.sim.hopper import c_table
from flashgen.sim.layout_eval import tile_table

__all__ = ["OUTSIDE", "ds_store_targets", "tile_table"]


#: ds_store_targets' offset of a value whose row or column lies past the tile
OUTSIDE = -(1 << 40)


def ds_store_targets(plan: HopperBackwardPlan, w: int) -> np.ndarray:
    """``[thread, value]`` -> element offset (from the buffer's base) where consumer ``w``'s dS^T store puts
    accumulator value ``value`` of thread ``thread`` (the plan's :class:`~flashgen.dsl.hopper_backward_smem.DsStore`);
    negative where the store addresses a row or column past the tile."""
    tile, cs, st = plan.tiles["dS"], c_table(plan.gemms["S"].atom), plan.ds_store
    table = tile_table(tile)

    def at(r, c):
        inside = (r < tile.rows) & (c < tile.cols)
        return np.where(inside, table[np.minimum(r, tile.rows - 1), np.minimum(c, tile.cols - 1)], OUTSIDE)

    if not st.trans:  # one 32-bit store per even value at its (key, query), the odd value in the next element
        ev = np.arange(0, cs.rows.shape[1], 2)
        out = np.zeros(cs.rows.shape, np.int64)
        out[:, ev] = at(64 * w + cs.rows[:, ev], cs.cols[:, ev])
        out[:, ev + 1] = out[:, ev] + 1
        return out
    out = np.full(cs.rows.shape, OUTSIDE, np.int64)
    for warp in range(WG // 32):
        for t in range(st.instructions):
            query, key = np.array([st.lane_row(t, lane, warp, w) for lane in range(32)]).T
            put = hw.stmatrix_offsets(at(query, key), st.atom.num, trans=st.atom.trans)
            for m, (lo, hi) in enumerate(st.regs(t)):
                out[32 * warp:32 * warp + 32, lo] = put[:, m, 0]
                out[32 * warp:32 * warp + 32, hi] = put[:, m, 1]
    return out
