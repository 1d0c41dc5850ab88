"""K-major wgmma operand tiles: the descriptors' hardware addresses (PTX ISA canonical K-major
layouts) against where TMA put each element (kmajor_tile_layout / TmaLoad.coverage).

The TMA-side reference below is written from the byte-level swizzle definition and the box
placement of ``TmaLoad.coverage``; the wgmma side is ``descriptor_addresses``, written from the
ISA's core-matrix / SBO / LBO definition. Neither uses the other."""
from __future__ import annotations

import functools

import numpy as np
import pytest

from flashgen.dsl.atoms.hopper import (
    GmmaSwizzle, SmemDescriptor, TmaLoad, descriptor_addresses, kmajor_tile_layout, wgmma_kmajor_descriptors,
)
from flashgen.dsl.dtypes import DType

MODES = (GmmaSwizzle.B128, GmmaSwizzle.B64, GmmaSwizzle.B32, GmmaSwizzle.NONE)
SHAPES = [(r, k) for r in (64, 128) for k in (64, 128)]


def tma_byte(mode: GmmaSwizzle, x: int) -> int:
    """TMA's swizzle of a byte offset from a pattern-aligned base: 16-byte granule ^= 128-byte line."""
    bits = {0: 0, 32: 1, 64: 2, 128: 3}[mode.value]
    return x ^ (((x >> 7) & ((1 << bits) - 1)) << 4)


def tma_placement(rows: int, k_cols: int, mode: GmmaSwizzle, dtype: DType = DType.FP16) -> np.ndarray:
    """Byte offset (from the tile base) where TMA writes element (row, k), box by box."""
    span_e = mode.span_bytes // dtype.size
    tma = TmaLoad(box_rows=rows, box_cols=span_e, dtype=dtype, swizzle=mode)
    out = np.full((rows, k_cols), -1, dtype=np.int64)
    for box in tma.coverage(rows, k_cols):
        for r in range(tma.box_rows):
            for c in range(tma.box_cols):
                out[box.row0 + r, box.col0 + c] = box.smem_offset + tma_byte(mode, r * mode.span_bytes + c * dtype.size)
    assert (out >= 0).all()
    return out


@functools.lru_cache(maxsize=None)
def layout_bytes(rows: int, k_cols: int, mode: GmmaSwizzle, dtype: DType = DType.FP16) -> np.ndarray:
    lay = kmajor_tile_layout(rows, k_cols, dtype, mode)
    out = np.array([[dtype.size * lay((r, k)) for k in range(k_cols)] for r in range(rows)], dtype=np.int64)
    out.flags.writeable = False  # cached: shared between tests
    return out


@pytest.mark.parametrize("mode", MODES, ids=str)
@pytest.mark.parametrize("rows, k_cols", SHAPES)
def test_tile_layout_matches_tma_coverage(mode, rows, k_cols):
    got = layout_bytes(rows, k_cols, mode).copy()
    np.testing.assert_array_equal(got, tma_placement(rows, k_cols, mode))
    # a bijection onto the tile's bytes
    assert sorted(got.ravel().tolist()) == list(range(0, 2 * rows * k_cols, 2))


@pytest.mark.parametrize("dtype", [DType.FP16, DType.BF16], ids=str)
@pytest.mark.parametrize("mode", MODES, ids=str)
@pytest.mark.parametrize("rows, k_cols", SHAPES)
@pytest.mark.parametrize("rows_per_wgmma", [64, 32])
@pytest.mark.parametrize("base_patterns", [0, 3])
def test_descriptors_read_what_tma_wrote(dtype, mode, rows, k_cols, rows_per_wgmma, base_patterns):
    base = 0x400 + base_patterns * 1024  # 1024-aligned: fine for every mode
    placed = base + layout_bytes(rows, k_cols, mode, dtype)
    descs = wgmma_kmajor_descriptors(base, rows, k_cols, dtype, mode, rows_per_wgmma)
    assert len(descs) == rows // rows_per_wgmma
    seen = np.zeros((rows, k_cols), dtype=bool)
    for m, row_descs in enumerate(descs):
        assert len(row_descs) == k_cols // 16
        for s, d in enumerate(row_descs):
            r0, k0 = m * rows_per_wgmma, 16 * s
            want = placed[r0:r0 + rows_per_wgmma, k0:k0 + 16]
            np.testing.assert_array_equal(descriptor_addresses(d, rows_per_wgmma, 16, dtype), want,
                                          err_msg=f"{mode} {rows}x{k_cols} row block {m} k16 step {s}: {d}")
            seen[r0:r0 + rows_per_wgmma, k0:k0 + 16] = True
    assert seen.all()


