"""The mma.sync backward's dQ buffer in fragment order (flashgen.dsl.dq_fragments): every warp's accumulator value is
added at a chunk index that the conversion reads back as that value's (row, column), each element once; the emitted
C++ index functions agree with the Python ones."""
from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

from flashgen.dsl.backward_config import BackwardConfig
from flashgen.dsl.backward_plan import make_backward_plan
from flashgen.dsl.dq_fragments import DqFragments

B = BackwardConfig
CFGS = [B.default("bf16", 128), B.default("bf16", 64), B.default("fp16", 96), B.default("bf16", 256),
        B("fp16", d_head=64, n_warps=4, stages=2), B("fp16", d_head=40, B_c=32, n_warps=2, swizzled=False, mask="window")]


@pytest.mark.parametrize("cfg", CFGS, ids=lambda c: c.short_form())
def test_each_value_lands_where_the_conversion_reads_it_and_every_element_once(cfg):
    frag = make_backward_plan(cfg).dq_fragments
    rows, cols = frag.coords()  # [warp, lane, value, mi, nt]
    warp, lane, value, mi, nt = np.indices(rows.shape)
    index = frag.slot(warp, lane, mi, nt) + value
    got_r, got_c = frag.element(index)
    assert (got_r == rows).all() and (got_c == cols).all()
    assert sorted(index.ravel()) == list(range(frag.chunk_floats))  # the chunk, each float once
    # one tile of a warp: 32 lanes x 16 bytes, contiguous (one 512-byte vector reduction)
    assert (np.diff(frag.slot(0, np.arange(32), 0, 0)) == 4).all()


def test_a_chunk_the_warps_do_not_fill_is_refused():
    plan = make_backward_plan(B.default("bf16", 128))
    with pytest.raises(ValueError, match="do not fill"):
        DqFragments(plan.red_dQ, plan.cfg.n_warps, plan.cfg.B_r, plan.cfg.dq_cols * 2)
    with pytest.raises(ValueError, match="do not fill|cover"):
        DqFragments(plan.red_dQ, plan.cfg.n_warps // 2, plan.cfg.B_r, plan.cfg.dq_cols)


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to run the emitted index functions")
@pytest.mark.parametrize("cfg", CFGS[:4], ids=lambda c: c.short_form())
def test_the_emitted_index_functions_match_the_python(tmp_path, cfg):
    from flashgen.emit.backward_kernel import _red_fns

    plan = make_backward_plan(cfg)
    frag = plan.dq_fragments
    head = (f"#include <initializer_list>\n#include <stdio.h>\n#include <stdint.h>\n#define __host__\n#define __device__\n#define __forceinline__ inline\n"
            f"constexpr uint32_t B_r = {cfg.B_r}, D_HEAD = {cfg.d_head};\n")
    red = _red_fns(plan.red_dQ).split("// the (row, column) step")[0]
    main = ("int main() {\n"
            f"    for (uint32_t u = 0; u < DQ_UNITS; ++u) printf(\"%u %u\\n\", dq_unit_row(u), dq_unit_col(u));\n"
            f"    for (uint32_t w = 0; w < {frag.warps}; ++w) for (uint32_t l = 0; l < 32; ++l) printf(\"%u\\n\", dq_slot(l, w, 1u % {frag.m_tiles}u, 1u % {frag.n_tiles}u));\n"
            "    for (int s : {1, 64, 65, 1000}) printf(\"%lld\\n\", (long long)dq_head_rows(s));\n    return 0;\n}\n")
    (tmp_path / "f.cpp").write_text(head + red + "\n" + frag.to_cpp() + "\n" + main)
    subprocess.run(["g++", "-std=c++17", "-o", str(tmp_path / "f"), str(tmp_path / "f.cpp")], check=True)
    out = [int(x) for x in subprocess.run([str(tmp_path / "f")], check=True, capture_output=True, text=True).stdout.split()]
    r, c = frag.place(np.arange(frag.units))
    n = 2 * frag.units
    assert out[:n:2] == list(r) and out[1:n:2] == list(c)
    w, l = np.divmod(np.arange(32 * frag.warps), 32)
    slots = frag.slot(w, l, 1 % frag.m_tiles, 1 % frag.n_tiles)
    assert out[n:n + slots.size] == list(slots)
    want = [-(-(-(-s // cfg.B_r) * frag.chunk_floats) // cfg.d_head) for s in (1, 64, 65, 1000)]
    assert out[n + slots.size:] == want
    assert all(rows * cfg.d_head >= -(-s // cfg.B_r) * frag.chunk_floats for rows, s in zip(want, (1, 64, 65, 1000)))
