"""``stmatrix.sync.aligned.m8n8.x{1,2,4}[.trans].shared.b16`` (PTX ISA 9.7.14.5.16, sm_90)."""
from __future__ import annotations

from ...dsl.atoms.copy import CopyAtom

_COUNT = {1: "One 8x8 16-bit matrix", 2: "Two 8x8 16-bit matrices", 4: "Four 8x8 16-bit matrices"}


def helper_name(atom: CopyAtom) -> str:
    return f"stmatrix_x{atom.num}{'_trans' if atom.trans else ''}"


def helper(atom: CopyAtom) -> str:
    """``stmatrix_x4[_trans](uint32_t smem_addr, uint32_t a, uint32_t b, uint32_t c, uint32_t d)``: register i ->
    matrix i."""
    if atom.family != "stmatrix":
        raise ValueError(f"{atom} is not an stmatrix atom")
    n = atom.num
    regs = "abcd"[:n]
    ins = ", ".join(f"%{i + 1}" for i in range(n))
    trans = ".trans" if atom.trans else ""
    how, what = (", each stored transposed", "column") if atom.trans else ("", "row")
    return f'''// {_COUNT[n]} from C-fragment pairs{how} (PTX ISA "stmatrix"): lane l names row
// l % 8 of matrix l / 8 (16 contiguous bytes), which receives {what} l % 8 of the fragment's matrix.
__device__ __forceinline__ void {helper_name(atom)}(uint32_t addr, {", ".join(f"uint32_t {r}" for r in regs)}) {{
    asm volatile("stmatrix.sync.aligned.m8n8.x{n}{trans}.shared.b16 [%0], {{{ins}}};\\n"
                 :: "r"(addr), {", ".join(f'"r"({r})' for r in regs)} : "memory");
}}'''
