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


def _smem_offsets(layout, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """Vectorised ``layout((row, col))`` for the plan's smem layouts (exact, via the objects)."""
    flat = np.array([layout((int(r), int(c))) for r, c in zip(rows.ravel(), cols.ravel())], dtype=np.int64)
    return flat.reshape(rows.shape)


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
    """The verified base/xor/add split of ``copy``'s shared-memory offsets, or None."""
    part = copy.partition
    layout = copy.smem.layout
    names, extents = index_space(copy)
    swz = layout.swizzle if isinstance(layout, ComposedLayout) else None
    high = 0
    if swz is not None and not swz.is_identity:
        high = max(swz.yyy_mask, swz.zzz_mask).bit_length()
    low_mask = (1 << high) - 1
    threads = thread_domain(copy, n_warps)
    points = list(itertools.product(*(range(e) for e in extents)))

    def coords(idx):
        kw = dict(zip(names[1:], idx[1:]))
        rc = [part.coord(t, idx[0], w, **kw) for t, w in threads]
        return np.array([r for r, _ in rc]), np.array([c for _, c in rc])

    r0, c0 = coords(points[0])
    base = _smem_offsets(layout, r0, c0)
    xs, adds, drs, dcs = [], [], [], []
    for p in points:
        r, c = coords(p)
        dr, dc = r - r0, c - c0
        if np.any(dr != dr[0]) or np.any(dc != dc[0]):
            return None
        off = _smem_offsets(layout, r, c)
        x = int((off[0] ^ base[0]) & low_mask)
        a = int((off[0] & ~low_mask) - (base[0] & ~low_mask))
        if not np.array_equal((base ^ x) + a, off):
            return None
        xs.append(x)
        adds.append(a)
        drs.append(int(dr[0]))
        dcs.append(int(dc[0]))
    return OffsetSplit(copy.name, names, extents, tuple(xs), tuple(adds), tuple(drs), tuple(dcs))