@pytest.mark.parametrize("mode", MODES, ids=str)
def test_descriptor_fields(mode):
    rows, k_cols = 128, 128
    descs = wgmma_kmajor_descriptors(0x2000, rows, k_cols, DType.FP16, mode, 64)
    span = mode.span_bytes
    for m, row_descs in enumerate(descs):
        for s, d in enumerate(row_descs):
            assert d.swizzle is mode and d.base_offset == 0
            if mode is GmmaSwizzle.NONE:
                assert (d.leading_byte_offset, d.stride_byte_offset) == (rows * 16, 128)
            else:
                # ISA: swizzled K-major LBO unused (assumed 1); SBO = one 8-row group of span bytes
                assert (d.leading_byte_offset, d.stride_byte_offset) == (16, 8 * span)
                assert (d.encode() >> 16) & 0x3FFF == 1
            assert SmemDescriptor.decode(d.encode()) == d
    # 128B: +32 B per k16 step inside the 64-element atom row, next K block = next TMA box
    if mode is GmmaSwizzle.B128:
        starts = [d.start_address for d in descs[0]]
        assert starts == [0x2000 + o for o in (0, 32, 64, 96, rows * 128, rows * 128 + 32, rows * 128 + 64, rows * 128 + 96)]
        assert descs[1][0].start_address == 0x2000 + 64 * 128


@pytest.mark.parametrize("mode, align", [(GmmaSwizzle.B128, 1024), (GmmaSwizzle.B64, 512),
                                         (GmmaSwizzle.B32, 256), (GmmaSwizzle.NONE, 128)], ids=str)
def test_misaligned_base_rejected(mode, align):
    wgmma_kmajor_descriptors(3 * align, 64, 64, DType.FP16, mode)
    for bad in (align // 2, 3 * align + 16):
        with pytest.raises(ValueError, match=f"not {align}-byte aligned"):
            wgmma_kmajor_descriptors(bad, 64, 64, DType.FP16, mode)


def test_misaligned_read_differs():
    """Why the alignment matters: a 128B tile at base+512 would not be read back as written."""
    lay = 2 * np.array([[kmajor_tile_layout(64, 64)((r, k)) for k in range(16)] for r in range(64)])
    d = SmemDescriptor(512, 16, 1024, GmmaSwizzle.B128)
    assert not np.array_equal(descriptor_addresses(d, 64), 512 + lay)


@pytest.mark.parametrize("kwargs, msg", [
    (dict(rows=60), "multiple of 8"),
    (dict(rows=512), "multiple of 8"),
    (dict(k_cols=32), "multiple of 64"),
    (dict(rows_per_wgmma=48), "rows_per_wgmma"),
    (dict(tile_base_byte_addr=-1024), "int >= 0"),
    (dict(tile_base_byte_addr=(1 << 18) - 1024), "18-bit"),
])
def test_bad_arguments(kwargs, msg):
    args = dict(tile_base_byte_addr=0, rows=64, k_cols=64, dtype=DType.FP16, swizzle=GmmaSwizzle.B128, rows_per_wgmma=64)
    args.update(kwargs)
    with pytest.raises(ValueError, match=msg):
        wgmma_kmajor_descriptors(**args)


def test_descriptor_addresses_rejects_wide_slice():
    with pytest.raises(ValueError, match="does not fit"):
        descriptor_addresses(SmemDescriptor(0, 16, 256, GmmaSwizzle.B32), 8, k=32)
