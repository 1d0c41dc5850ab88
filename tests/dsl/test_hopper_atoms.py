"""Hopper atoms against their PTX ISA definitions: swizzle modes, wgmma descriptors and
accumulator map, TMA boxes. The reference functions here are written from the byte-level
/ fragment definitions, not from the objects under test."""
from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flashgen.dsl.atoms.hopper import GmmaSwizzle, Mbarrier, SmemDescriptor, TmaLoad, WGMMA_64xNx16
from flashgen.dsl.atoms.mma import MMA_16x8x16
from flashgen.dsl.dtypes import DType
from flashgen.dsl.swizzle import Swizzle

SWIZZLED = (GmmaSwizzle.B32, GmmaSwizzle.B64, GmmaSwizzle.B128)


def byte_swizzle(mode: GmmaSwizzle, addr: int) -> int:
    """The byte-level definition: XOR the 16-byte chunk index (bits 4..) with the 128-byte line (bits 7..)."""
    mask = mode.span_bytes // 16 - 1 if mode is not GmmaSwizzle.NONE else 0
    return addr ^ (((addr >> 7) & mask) << 4)


# ---------------------------------------------------------------------- swizzle modes


@pytest.mark.parametrize("mode, expected", [
    (GmmaSwizzle.NONE, Swizzle(0, 3, 3)), (GmmaSwizzle.B32, Swizzle(1, 3, 3)),
    (GmmaSwizzle.B64, Swizzle(2, 3, 3)), (GmmaSwizzle.B128, Swizzle(3, 3, 3)),
])
def test_mode_swizzles(mode, expected):
    assert mode.swizzle == expected
    assert str(mode.atom()) == f"{expected} o (8,{max(8, mode.value // 2)}):({max(8, mode.value // 2)},1)"


