"""The backward's preprocess and dQ conversion (flashgen.emit.backward_aux): which part of the work each block
or thread takes, compiled for the host: the preprocess's blocks zero every float of the dQ buffer exactly once
(a float left out would be added into unzeroed), and the chunked conversion's threads write every row's
8-column groups exactly once, two threads a whole 32-byte sector."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from flashgen.emit.backward_aux import CHUNK_SLOTS, SLOTS

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to run the emitted C++")
HOST = "#define __host__\n#define __device__\n#define __forceinline__ inline\n"


def _run(tmp_path, consts: str, body: str) -> list[int]:
    src = tmp_path / "slots.cpp"
    src.write_text("#include <stdio.h>\n#include <stdint.h>\n" + HOST + consts + SLOTS + "\n" + CHUNK_SLOTS
                   + "\nint main() {\n" + body + "    return 0;\n}\n")
    exe = tmp_path / "slots"
    subprocess.run(["g++", "-std=c++17", "-O1", "-Wall", "-Werror", "-Wno-unused-function", "-o", str(exe), str(src)], check=True)
    return [int(x) for x in subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()]


@needs_gxx
@pytest.mark.parametrize("d_head, lanes, rows", [(64, 8, 1), (64, 8, 17), (128, 8, 1000), (256, 8, 33), (72, 4, 130), (8, 32, 5)])
def test_the_preprocess_blocks_zero_the_dq_buffer_once(tmp_path, d_head, lanes, rows):
    blocks = -(-rows * lanes // 128)  # the launch's grid.x
    consts = f"constexpr int ROWDOT_LANES = {lanes};\nconstexpr uint32_t D_HEAD = {d_head}, B_r = 2;\n"
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
    consts = f"constexpr int ROWDOT_LANES = 8;\nconstexpr uint32_t D_HEAD = {d_head}, B_r = {B_r};\n"
    slots = B_r * d_head // 8
    got = _run(tmp_path, consts, f"    for (uint32_t i = 0; i < {slots}u; ++i) printf(\"%u %u\\n\", convert_row(i), convert_col(i));\n")
    cells = list(zip(got[::2], got[1::2]))
    assert sorted(cells) == [(r, c) for r in range(B_r) for c in range(0, d_head, 8)]
    for (r0, c0), (r1, c1) in zip(cells[::2], cells[1::2]):
        assert r0 == r1 and c0 % 16 == 0 and c1 == c0 + 8  # 16 contiguous 16-bit values: one 32-byte sector
