"""The warp-level MMA atom m16n8k16 (f16/bf16 in, f32 accumulate) and its fragment maps.

PTX ISA, section "Matrix Fragments for mma.m16n8k16 with floating point type"
(9.7.14.5.8). For a lane, ``group = lane / 4`` and ``quad = lane % 4``:

  A (16x16, row-major, 4 regs x 2 halves):  row = group + 8*(reg % 2),  col = 2*quad + half + 8*(reg / 2)
  B (16x8, "col", 2 regs x 2 halves):       k   = 2*quad + half + 8*reg,  n = group
  C/D (16x8, f32, 4 regs):                  row = group + 8*(reg / 2),  col = 2*quad + reg % 2

The maps are Layouts from a flat (lane, value) coordinate to the row or column,
so that the emitter can render them to C++ and the simulator can evaluate them.
"""
from __future__ import annotations

import attrs

from ..dtypes import DType
from ..layout import Layout
from ..tiling import TVMap

# (lane, reg, half) maps: lane = (quad 4, group 8) colexicographic == lane % 4, lane / 4.
_LANE = (4, 8)


@attrs.frozen
class MMA_16x8x16:
    """``mma.sync.aligned.m16n8k16.row.col.f32.{ab}.{ab}.f32`` for one input dtype."""

    dtype: DType
    M: int = 16
    N: int = 8
    K: int = 16

    @property
    def name(self) -> str:
        return f"SM80_16x8x16_F32{self.dtype.ptx.upper()}{self.dtype.ptx.upper()}F32_TN"

    @property
    def ptx(self) -> str:
        t = self.dtype.ptx
        return f"mma.sync.aligned.m16n8k16.row.col.f32.{t}.{t}.f32"

    # A: value = half + 2*reg, reg in 0..3 -> row += 8*(reg%2), col += 8*(reg/2)
    @property
    def a_map(self) -> TVMap:
        return TVMap(
            "A", 32, 8,
            row=Layout((_LANE, (2, 2, 2)), ((0, 1), (0, 8, 0))),
            col=Layout((_LANE, (2, 2, 2)), ((2, 0), (1, 0, 8))),
        )

    # B: value = half + 2*reg, reg in 0..1 -> k += 8*reg
    @property
    def b_map(self) -> TVMap:
        return TVMap(
            "B", 32, 4,
            row=Layout((_LANE, (2, 2)), ((2, 0), (1, 8))),
            col=Layout((_LANE, (2, 2)), ((0, 1), (0, 0))),
        )

    # C: value = reg in 0..3 -> col += reg%2, row += 8*(reg/2)
    @property
    def c_map(self) -> TVMap:
        return TVMap(
            "C", 32, 4,
            row=Layout((_LANE, (2, 2)), ((0, 1), (0, 8))),
            col=Layout((_LANE, (2, 2)), ((2, 0), (1, 0))),
        )

    @property
    def a_regs(self) -> int:
        return 4

    @property
    def b_regs(self) -> int:
        return 2

    @property
    def c_regs(self) -> int:
        return 4


def accumulator_as_a_operand(c_tile_n: int, reg: int) -> tuple[int, int]:
    """Where A-operand register ``reg`` (0..3) of a k16 step comes from in the S accumulator.

    The accumulator of two neighbouring n8 tiles (2k, 2k+1) holds exactly the rows and
    columns of one 16x16 A tile: A reg r packs C values (2*(r%2), 2*(r%2)+1) of n tile
    2k + r/2. Returns ``(n_tile offset 0/1, first C value index)``; this is the
    "S accumulator fragment reused as the A operand of P V" rule.
    """
    return reg // 2, 2 * (reg % 2)