@pytest.mark.parametrize("mode", list(GmmaSwizzle))
def test_element_swizzle_is_byte_swizzle(mode):
    period_bytes = 1024
    for off in range(4 * period_bytes // 2):  # four 1024-byte periods of 16-bit elements
        assert mode.swizzle(off) == byte_swizzle(mode, 2 * off) // 2
        assert mode.byte_swizzle(2 * off) == byte_swizzle(mode, 2 * off)


def test_desc_and_tma_codes():
    assert [m.desc_code for m in (GmmaSwizzle.NONE, GmmaSwizzle.B128, GmmaSwizzle.B64, GmmaSwizzle.B32)] == [0, 1, 2, 3]
    assert all(GmmaSwizzle.from_desc_code(m.desc_code) is m for m in GmmaSwizzle)
    assert GmmaSwizzle.B128.tma_name == "CU_TENSOR_MAP_SWIZZLE_128B"
    assert GmmaSwizzle.NONE.tma_name == "CU_TENSOR_MAP_SWIZZLE_NONE"


@pytest.mark.parametrize("mode", list(GmmaSwizzle))
@pytest.mark.parametrize("dtype", list(DType))
def test_atom_is_bijection_onto_span(mode, dtype):
    atom = mode.atom(dtype)
    rows, cols = 8, mode.span_bytes // 2
    offs = [atom((r, c)) for r in range(rows) for c in range(cols)]
    assert sorted(offs) == list(range(rows * cols))
    # the 8-element (16-byte) chunks stay whole and stay within their row
    for r in range(rows):
        for c in range(cols):
            assert atom((r, c)) // cols == r and atom((r, c)) % 8 == c % 8


def _bank_group_degree(mode: GmmaSwizzle, swizzled: bool) -> int:
    """Max rows sharing a 16-byte bank group when 8 consecutive rows read one 16-byte column chunk."""
    atom = mode.atom()
    cols = mode.span_bytes // 2
    worst = 0
    for chunk in range(cols // 8):
        groups = Counter(
            ((atom((r, 8 * chunk)) if swizzled else r * cols + 8 * chunk) * 2 // 16) % 8 for r in range(8)
        )
        worst = max(worst, max(groups.values()))
    return worst


# 128B rows: unswizzled all 8 rows hit one group (8-way); 64B rows: two rows per 128-byte
# line -> 2 distinct groups (4-way); 32B: 4 per line (2-way); 16B core matrices: conflict-free.
# Swizzled, row r's chunk XOR (r >> log2(8*16/span)) spreads the 8 rows over all 8 groups.
@pytest.mark.parametrize("mode, unswizzled", [
    (GmmaSwizzle.B128, 8), (GmmaSwizzle.B64, 4), (GmmaSwizzle.B32, 2), (GmmaSwizzle.NONE, 1),
])
def test_bank_groups_of_eight_rows(mode, unswizzled):
    assert _bank_group_degree(mode, swizzled=True) == 1
    assert _bank_group_degree(mode, swizzled=False) == unswizzled


# ---------------------------------------------------------------------- descriptor


def test_descriptor_hand_example():
    # addr 0x1230: (0x1230 & 0x3FFFF) >> 4 = 0x123             -> bits 0-13
    # LBO 16: 16 >> 4 = 1                                       -> 1 << 16    = 0x0000_0000_0001_0000
    # SBO 1024 (8 rows x 128 B): 1024 >> 4 = 64 = 0x40          -> 0x40 << 32 = 0x0000_0040_0000_0000
    # base offset 3                                             -> 3 << 49    = 0x0006_0000_0000_0000
    # 128B swizzle: code 1                                      -> 1 << 62    = 0x4000_0000_0000_0000
    d = SmemDescriptor(0x1230, 16, 1024, GmmaSwizzle.B128, base_offset=3)
    assert d.encode() == 0x4006_0040_0001_0123
    assert SmemDescriptor.decode(0x4006_0040_0001_0123) == d
    # 32B swizzle: code 3 -> top two bits set
    assert SmemDescriptor(0, 0, 0, GmmaSwizzle.B32).encode() == 0xC000_0000_0000_0000


@given(
    addr=st.integers(0, (1 << 14) - 1), lbo=st.integers(0, (1 << 14) - 1), sbo=st.integers(0, (1 << 14) - 1),
    mode=st.sampled_from(list(GmmaSwizzle)), base=st.integers(0, 7),
)
def test_descriptor_round_trip(addr, lbo, sbo, mode, base):
    d = SmemDescriptor(addr << 4, lbo << 4, sbo << 4, mode, base)
    enc = d.encode()
    assert 0 <= enc < 1 << 64
    assert SmemDescriptor.decode(enc) == d
    # each field sits at its documented bit position
    assert enc & 0x3FFF == addr and (enc >> 16) & 0x3FFF == lbo and (enc >> 32) & 0x3FFF == sbo
    assert (enc >> 49) & 7 == base and enc >> 62 == mode.desc_code


@pytest.mark.parametrize("kwargs, message", [
    (dict(start_address=0x1238), "start_address must be a multiple of 16"),
    (dict(start_address=1 << 18), "start_address must be in"),
    (dict(leading_byte_offset=8), "leading_byte_offset must be a multiple of 16"),
    (dict(stride_byte_offset=-16), "stride_byte_offset must be in"),
    (dict(base_offset=8), "base_offset is a 3-bit field"),
])
def test_descriptor_rejects(kwargs, message):
    args = dict(start_address=0, leading_byte_offset=16, stride_byte_offset=1024, swizzle=GmmaSwizzle.B128)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        SmemDescriptor(**args)


def test_descriptor_decode_rejects_reserved_bits():
    with pytest.raises(ValueError, match="reserved bits"):
        SmemDescriptor.decode(1 << 14)
    with pytest.raises(ValueError, match="64-bit"):
        SmemDescriptor.decode(1 << 64)


# ---------------------------------------------------------------------- wgmma accumulator


def wgmma_d_reference(thread: int, i: int) -> tuple[int, int]:
    """PTX ISA wgmma .m64nNk16 D fragment (f32), written from the figure."""
    warp, lane = divmod(thread, 32)
    return 16 * warp + lane // 4 + 8 * ((i // 2) % 2), 8 * (i // 4) + 2 * (lane % 4) + i % 2


@pytest.mark.parametrize("n", [8, 64, 128, 256])
def test_wgmma_c_map_bijection_and_reference(n):
    atom = WGMMA_64xNx16(DType.FP16, n)
    cmap = atom.c_map
    assert (cmap.n_threads, cmap.n_values) == (128, n // 2) and atom.c_regs == n // 2
    coords = [cmap(t, v) for t in range(128) for v in range(n // 2)]
    assert sorted(coords) == [(r, c) for r in range(64) for c in range(n)]
    assert all(cmap(t, v) == wgmma_d_reference(t, v) for t in range(128) for v in range(n // 2))


@pytest.mark.parametrize("dtype", list(DType))
@pytest.mark.parametrize("n", [8, 64, 256])
def test_wgmma_c_map_is_mma_c_map_per_warp_and_chunk(dtype, n):
    wg = WGMMA_64xNx16(dtype, n).c_map
    c = MMA_16x8x16(dtype).c_map
    for warp in range(4):
        for chunk in range(n // 8):
            for lane in range(32):
                for v in range(4):
                    r, col = c(lane, v)
                    assert wg(32 * warp + lane, 4 * chunk + v) == (r + 16 * warp, col + 8 * chunk)


def test_wgmma_atom_text_and_validation():
    atom = WGMMA_64xNx16(DType.BF16, 128)
    assert atom.ptx == "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16"
    assert atom.name == "SM90_64x128x16_F32BF16BF16_SS"
    for bad in (0, 12, 264):
        with pytest.raises(ValueError, match="multiple of 8 in 8..256"):
            WGMMA_64xNx16(DType.FP16, bad)


# ---------------------------------------------------------------------- mbarrier + TMA


def test_mbarrier():
    assert Mbarrier("full", 1).arrive_count == 1
    with pytest.raises(ValueError, match="arrive_count"):
        Mbarrier("empty", 0)
    with pytest.raises(ValueError, match="arrive_count"):
        Mbarrier("empty", 1 << 20)
    with pytest.raises(ValueError, match="C identifier"):
        Mbarrier("a b")


@pytest.mark.parametrize("box, tile", [
    (TmaLoad(64, 64, DType.FP16, GmmaSwizzle.B128), (128, 128)),
    (TmaLoad(128, 64, DType.BF16, GmmaSwizzle.B128), (128, 256)),
    (TmaLoad(32, 32, DType.FP16, GmmaSwizzle.B64), (64, 96)),
    (TmaLoad(8, 16, DType.FP16, GmmaSwizzle.B32), (24, 16)),
    (TmaLoad(256, 8, DType.FP16, GmmaSwizzle.NONE), (256, 64)),
])
def test_tma_coverage_exactly_once(box, tile):
    rows, cols = tile
    boxes = box.coverage(rows, cols)
    hits = Counter(
        (b.row0 + r, b.col0 + c) for b in boxes for r in range(box.box_rows) for c in range(box.box_cols)
    )
    assert set(hits) == {(r, c) for r in range(rows) for c in range(cols)}
    assert set(hits.values()) == {1}
    # shared-memory placement: disjoint, contiguous, box-aligned
    assert sorted(b.smem_offset for b in boxes) == [i * box.bytes for i in range(len(boxes))]
    assert len(boxes) * box.bytes == rows * cols * 2


def test_tma_bytes_and_validation():
    assert TmaLoad(64, 64, DType.FP16).bytes == 8192  # expect_tx of a 64x64 fp16 box
    assert TmaLoad(128, 64, DType.BF16).bytes == 16384
    assert TmaLoad(256, 32, DType.FP16, GmmaSwizzle.B64).bytes == 16384
    with pytest.raises(ValueError, match="exceeds the SW128 span of 128 B"):
        TmaLoad(64, 128, DType.FP16, GmmaSwizzle.B128)
    with pytest.raises(ValueError, match="exceeds the SW32 span"):
        TmaLoad(8, 32, DType.FP16, GmmaSwizzle.B32)
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        TmaLoad(64, 4, DType.FP16, GmmaSwizzle.NONE)
    with pytest.raises(ValueError, match="1..256"):
        TmaLoad(512, 64, DType.FP16)
    with pytest.raises(ValueError, match="not a whole number"):
        TmaLoad(64, 64, DType.FP16).coverage(100, 128)
