"""The stmatrix builder (flashgen.emit.ptx.stmatrix): one helper per atom, its instruction and operands; ptxas
takes every x1/x2/x4 [.trans] form for sm_90a (marked ``nvcc``)."""
from __future__ import annotations

import re
import subprocess

import pytest

from flashgen.dsl.atoms.copy import SM2RF, RF2SM_stmatrix
from flashgen.emit.ptx import stmatrix
from flashgen.emit.ptx.used import groups

FORMS = [(num, trans) for num in (1, 2, 4) for trans in (False, True)]


@pytest.mark.parametrize("num,trans", FORMS)
def test_helper_stores_num_registers_with_its_instruction(num, trans):
    atom = RF2SM_stmatrix(num, trans)
    text = stmatrix.helper(atom)
    (group,) = groups(text)
    assert group.names == (stmatrix.helper_name(atom),)
    asm = re.search(r'asm volatile\("([^"]*)"', text).group(1)
    assert asm.startswith(f"stmatrix.sync.aligned.m8n8.x{num}{'.trans' if trans else ''}.shared.b16 [%0], {{")
    assert re.findall(r"%(\d+)", asm) == [str(i) for i in range(num + 1)]
    assert text.count('"r"(') == num + 1 and ': "memory"' in text


def test_atoms_name_the_cute_copy_and_reject_other_counts():
    assert (RF2SM_stmatrix(4, True).name, RF2SM_stmatrix(4).name) == ("SM90_U16x8_STSM_T", "SM90_U32x4_STSM_N")
    assert RF2SM_stmatrix(2).elems == 4 and RF2SM_stmatrix().src == "RF" and RF2SM_stmatrix().dst == "SM"
    with pytest.raises(ValueError, match="1, 2 or 4 matrices, not 3"):
        RF2SM_stmatrix(3)
    with pytest.raises(ValueError, match="not an stmatrix atom"):
        stmatrix.helper(SM2RF(4))


@pytest.mark.nvcc
def test_ptxas_takes_every_form(nvcc, tmp_path):
    atoms = [RF2SM_stmatrix(num, trans) for num, trans in FORMS]
    calls = "\n".join(f"    {stmatrix.helper_name(a)}(addr, {', '.join(['v'] * a.num)});" for a in atoms)
    src = tmp_path / "stmatrix_probe.cu"
    src.write_text("#include <cstdint>\n" + "\n".join(stmatrix.helper(a) for a in atoms) + f"""
__global__ void stmatrix_probe(uint32_t v) {{
    __shared__ __align__(16) uint16_t tile[4 * 64];
    const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(tile)) + 16u * (threadIdx.x % 32u);
{calls}
}}
""")
    subprocess.run([nvcc, "-gencode=arch=compute_90a,code=sm_90a", "-cubin", "-o", str(tmp_path / "p.cubin"), str(src)],
                   check=True, capture_output=True, text=True)
