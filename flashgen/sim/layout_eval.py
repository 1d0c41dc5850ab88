"""Numba evaluation of layouts and swizzles over every coordinate.

``offsets(L)[i] == L(i)`` for every 1-D coordinate ``i < L.size``: the layout is
flattened to int64 (shape, stride) arrays and a jitted kernel does the
colexicographic decomposition; the swizzle masks come from the ``Swizzle`` object.
"""

from __future__ import annotations

import numba
import numpy as np

from flashgen.dsl.layout import Layout
from flashgen.dsl.swizzle import ComposedLayout, Swizzle


@numba.njit(cache=False)
def _eval_flat(shapes: np.ndarray, strides: np.ndarray, size: int) -> np.ndarray:
    """out[i] = sum_k coord_k(i) * strides[k], coord = colex decomposition of i."""
    out = np.empty(size, np.int64)
    n = shapes.shape[0]
    for i in range(size):
        c = i
        off = 0
        for k in range(n - 1):
            off += (c % shapes[k]) * strides[k]
            c //= shapes[k]
        out[i] = off + c * strides[n - 1]
    return out


@numba.njit(cache=False)
def _swizzle_kernel(arr: np.ndarray, yyy_mask: int, shift: int) -> np.ndarray:
    """out = arr ^ shiftr(arr & yyy_mask, shift) (shift < 0 shifts left)."""
    out = np.empty(arr.shape[0], np.int64)
    for i in range(arr.shape[0]):
        x = arr[i]
        y = x & yyy_mask
        out[i] = x ^ ((y >> shift) if shift >= 0 else (y << -shift))
    return out


def flat_arrays(layout: Layout) -> tuple[np.ndarray, np.ndarray]:
    """The layout's (shape, stride) leaves as int64 arrays."""
    modes = layout.flat_modes()
    shapes = np.array([s for s, _ in modes], dtype=np.int64)
    strides = np.array([d for _, d in modes], dtype=np.int64)
    return shapes, strides


def swizzle_array(swz: Swizzle, arr: np.ndarray) -> np.ndarray:
    """``swz`` applied to every element of a 1-D array of non-negative offsets (int64 copy)."""
    a = np.ascontiguousarray(arr, dtype=np.int64).reshape(-1)
    if a.size and a.min() < 0:
        raise ValueError(f"{swz}: offsets must be >= 0")
    if swz.is_identity:
        return a.copy()
    return _swizzle_kernel(a, np.int64(swz.yyy_mask), np.int64(swz.S))


def offsets(layout: Layout | ComposedLayout) -> np.ndarray:
    """int64 array of length ``size`` with ``out[i] == layout(i)``."""
    if isinstance(layout, ComposedLayout):
        return swizzle_array(layout.swizzle, offsets(layout.layout))
    if not isinstance(layout, Layout):
        raise ValueError(f"offsets: expected a Layout or ComposedLayout; got {layout!r}")
    shapes, strides = flat_arrays(layout)
    return _eval_flat(shapes, strides, layout.size)
