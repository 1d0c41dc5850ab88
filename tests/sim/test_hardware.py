"""Hardware semantics on hand-checkable cases: ldmatrix, stmatrix, the m16n8k16 fragments, banks, fp32 math."""
from __future__ import annotations

import numpy as np
import pytest

from flashgen.sim import hardware as hw

# ---------------------------------------------------------------------- ldmatrix


def coded_image(n_rows: int, row_elems: int = 64) -> np.ndarray:
    """smem whose element at row r, column c (row-major, ``row_elems`` wide) holds r*256 + c."""
    r, c = np.meshgrid(np.arange(n_rows), np.arange(row_elems), indexing="ij")
    return (r * 256 + c).astype(np.uint16).ravel()


def test_ldmatrix_x4_identity_coded():
    # matrix i lives at rows 8i..8i+7, columns 8i..8i+7 of a 64-wide image; lane 8i+r
    # points at row (8i + r) -- but rows are handed out in a scrambled lane order.
    smem = coded_image(32)
    perm = np.random.default_rng(0).permutation(8)
    addr = np.zeros(32, np.int64)
    for i in range(4):
        for r in range(8):
            addr[8 * i + perm[r]] = (8 * i + r) * 64 + 8 * i
    regs = hw.ldmatrix(smem, addr, 4, trans=False)
    assert regs.shape == (32, 4, 2)
    for lane in range(32):
        for i in range(4):
            for h in range(2):
                row_in_matrix = int(np.flatnonzero(perm == lane // 4)[0])  # the row lane//4 points at
                want = (8 * i + row_in_matrix) * 256 + 8 * i + 2 * (lane % 4) + h
                assert regs[lane, i, h] == want


def test_ldmatrix_trans_identity_coded():
    smem = coded_image(16)
    addr = np.array([(r % 16) * 64 + 8 * (r // 16) for r in range(32)])  # x4: rows 0-7, 8-15 at col 0, then col 8
    regs = hw.ldmatrix(smem, addr, 4, trans=True)
    for lane in range(32):
        for i in range(4):
            for h in range(2):
                # lane gets column lane//4 of matrix i, rows 2*(lane%4)+h
                row = 8 * (i % 2) + 2 * (lane % 4) + h
                col = 8 * (i // 2) + lane // 4
                assert regs[lane, i, h] == row * 256 + col


def test_stmatrix_trans_puts_fragment_column_rows_at_the_lane_rows():
    """stmatrix.x4.trans, each lane's row on its own 64-element line: the fragment's (row l/4, column 2*(l%4)+h)
    of matrix i lands at position l/4 of the row lane 8i + 2*(l%4) + h names."""
    addr = np.arange(32) * 64
    off = hw.stmatrix_offsets(addr, 4, trans=True)
    for lane in range(32):
        for i in range(4):
            for h in range(2):
                assert off[lane, i, h] == (8 * i + 2 * (lane % 4) + h) * 64 + lane // 4


@pytest.mark.parametrize("num", [1, 2])
def test_ldmatrix_x1_x2_ignore_upper_lanes(num):
    smem = coded_image(16)
    addr = np.array([l * 64 for l in range(16)] + [10**6] * 16)  # lanes >= 8*num are not addresses
    regs = hw.ldmatrix(smem, addr[:32], num, trans=False)
    assert regs.shape == (32, num, 2)
    assert regs[5, num - 1, 1] == (8 * (num - 1) + 1) * 256 + 3


def test_ldmatrix_rejects_misaligned_rows():
    with pytest.raises(ValueError, match="16-byte aligned"):
        hw.ldmatrix(coded_image(8), np.arange(32) * 64 + 4, 4)


# ---------------------------------------------------------------------- mma fragments


@pytest.mark.parametrize(
    "rows, cols, shape",
    [(hw.A_ROW, hw.A_COL, (16, 16)), (hw.B_K, hw.B_N, (16, 8)), (hw.C_ROW, hw.C_COL, (16, 8))],
    ids=["A", "B", "C"],
)
def test_fragment_maps_are_bijections(rows, cols, shape):
    flat = (rows * shape[1] + cols).ravel()
    assert sorted(flat.tolist()) == list(range(shape[0] * shape[1]))


def test_fragment_maps_hand_values():
    # PTX 9.7.14.5.8: lane 5 -> groupID 1, threadID_in_group 1
    assert (hw.A_ROW[5, 0, 0], hw.A_COL[5, 0, 0]) == (1, 2)  # a0
    assert (hw.A_ROW[5, 1, 1], hw.A_COL[5, 1, 1]) == (9, 3)  # a3
    assert (hw.A_ROW[5, 2, 0], hw.A_COL[5, 2, 0]) == (1, 10)  # a4
    assert (hw.A_ROW[5, 3, 1], hw.A_COL[5, 3, 1]) == (9, 11)  # a7
    assert (hw.B_K[5, 0, 1], hw.B_N[5, 0, 1]) == (3, 1)  # b1
    assert (hw.B_K[5, 1, 0], hw.B_N[5, 1, 0]) == (10, 1)  # b2
    assert (hw.C_ROW[5, 1], hw.C_COL[5, 1]) == (1, 3)  # c1
    assert (hw.C_ROW[31, 2], hw.C_COL[31, 2]) == (15, 6)  # c2 of lane 31


@pytest.mark.parametrize("r, c, n", [(0, 0, 0), (3, 9, 5), (15, 15, 7), (8, 4, 2)])
def test_mma_single_product_lands_where_ptx_says(r, c, n):
    """A = e_(r,c), B = e_(c,n): D has a single 1 at (r, n), held by lane 4*(r%8) + n//2, reg 2*(r//8) + n%2."""
    A = np.zeros((16, 16), np.float16)
    B = np.zeros((16, 8), np.float16)
    A[r, c] = 1
    B[c, n] = 1
    d = hw.mma_m16n8k16(hw.a_matrix_to_fragment(A), hw.b_matrix_to_fragment(B), np.zeros((32, 4), np.float32))
    want = np.zeros((32, 4), np.float32)
    want[4 * (r % 8) + n // 2, 2 * (r // 8) + n % 2] = 1
    assert np.array_equal(d, want)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_mma_random_matches_numpy(dtype):
    rng = np.random.default_rng(1)
    A = hw.encode(rng.standard_normal((16, 16)), dtype)
    B = hw.encode(rng.standard_normal((16, 8)), dtype)
    C = rng.standard_normal((16, 8)).astype(np.float32)
    d = hw.mma_m16n8k16(hw.a_matrix_to_fragment(A), hw.b_matrix_to_fragment(B), hw.c_matrix_to_fragment(C), dtype)
    ref = (C.astype(np.float64) + hw.decode(A, dtype).astype(np.float64) @ hw.decode(B, dtype).astype(np.float64)).astype(np.float32)
    assert np.array_equal(hw.c_fragment_to_matrix(d), ref)


def test_mma_rounds_once_to_nearest_even():
    """c = 1: adding exactly half an ulp (2^-24) ties to even (stays 1); half an ulp plus
    2^-30 rounds up to 1 + 2^-23 -- a single rounding of the exact sum, not per product."""
    A = np.zeros((16, 16), np.float16)
    B = np.zeros((16, 8), np.float16)
    A[0, 0], B[0, 0] = 2.0**-12, 2.0**-12  # 2^-24
    A[0, 1], B[1, 1] = 2.0**-12, 2.0**-12
    A[0, 2], B[2, 1] = 2.0**-15, 2.0**-15  # 2^-30, column 1 only
    c = np.ones((16, 8), np.float32)
    d = hw.c_fragment_to_matrix(hw.mma_m16n8k16(hw.a_matrix_to_fragment(A), hw.b_matrix_to_fragment(B), hw.c_matrix_to_fragment(c)))
    assert d[0, 0] == np.float32(1.0)
    assert d[0, 1] == np.float32(1 + 2.0**-23)


def test_mma_needs_dtype_for_bit_patterns():
    with pytest.raises(ValueError, match="dtype"):
        hw.mma_m16n8k16(np.zeros((32, 4, 2), np.uint16), np.zeros((32, 2, 2), np.uint16), np.zeros((32, 4), np.float32))


# ---------------------------------------------------------------------- 16-bit formats


def test_bf16_round_to_nearest_even():
    vals = np.array([1.0, 1 + 2.0**-8, 1 + 3 * 2.0**-8, 1 + 2.0**-8 + 2.0**-20, -2.5, np.inf, 3.4e38 * 1.0], np.float32)
    bits = hw.encode(vals, "bf16")
    # 1+2^-8 is a tie -> even (1.0); 1+3*2^-8 is a tie -> even (1+2^-6); a hair above rounds up
    assert hw.decode(bits, "bf16").tolist()[:5] == [1.0, 1.0, 1 + 2.0**-6, 1 + 2.0**-7, -2.5]
    assert bits[5] == 0x7F80
    assert hw.encode(np.array([np.nan], np.float32), "bf16")[0] & 0x7FC0 == 0x7FC0


def test_pack2_puts_first_value_in_low_half():
    r = hw.pack2(np.float32(1.0), np.float32(-2.0), "fp16")
    assert r.tolist() == [0x3C00, 0xC000]


# ---------------------------------------------------------------------- banks


def test_vec16_consecutive_is_conflict_free():
    assert hw.wavefronts_vec16(np.arange(32) * 16) == 4 == hw.ideal_wavefronts("vec16")


def test_vec16_same_chunk_of_eight_rows_is_8_way():
    """8 threads of a phase hit the same 16 bytes of 8 rows 128 B apart: 4 banks, 8 words each."""
    addr = np.array([(t % 8) * 128 + (t // 8) * 16 for t in range(32)])
    assert hw.wavefronts_vec16(addr) == 4 * 8


def test_vec16_swizzled_rows_are_conflict_free():
    addr = np.array([(t % 8) * 128 + (((t // 8) ^ (t % 8)) * 16) for t in range(32)])
    assert hw.wavefronts_vec16(addr) == 4


def test_ldmatrix_wavefronts():
    contiguous = np.arange(32) * 16
    strided = np.array([(l % 8) * 128 + (l // 8) * 16 for l in range(32)])
    assert hw.wavefronts_ldmatrix(contiguous, 4) == 4
    assert hw.wavefronts_ldmatrix(strided, 4) == 32
    assert hw.wavefronts_ldmatrix(strided, 1) == 8


def test_b32_broadcast_and_conflicts():
    assert hw.wavefronts_b32(np.zeros(32, np.int64)) == 1  # one word: broadcast
    assert hw.wavefronts_b32(np.arange(32) * 4) == 1
    assert hw.wavefronts_b32(np.arange(32) * 128) == 32
    assert hw.wavefronts_b32(np.array([0, 128] * 16)) == 2  # two distinct words in bank 0


def test_bank_inputs_are_validated():
    with pytest.raises(ValueError, match="multiples of 16"):
        hw.wavefronts_vec16(np.arange(32) * 8)
    with pytest.raises(ValueError, match="32 addresses"):
        hw.wavefronts_b32(np.arange(16) * 4)


# ---------------------------------------------------------------------- fp32 math


def test_fma32_single_rounding():
    """a*b = 64 - 2^-40 and c = 2^30 + 2^7: the exact sum lies just below the midpoint
    2^30 + 2^7 + 2^6, so fmaf rounds down; rounding through float64 first would land on
    the midpoint and tie to even (2^30 + 2^8)."""
    a = np.float32(8 * (1 + 2.0**-23))
    b = np.float32(8 * (1 - 2.0**-23))
    c = np.float32(2.0**30 + 2.0**7)
    naive = np.float32(np.float64(a) * np.float64(b) + np.float64(c))
    assert naive == np.float32(2.0**30 + 2.0**8)
    assert hw.fma32(a, b, c) == c


def test_fma32_matches_exact_on_random_values():
    from fractions import Fraction

    rng = np.random.default_rng(3)
    a, b, c = (rng.standard_normal(200).astype(np.float32) * np.float32(s) for s in (1, 1e-3, 1e3))
    got = hw.fma32(a, b, c)
    for x, y, z, g in zip(a, b, c, got):
        exact = Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z))
        lo = np.float32(float(exact))  # candidates around the exact value
        cands = [lo, np.nextafter(lo, np.float32(np.inf)), np.nextafter(lo, np.float32(-np.inf))]
        best = min(cands, key=lambda v: (abs(Fraction(float(v)) - exact), int(np.float32(v).view(np.uint32)) & 1))
        assert g == best


def test_ex2_flushes_subnormals():
    assert hw.ex2_approx_ftz(np.float32(1.0)) == 2.0
    assert hw.ex2_approx_ftz(np.float32(-130.0)) == 0.0  # 2^-130 is subnormal in fp32
    assert hw.ex2_approx_ftz(np.float32(-np.inf)) == 0.0
