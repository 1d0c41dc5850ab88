"""XOR swizzles (CuTe ``Swizzle<B,M,S>``) and swizzled layouts.

This is the one place the swizzle's bit function is defined; C++ text and the
simulator take the masks from these objects.

Bit diagram of ``Swizzle(B, M, S)`` for S > 0 (``Sw<3,3,3>`` shown, 16-bit elements)::

    offset bits:  ... | 8 7 6 | 5 4 3 | 2 1 0
                        yyy     zzz     (M low bits kept)
    result = offset ^ ((offset & yyy_mask) >> S)     -> zzz ^= yyy

With 2-byte elements and 64-element (128-byte) rows, ``zzz`` is the 16-byte chunk
within the row and ``yyy`` is the row modulo 8, so row ``r`` permutes its chunks by
``c -> c ^ (r % 8)``. For S < 0 the roles swap: the low field (at bit M) is shifted
left by ``|S|`` into the high field.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import attrs

from flashgen.dsl.layout import CppCoord, Layout, cpp_parenthesize, format_table, is_int, table_at


def _int_field(x: object) -> int:
    if not is_int(x):
        raise ValueError(f"Swizzle parameters must be ints; got {x!r}")
    return int(x)  # type: ignore[call-overload]


@attrs.frozen
class Swizzle:
    """CuTe ``Swizzle<B,M,S>``: ``x -> x ^ shiftr(x & yyy_mask, S)``.

    ``bit_mask = 2**B - 1``, ``yyy_mask = bit_mask << (M + max(0, S))``,
    ``zzz_mask = bit_mask << (M - min(0, S))``; ``shiftr`` by a negative amount
    shifts left. Requires ``B >= 0``, ``M >= 0`` and ``|S| >= B`` (the two fields do
    not overlap, as CuTe asserts), so the map is an involution and a bijection on
    every aligned block of ``2**(M + |S| + B)`` offsets. ``B == 0`` is the identity.
    """

    B: int = attrs.field(converter=_int_field)
    M: int = attrs.field(converter=_int_field)
    S: int = attrs.field(converter=_int_field)

    def __attrs_post_init__(self) -> None:
        if self.B < 0 or self.M < 0:
            raise ValueError(f"Swizzle needs B >= 0 and M >= 0; got {self}")
        if abs(self.S) < self.B:
            raise ValueError(
                f"Swizzle needs |S| >= B (the XOR source and target bits must not "
                f"overlap); got {self}"
            )

    @property
    def bit_mask(self) -> int:
        return (1 << self.B) - 1

    @property
    def yyy_mask(self) -> int:
        """Source bits: those XORed (after shifting by S) into the ``zzz`` bits."""
        return self.bit_mask << (self.M + max(0, self.S))

    @property
    def zzz_mask(self) -> int:
        """Target bits: those changed by the swizzle."""
        return self.bit_mask << (self.M - min(0, self.S))

    @property
    def period(self) -> int:
        """``2**(M + |S| + B)``: the swizzle maps each aligned block of this size to itself."""
        return 1 << (self.M + abs(self.S) + self.B)

    @property
    def is_identity(self) -> bool:
        return self.B == 0

    def __call__(self, offset: int) -> int:
        """Swizzled offset of a non-negative int ``offset``."""
        if not is_int(offset) or offset < 0:
            raise ValueError(f"{self}: offset must be an int >= 0; got {offset!r}")
        return self._bits(int(offset))

    def apply(self, offsets):
        """The swizzle of every element of a numpy int array of non-negative offsets (an int64 array)."""
        import numpy as np  # on first use, as Layout.offsets

        x = np.asarray(offsets, dtype=np.int64)
        if x.size and x.min() < 0:
            raise ValueError(f"{self}: offsets must be >= 0")
        return self._bits(x)

    def _bits(self, x):
        """The bit function on an int or an int64 array (the same operators on both)."""
        y = x & self.yyy_mask
        return x ^ (y >> self.S if self.S >= 0 else y << -self.S)

    def to_cpp(self, expr: str) -> str:
        """C++ text of the swizzled ``expr`` (``expr`` unchanged for the identity).

        ``Sw<3,3,3>`` of ``x`` renders ``(x ^ ((x & 0x1c0) >> 3))``; a compound
        ``expr`` is parenthesized and appears twice in the text.
        """
        if self.is_identity:
            return expr
        x = cpp_parenthesize(expr)
        op = f">> {self.S}" if self.S >= 0 else f"<< {-self.S}"
        return f"({x} ^ (({x} & {self.yyy_mask:#x}) {op}))"

    def __str__(self) -> str:
        return f"Sw<{self.B},{self.M},{self.S}>"


@attrs.frozen
class ComposedLayout:
    """``swizzle o layout``: offset = ``swizzle(layout(coord))`` (CuTe's ComposedLayout).

    Coordinates are those of ``layout``; ``size``, ``shape`` and ``rank`` are the
    layout's.
    """

    swizzle: Swizzle = attrs.field(validator=attrs.validators.instance_of(Swizzle))
    layout: Layout = attrs.field(validator=attrs.validators.instance_of(Layout))

    @property
    def size(self) -> int:
        return self.layout.size

    @property
    def shape(self) -> Any:
        return self.layout.shape

    @property
    def rank(self) -> int:
        return self.layout.rank

    @property
    def cosize(self) -> int:
        """Largest swizzled offset + 1, exact (from the table of every coordinate)."""
        if self.swizzle.is_identity:
            return self.layout.cosize
        return int(self.offsets().max()) + 1

    def __call__(self, coord: object) -> int:
        """Swizzled offset; ``coord`` as accepted by ``Layout.__call__``."""
        return self.swizzle(self.layout(coord))

    def offsets(self):
        """``out[i] == self(i)`` for every 1-D coordinate ``i < size`` (read-only int64 array, memoized)."""
        return _swizzled_offsets(self)

    def offsets_at(self, *coords):
        """Swizzled offsets of in-range per-mode coordinate arrays (see ``Layout.offsets_at``)."""
        return table_at(self.layout, self.offsets(), coords)

    def to_cpp(self, coord_exprs: CppCoord) -> str:
        """The swizzle applied to ``layout.to_cpp(coord_exprs)``."""
        return self.swizzle.to_cpp(self.layout.to_cpp(coord_exprs))

    def __str__(self) -> str:
        return f"{self.swizzle} o {self.layout}"

    def table(self) -> str:
        """Grid of swizzled offsets of a rank-2 layout: rows = mode 0, columns = mode 1."""
        if self.layout.rank != 2:
            raise ValueError(f"table() needs a rank-2 layout; {self} has rank {self.rank}")
        cell: Callable[[int, int], int] = lambda r, c: self((r, c))
        return format_table(str(self), self.layout[0].size, self.layout[1].size, cell)


@functools.lru_cache(maxsize=1024)
def _swizzled_offsets(layout: ComposedLayout):
    out = layout.swizzle.apply(layout.layout.offsets())
    out.setflags(write=False)
    return out
