"""Cheap addresses: split a copy's offsets into a per-thread base and compile-time constants.

A swizzle is linear over GF(2) and a layout is linear over the integers, so for the
tiles the kernels use, ``offset(thread, i) == (offset(thread, 0) ^ X[i]) + A[i]``
where ``i`` enumerates the compile-time indices (the copy's value index and loops),
``X[i]`` only touches the swizzle's bits and ``A[i]`` lies above them. The kernel
then keeps one register per distinct ``X`` and folds ``A`` into the instruction's
immediate offset — the seed's "fewer integer instructions in address math" step,
derived instead of hand-written. Every split is verified here for every thread and
every index; a copy that does not split falls back to the full expression.
"""
from __future__ import annotations

import itertools

import attrs
import numpy as np

from .plan import TiledCopy
from .swizzle import ComposedLayout


@attrs.frozen
class OffsetSplit:
    """``offset(thread, idx) = (base(thread) ^ xor[idx]) + add[idx]``, and the coordinate deltas.

    ``index_names``/``extents`` describe the compile-time index space (value index
    ``v`` first, then the partition's loops); tables are flat, colexicographic... no:
    row-major over ``extents`` (last index fastest), matching C array nesting.
    """

    copy_name: str
    index_names: tuple[str, ...]
    extents: tuple[int, ...]
    xor: tuple[int, ...]
    add: tuple[int, ...]
    d_row: tuple[int, ...]  # row(thread, idx) - row(thread, 0)
    d_col: tuple[int, ...]

    @property
    def distinct_xor(self) -> int:
        return len(set(self.xor))


def _offset_table(layout) -> np.ndarray:
    """``table[col, row] = layout((row, col))`` for every coordinate of a rank-2 tile (Numba evaluation)."""
    from ..sim.layout_eval import offsets

    rows = layout.shape[0] if isinstance(layout.shape[0], int) else int(np.prod(layout.shape[0]))
    flat = offsets(layout)  # 1-D colexicographic: index = row + rows * col
    return flat.reshape(-1, rows)


def _tv_table(lay) -> np.ndarray:
    """``table[value, thread]`` of a TVMap component Layout over (thread, value)."""
    from ..sim.layout_eval import offsets

    return offsets(lay).reshape(lay[1].size, lay[0].size)


def thread_domain(copy: TiledCopy, n_warps: int) -> list[tuple[int, int]]:
    """The runtime (thread, warp) pairs a copy runs on."""
    n = copy.partition.tv.n_threads
    warps = range(n_warps) if copy.partition.warp_row_step else range(1)
    return [(t, w) for w in warps for t in range(n)]


def index_space(copy: TiledCopy) -> tuple[tuple[str, ...], tuple[int, ...]]:
    part = copy.partition
    names = ("v",) + tuple(l.name for l in part.loops)
    extents = (part.tv.n_values,) + tuple(l.extent for l in part.loops)
    return names, extents


def split_offsets(copy: TiledCopy, n_warps: int) -> OffsetSplit | None:
    """The verified base/xor/add split of ``copy``'s shared-memory offsets, or None.

    Evaluates the plan's objects over every (thread, warp) and every compile-time index at
    once: the TVMap's Layouts and the tile's (swizzled) layout through the Numba evaluator.
    """
    part = copy.partition
    layout = copy.smem.layout
    names, extents = index_space(copy)
    swz = layout.swizzle if isinstance(layout, ComposedLayout) else None
    high = 0
    if swz is not None and not swz.is_identity:
        high = max(swz.yyy_mask, swz.zzz_mask).bit_length()
    low_mask = (1 << high) - 1
    threads = np.array(thread_domain(copy, n_warps))  # (n, 2): thread, warp
    t, w = threads[:, 0], threads[:, 1]
    rows_tv, cols_tv = _tv_table(part.tv.row), _tv_table(part.tv.col)
    table = _offset_table(layout)
    points = list(itertools.product(*(range(e) for e in extents)))
    xs, adds, drs, dcs = [], [], [], []
    base = r0 = c0 = None
    for p in points:
        r = rows_tv[p[0], t] + w * part.warp_row_step
        c = cols_tv[p[0], t].copy()
        for loop, i in zip(part.loops, p[1:]):
            r = r + i * loop.row_step
            c = c + i * loop.col_step
        if base is None:
            r0, c0 = r, c
            base = table[c0, r0]
        dr, dc = r - r0, c - c0
        if np.any(dr != dr[0]) or np.any(dc != dc[0]):
            return None
        off = table[c, r]
        x = int((off[0] ^ base[0]) & low_mask)
        a = int((off[0] & ~low_mask) - (base[0] & ~low_mask))
        if not np.array_equal((base ^ x) + a, off):
            return None
        xs.append(x)
        adds.append(a)
        drs.append(int(dr[0]))
        dcs.append(int(dc[0]))
    return OffsetSplit(copy.name, names, extents, tuple(xs), tuple(adds), tuple(drs), tuple(dcs))
