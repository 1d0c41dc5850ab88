"""Thread-value maps and partitions: which thread touches which element of a tile.

A :class:`TVMap` is a pair of Layouts (row, col) over the coordinate
``(thread, value)``. A :class:`Partition` places a TVMap inside a larger tile:
the thread's base coordinate comes from the TVMap, each named loop index adds a
constant (row, col) step. Both the emitter (rendering C++ index functions) and
the simulator (evaluating every coordinate) consume exactly these objects.
"""
from __future__ import annotations

from typing import Sequence

import attrs

from .layout import Layout


@attrs.frozen
class TVMap:
    """``(thread, value) -> (row, col)`` as two Layouts over the same 2-mode coordinate."""

    name: str
    n_threads: int
    n_values: int
    row: Layout
    col: Layout

    def __attrs_post_init__(self) -> None:
        for which, lay in (("row", self.row), ("col", self.col)):
            if lay.rank != 2 or lay[0].size != self.n_threads or lay[1].size != self.n_values:
                raise ValueError(
                    f"TVMap {self.name}: {which} layout {lay} must have modes (threads={self.n_threads}, values={self.n_values})"
                )

    def __call__(self, thread: int, value: int) -> tuple[int, int]:
        return self.row((thread, value)), self.col((thread, value))

    def tables(self):
        """``(rows, cols)``, each a read-only ``[thread, value]`` int64 array: the map at every coordinate.

        The layouts' offsets in bulk (1-D coordinate ``thread + n_threads * value``).
        """
        shape = (self.n_values, self.n_threads)
        return self.row.offsets().reshape(shape).T, self.col.offsets().reshape(shape).T

    def to_cpp(self, thread: str, value: str) -> tuple[str, str]:
        return self.row.to_cpp([thread, value]), self.col.to_cpp([thread, value])

    def __str__(self) -> str:
        return f"{self.name}: row {self.row}, col {self.col}"


@attrs.frozen
class Loop:
    """A loop index ``name`` in ``range(extent)`` that moves the coordinate by (row_step, col_step)."""

    name: str
    extent: int
    row_step: int
    col_step: int


