"""``ldmatrix.sync.aligned.m8n8.x{1,2,4}[.trans].shared.b16`` (PTX ISA 9.7.14.5.15)."""
from __future__ import annotations

from ...dsl.atoms.copy import CopyAtom


def helper_name(atom: CopyAtom) -> str:
    return f"ldsm_x{atom.num}{'_trans' if atom.trans else ''}"


def helper(atom: CopyAtom) -> str:
    """``ldsm_x4[_trans](uint32_t (&r)[4], uint32_t smem_addr)``: register i <- matrix i."""
    if atom.family != "ldmatrix":
        raise ValueError(f"{atom} is not an ldmatrix atom")
    n = atom.num
    outs = ", ".join(f"%{i}" for i in range(n))
    regs = ", ".join(f'"=r"(r[{i}])' for i in range(n))
    trans = ".trans" if atom.trans else ""
    what = "transposed: lane l gets column l/4, rows 2*(l%4)+{0,1}" if atom.trans else "lane l gets row l/4, columns 2*(l%4)+{0,1}"
    return f'''// {atom.name}: {n} 8x8 b16 matrices; lanes 8i..8i+7 give matrix i's row addresses; {what}.
__device__ __forceinline__ void {helper_name(atom)}(uint32_t (&r)[{n}], uint32_t smem_addr) {{
    asm volatile("ldmatrix.sync.aligned.m8n8.x{n}{trans}.shared.b16 {{{outs}}}, [%{n}];\\n"
                 : {regs} : "r"(smem_addr));
}}'''
