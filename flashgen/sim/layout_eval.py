"""Layouts and swizzles evaluated over every coordinate, for the simulator.

``offsets(L)[i] == L(i)`` for every 1-D coordinate ``i < L.size``. The evaluation is the
objects' own (:meth:`Layout.offsets`, :meth:`Swizzle.apply`: the functions ``__call__``
runs, applied to numpy arrays), so the simulator, the emitter's derived tables and a single
``L(i)`` share one definition; this module hands out writable copies and checks arguments.
"""

from __future__ import annotations

import numpy as np

from flashgen.dsl.layout import Layout
from flashgen.dsl.swizzle import ComposedLayout, Swizzle


def swizzle_array(swz: Swizzle, arr: np.ndarray) -> np.ndarray:
    """``swz`` applied to every element of an array of non-negative offsets (a 1-D int64 copy)."""
    return swz.apply(np.ascontiguousarray(arr, dtype=np.int64).reshape(-1))


def offsets(layout: Layout | ComposedLayout) -> np.ndarray:
    """int64 array of length ``size`` with ``out[i] == layout(i)``."""
    if not isinstance(layout, (Layout, ComposedLayout)):
        raise ValueError(f"offsets: expected a Layout or ComposedLayout; got {layout!r}")
    return layout.offsets().copy()


def tile_table(tile) -> np.ndarray:
    """``[row, col]`` -> element offset of a shared tile's layout (from its stage base): ``offsets`` of its
    ``rows x cols`` layout, whose 1-D coordinate runs down the rows first."""
    return offsets(tile.layout).reshape(tile.cols, tile.rows).T
