"""The backward's preprocess and dQ conversion (flashgen.emit.backward_aux): which part of the work each block
or thread takes, compiled for the host: the preprocess's blocks zero every float of the dQ buffer exactly once
(a float left out would be added into unzeroed); the chunked conversion's threads write every row's
8-column groups exactly once, two lanes of a warp a whole 32-byte sector, gather each group's eight values from
the staged chunk of every wgmma layout, and read the chunk without shared-memory bank conflicts."""
from __future__ import annotations

import shutil
import subprocess

import pytest

import numpy as np

from flashgen.dsl.backward_config import BackwardConfig
from flashgen.dsl.hopper_backward_plan import make_hopper_backward_plan
from flashgen.emit import backward_aux
from flashgen.emit.backward_aux import CHUNK_SLOTS, SLOTS
from flashgen.sim import hardware

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to run the emitted C++")
HOST = "#define __host__\n#define __device__\n#define __forceinline__ inline\n"


def _run(tmp_path, consts: str, body: str, helpers: str = "") -> list[int]:
    src = tmp_path / "slots.cpp"
    src.write_text("#include <stdio.h>\n#include <stdint.h>\n" + HOST + consts + SLOTS + "\n" + CHUNK_SLOTS + "\n" + helpers
                   + "\nint main() {\n" + body + "    return 0;\n}\n")
    exe = tmp_path / "slots"
    subprocess.run(["g++", "-std=c++17", "-O1", "-Wall", "-Werror", "-Wno-unused-function", "-Wno-unknown-pragmas", "-o", str(exe), str(src)], check=True)
    return [int(x) for x in subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()]


