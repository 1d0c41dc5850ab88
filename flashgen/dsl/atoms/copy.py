"""Copy atoms: one instruction moving data between memory spaces, named in the CuTe style.

An atom says *what one instruction does* (bytes, spaces, PTX); where each thread
points it is a :class:`~flashgen.dsl.tiling.Partition` in the plan. The PTX text
itself is rendered by :mod:`flashgen.emit.ptx`, keyed by the atom's ``family``.
"""
from __future__ import annotations

import attrs

from ..layout import Layout
from ..tiling import TVMap

GM, SM, RF = "GM", "SM", "RF"


@attrs.frozen
class CopyAtom:
    """One copy instruction.

    ``elems`` is the number of 16-bit elements a thread moves per instruction;
    ``family`` selects the PTX builder; ``section`` is the PTX ISA section.
    """

    name: str
    family: str
    src: str
    dst: str
    elems: int
    section: str
    trans: bool = False
    num: int = 1  # ldmatrix, stmatrix: matrices per instruction (x1/x2/x4)

    @property
    def bytes_per_thread(self) -> int:
        return self.elems * 2

    @property
    def is_async(self) -> bool:
        return self.family == "cp_async"

    def __str__(self) -> str:
        return self.name


def GM2SM() -> CopyAtom:
    """Synchronous 16-byte copy: ``ld.global.v4.u32`` into registers, ``st.shared.v4.u32`` (PTX 9.7.9.8 ld / 9.7.9.10 st)."""
    return CopyAtom("UniversalCopy<uint128_t>", "vec16", GM, SM, 8, "9.7.9.8 ld, 9.7.9.10 st")


def GM2SM_async() -> CopyAtom:
    """``cp.async.cg.shared.global [dst], [src], 16`` + commit/wait groups (PTX 9.7.9.25.3)."""
    return CopyAtom("SM80_CP_ASYNC_CACHEGLOBAL<uint128_t>", "cp_async", GM, SM, 8, "9.7.9.25.3 cp.async")


def GM2SM_f32() -> CopyAtom:
    """One fp32 value: ``ld.global.f32`` into a register, ``st.shared.f32`` (PTX 9.7.9.8 ld / 9.7.9.10 st)."""
    return CopyAtom("UniversalCopy<float>", "f32", GM, SM, 2, "9.7.9.8 ld, 9.7.9.10 st")


def GM2SM_async_f32() -> CopyAtom:
    """``cp.async.ca.shared.global [dst], [src], 4``: one fp32 value, in the 16-byte copies' groups (PTX 9.7.9.25.3)."""
    return CopyAtom("SM80_CP_ASYNC_CACHEALWAYS<float>", "cp_async", GM, SM, 2, "9.7.9.25.3 cp.async")


def SM2GM() -> CopyAtom:
    """16-byte ``ld.shared.v4.u32`` then ``st.global.v4.u32`` (PTX 9.7.9.8 / 9.7.9.10)."""
    return CopyAtom("UniversalCopy<uint128_t>", "vec16", SM, GM, 8, "9.7.9.8 ld, 9.7.9.10 st")


def RF2SM() -> CopyAtom:
    """32-bit ``st.shared.b32`` of one packed f16x2/bf16x2 pair of an accumulator fragment (PTX 9.7.9.10)."""
    return CopyAtom("UniversalCopy<uint32_t>", "st_shared_b32", RF, SM, 2, "9.7.9.10 st")


def SM2RF(num: int = 4, trans: bool = False) -> CopyAtom:
    """``ldmatrix.sync.aligned.m8n8.x{num}[.trans].shared.b16`` (PTX 9.7.14.5.15).

    Lanes 8*i .. 8*i+7 supply the row addresses of matrix i; destination register
    i of every lane receives a fragment of matrix i.
    """
    if num not in (1, 2, 4):
        raise ValueError(f"ldmatrix moves 1, 2 or 4 matrices, not {num}")
    name = f"SM75_U16x{2 * num}_LDSM_T" if trans else f"SM75_U32x{num}_LDSM_N"
    return CopyAtom(name, "ldmatrix", SM, RF, 2 * num, "9.7.14.5.15 ldmatrix", trans=trans, num=num)


def RF2SM_stmatrix(num: int = 4, trans: bool = False) -> CopyAtom:
    """``stmatrix.sync.aligned.m8n8.x{num}[.trans].shared.b16`` (PTX 9.7.14.5.16, sm_90).

    ldmatrix's inverse, with its fragment: lanes 8*i .. 8*i+7 supply the row addresses of
    matrix i; source register i of every lane holds a fragment of matrix i (row ``l/4``,
    columns ``2*(l%4)+{0,1}``), which ``.trans`` stores transposed.
    """
    if num not in (1, 2, 4):
        raise ValueError(f"stmatrix moves 1, 2 or 4 matrices, not {num}")
    name = f"SM90_U16x{2 * num}_STSM_T" if trans else f"SM90_U32x{num}_STSM_N"
    return CopyAtom(name, "stmatrix", RF, SM, 2 * num, "9.7.14.5.16 stmatrix", trans=trans, num=num)


# ---- where lanes point an ldmatrix.x4 inside a 16x16 block -------------------------------
# Lane l addresses row (l % 8) of matrix (l / 8). The matrix order decides which
# 8x8 quarter of the 16x16 block each destination register receives.


def ldmatrix_x4_rows_then_cols(name: str) -> TVMap:
    """Matrices (r0,c0) (r8,c0) (r0,c8) (r8,c8): the A operand (Q, P) and V under ``.trans``.

    Lane l points at row ``l%8 + 8*((l/8)%2)``, column ``8*(l/16)``; one value per lane.
    """
    return TVMap(
        name, 32, 1,
        row=Layout(((8, 2, 2), 1), ((1, 8, 0), 0)),
        col=Layout(((8, 2, 2), 1), ((0, 0, 8), 0)),
    )


def ldmatrix_x4_cols_then_rows(name: str) -> TVMap:
    """Matrices (r0,c0) (r0,c8) (r8,c0) (r8,c8): the B operand K (two n8 tiles x k16).

    Lane l points at row ``l%8 + 8*(l/16)``, column ``8*((l/8)%2)``.
    """
    return TVMap(
        name, 32, 1,
        row=Layout(((8, 2, 2), 1), ((1, 0, 8), 0)),
        col=Layout(((8, 2, 2), 1), ((0, 8, 0), 0)),
    )


def ldmatrix_x4_trans_a(name: str) -> TVMap:
    """The A operand (16x16, ``(m, k)`` coordinates) from a tile stored k-major, under ``.trans``.

    A stored row is 8 consecutive ``m`` at one ``k``; A register i is the quarter ``(m 8*(i%2),
    k 8*(i/2))``, so lane l points at ``m = 8*((l/8)%2)``, ``k = l%8 + 8*(l/16)``.
    """
    return TVMap(
        name, 32, 1,
        row=Layout(((8, 2, 2), 1), ((0, 8, 0), 0)),
        col=Layout(((8, 2, 2), 1), ((1, 0, 8), 0)),
    )


def RF2GM_red() -> CopyAtom:
    """``red.global.add.f32 [addr], value``: one fp32 accumulator element added in global memory
    (PTX 9.7.13.6 red); adds from different CTAs to one address commute only up to rounding."""
    return CopyAtom("SM70_RED_ADD_F32", "red_add_f32", RF, GM, 2, "9.7.13.6 red")  # 4 bytes