@attrs.frozen
class Partition:
    """Coordinates one thread touches in a tile: ``tv(thread, value) + sum(i * step)`` over loops.

    ``thread`` is the thread index the TVMap is written for (lane for warp-level
    copies, threadIdx for CTA-wide copies). Warp-owned tiles sit on a grid of warps
    ``warp_cols`` wide (warp ``w`` at grid row ``w // warp_cols``, column ``w % warp_cols``),
    offset by ``warp_row_step`` rows per grid row and ``warp_col_step`` columns per grid
    column; ``warp_cols == 1`` is the one-dimensional split (warp ``w`` adds ``w * warp_row_step`` rows).
    ``place_row_step`` adds rows per grid column instead: a tile the warps of a grid row split by rows
    (the backward's S^T B operand with ``split_scores``: warp ``h`` of a group reads query rows from
    ``h * place_row_step``).
    """

    tv: TVMap
    loops: tuple[Loop, ...] = ()
    warp_row_step: int = 0
    warp_col_step: int = 0
    warp_cols: int = 1
    place_row_step: int = 0

    def __attrs_post_init__(self) -> None:
        if self.warp_cols < 1:
            raise ValueError(f"Partition {self.tv.name}: warp_cols={self.warp_cols} must be at least 1")

    @property
    def uses_warp(self) -> bool:
        """Whether the coordinates depend on the warp index (a warp-owned tile)."""
        return bool(self.warp_row_step or self.warp_col_step or self.place_row_step)

    def warp_offset(self, warp):
        """``(row, col)`` offset of warp ``warp``'s tile (ints or int arrays)."""
        row = (warp // self.warp_cols) * self.warp_row_step + (warp % self.warp_cols) * self.place_row_step
        return row, (warp % self.warp_cols) * self.warp_col_step

    def warp_offset_cpp(self, warp: str = "warp") -> tuple[str, str]:
        """C++ expressions of :meth:`warp_offset` ("0" where there is none)."""
        grid_row = warp if self.warp_cols == 1 else f"({warp} / {self.warp_cols}u)"
        row = f"{grid_row} * {self.warp_row_step}u" if self.warp_row_step else "0"
        if self.place_row_step:
            place = f"({warp} % {self.warp_cols}u) * {self.place_row_step}u"
            row = place if row == "0" else f"{row} + {place}"
        col = f"({warp} % {self.warp_cols}u) * {self.warp_col_step}u" if self.warp_col_step else "0"
        return row, col

    def warp_text(self) -> str:
        """What warp ``w`` adds, for comments: ``16 rows`` or ``((w / 2u) * 16u, (w % 2u) * 64u)``."""
        if self.warp_cols == 1 and not self.warp_col_step and not self.place_row_step:
            return f"{self.warp_row_step} rows"
        return "({}, {})".format(*self.warp_offset_cpp("w"))

    def coord(self, thread: int, value: int, warp: int = 0, **idx: int) -> tuple[int, int]:
        r, c = self.tv(thread, value)
        dr, dc = self.warp_offset(warp)
        r, c = r + dr, c + dc
        for loop in self.loops:
            i = idx.get(loop.name, 0)
            r += i * loop.row_step
            c += i * loop.col_step
        return r, c

    def coords(self, threads, warps):
        """:meth:`coord` at every value and loop index of each (thread, warp) pair, in bulk.

        ``threads``, ``warps``: int arrays of one length ``n``. Returns ``(rows, cols)`` of shape
        ``(n, n_values, *loop extents)``: the value index first, then the loops, as the emitted
        C arrays nest them.
        """
        import numpy as np

        t = np.asarray(threads, dtype=np.int64)
        extra = (1,) * len(self.loops)
        tv_rows, tv_cols = self.tv.tables()
        rows = tv_rows[t].reshape(t.shape + (self.tv.n_values,) + extra)
        cols = tv_cols[t].reshape(t.shape + (self.tv.n_values,) + extra)
        dr, dc = self.warp_offset(np.asarray(warps, dtype=np.int64))
        rows = rows + dr.reshape(t.shape + (1,) + extra)
        cols = cols + dc.reshape(t.shape + (1,) + extra)
        for k, loop in enumerate(self.loops):
            i = np.arange(loop.extent).reshape((1, 1) + tuple(-1 if j == k else 1 for j in range(len(self.loops))))
            rows = rows + i * loop.row_step
            cols = cols + i * loop.col_step
        return rows, cols

    def coord_cpp(self, thread: str, value: str, warp: str = "warp", extra: Sequence[str] = ()) -> tuple[str, str]:
        """C++ expressions for (row, col); loop indices are the loops' own names."""
        r, c = self.tv.to_cpp(thread, value)
        rows, cols = [r], [c]
        dr, dc = self.warp_offset_cpp(warp)
        rows += [dr] if self.warp_row_step or self.place_row_step else []
        cols += [dc] if self.warp_col_step else []
        for loop in self.loops:
            if loop.row_step:
                rows.append(f"{loop.name} * {loop.row_step}u")
            if loop.col_step:
                cols.append(f"{loop.name} * {loop.col_step}u")
        rows.extend(extra)
        return " + ".join(_wrap(x) for x in rows), " + ".join(_wrap(x) for x in cols)


def _wrap(expr: str) -> str:
    return expr if expr.replace("_", "").isalnum() or expr.startswith("(") and expr.endswith(")") else f"({expr})"


def vector_copy_tv(name: str, rows: int, cols: int, threads: int, vec: int = 8) -> TVMap:
    """A CTA-wide copy of a row-major ``rows x cols`` tile in ``vec``-element (16-byte) chunks.

    Consecutive threads take consecutive chunks of a row (coalesced global access,
    one 128-byte line per 8 threads); value index v walks the next ``threads`` chunks.
    """
    cpr = cols // vec  # chunks per row
    total = rows * cpr
    if cols % vec or total % threads:
        raise ValueError(f"{name}: a {rows}x{cols} tile does not split into {threads} threads x 16-byte chunks")
    values = total // threads
    if threads >= cpr:
        # thread = (chunk in row, row) ; value = next block of threads/cpr rows
        row = Layout(((cpr, threads // cpr), values), ((0, 1), threads // cpr))
        col = Layout(((cpr, threads // cpr), values), ((vec, 0), 0))
    else:
        # a row takes several values per thread: value = (chunk group, row)
        per_row = cpr // threads
        row = Layout((threads, (per_row, rows)), (0, (0, 1)))
        col = Layout((threads, (per_row, rows)), (vec, (threads * vec, 0)))
    return TVMap(name, threads, values, row, col)