@needs_gxx
@pytest.mark.parametrize("d_head, lanes, rows", [(64, 8, 1), (64, 8, 17), (128, 8, 1000), (256, 8, 33), (72, 4, 130), (8, 32, 5)])
def test_the_preprocess_blocks_zero_the_dq_buffer_once(tmp_path, d_head, lanes, rows):
    blocks = -(-rows * lanes // 128)  # the launch's grid.x
    consts = f"constexpr int ROWDOT_LANES = {lanes};\nconstexpr uint32_t D_HEAD = {d_head}, B_r = 64, DQ_VEC = 4;\n"
    body = (f"    for (int64_t b = 0; b < {blocks}; ++b) printf(\"%lld %lld\\n\", (long long)dq_zero_first(b), "
            f"(long long)dq_zero_end(b, {rows}));\n")
    got = _run(tmp_path, consts, body)
    covered = [0] * (rows * d_head // 4)
    for first, end in zip(got[::2], got[1::2]):
        for i in range(first, end):
            covered[i] += 1
    assert covered == [1] * len(covered)


@needs_gxx
@pytest.mark.parametrize("d_head, B_r", [(64, 128), (128, 64), (128, 80), (64, 64)])
def test_the_conversion_threads_write_each_row_group_once_in_whole_sectors(tmp_path, d_head, B_r):
    consts = f"constexpr int ROWDOT_LANES = 8;\nconstexpr uint32_t D_HEAD = {d_head}, B_r = {B_r}, DQ_VEC = 4;\n"
    slots = B_r * d_head // 8
    got = _run(tmp_path, consts, f"    for (uint32_t i = 0; i < {slots}u; ++i) printf(\"%u %u\\n\", convert_row(i), convert_col(i));\n")
    cells = list(zip(got[::2], got[1::2]))
    assert sorted(cells) == [(r, c) for r in range(B_r) for c in range(0, d_head, 8)]
    for i0 in range(0, slots, 32):  # a warp: lanes l and l + 16, 16 contiguous 16-bit values, one 32-byte sector
        for (r0, c0), (r1, c1) in zip(cells[i0:i0 + 16], cells[i0 + 16:i0 + 32]):
            assert r0 == r1 and c0 % 16 == 0 and c1 == c0 + 8


W = BackwardConfig.wgmma
#: every layout of the wgmma backward's dQ chunk: by rows (d_head 64), by columns (64-row blocks), transposed (80-row
#: blocks), each with the direct adds' 16-byte slots and the ordered adds' 8-byte ones
LAYOUTS = [W("bf16", 64), W("bf16", 128, "causal"), W("bf16", 128).replace(B_r=80)]
LAYOUTS += [c.replace(deterministic=True) for c in LAYOUTS]


def _gather_harness(cfg) -> tuple[str, str, int]:
    """(constants and dq_chunk_index of ``cfg``'s plan, the conversion's gather as a host function, its slots)."""
    st = make_hopper_backward_plan(cfg).dq_stage
    consts = f"constexpr int ROWDOT_LANES = 8;\nconstexpr uint32_t D_HEAD = {cfg.d_head}, B_r = {cfg.B_r};\n" + st.index_cpp() + "\n"
    gather = backward_aux._GATHER_EACH if st.transposed else backward_aux._GATHER_PAIRS
    fn = ("struct float2 { float x, y; };\nvoid gather(const float* chunk, uint32_t i, float* out) {\n    const uint32_t r = convert_row(i), c = convert_col(i);\n"
          "    float v[8];\n" + "\n".join("    " + line for line in gather) + "\n    for (int e = 0; e < 8; ++e) out[e] = v[e];\n}\n")
    return consts, fn, cfg.B_r * cfg.d_head // 8


@needs_gxx
@pytest.mark.parametrize("cfg", LAYOUTS, ids=BackwardConfig.mangle)
def test_the_conversion_gathers_each_slots_eight_values_from_the_staged_chunk(tmp_path, cfg):
    """With chunk[x] = x, slot i's eight values must be the chunk's floats at dq_chunk_index(row, col + e): the reads'
    rotation undone, whatever the slot."""
    consts, fn, slots = _gather_harness(cfg)
    body = (f"    static float chunk[B_r * D_HEAD]; for (uint32_t x = 0; x < B_r * D_HEAD; ++x) chunk[x] = float(x);\n"
            f"    for (uint32_t i = 0; i < {slots}u; ++i) {{ float v[8]; gather(chunk, i, v);\n"
            "        for (uint32_t e = 0; e < 8; ++e) printf(\"%u %u\\n\", (uint32_t)v[e], dq_chunk_index(convert_row(i), convert_col(i) + e)); }\n")
    got = np.array(_run(tmp_path, consts, body, fn)).reshape(-1, 2)
    assert len(got) == 8 * slots and (got[:, 0] == got[:, 1]).all()


@needs_gxx
@pytest.mark.parametrize("cfg", LAYOUTS, ids=BackwardConfig.mangle)
def test_the_conversion_reads_the_staged_chunk_without_bank_conflicts(tmp_path, cfg):
    """Each warp's read k of the staged chunk (8 bytes a lane where a row's column pairs are contiguous, else 4)
    takes the fewest wavefronts such an access can: its lanes' words fall in different banks (before the rotation
    by slot, 4x as many at 8 bytes, 2x at 4)."""
    consts, _, slots = _gather_harness(cfg)
    transposed = make_hopper_backward_plan(cfg).dq_stage.transposed
    reads, read = (8, "convert_each_read") if transposed else (4, "convert_pair_read")
    body = (f"    for (uint32_t i = 0; i < {slots}u; ++i) for (uint32_t k = 0; k < {reads}u; ++k)\n"
            f"        printf(\"%u\\n\", 4 * dq_chunk_index(convert_row(i), convert_col(i) + {read}(i, k)));\n")
    addrs = np.array(_run(tmp_path, consts, body)).reshape(slots // 32, 32, reads).transpose(0, 2, 1)  # [warp][read][lane]
    kind = "b32" if transposed else "vec8"
    count = hardware.wavefronts_b32_many if transposed else hardware.wavefronts_vec8_many
    assert (count(addrs) == hardware.ideal_wavefronts(kind)).all()
