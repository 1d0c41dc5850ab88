"""Swizzle bit function, its C++ text, and the shared-memory bank property it exists for."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashgen.dsl.layout import Layout
from flashgen.dsl.swizzle import ComposedLayout, Swizzle

SW333 = Swizzle(3, 3, 3)


def cpp_function(text: str, *names: str):
    """Rendered C++ as a Python function: for non-negative ints C++ ``/`` is ``//``."""
    return eval(f"lambda {', '.join(names)}: {text.replace('/', '//')}", {"__builtins__": {}})


@st.composite
def swizzles(draw):
    b = draw(st.integers(0, 3))
    m = draw(st.integers(0, 3))
    s = draw(st.integers(b, 4)) * draw(st.sampled_from([1, -1]))
    return Swizzle(b, m, s)


# ---------------------------------------------------------------------- bit function


def test_sw333_hand_values():
    # bits  8 7 6 | 5 4 3 | 2 1 0      zzz(5..3) ^= yyy(8..6)
    # 327 = 1 0 1 | 0 0 0 | 1 1 1  ->  1 0 1 | 1 0 1 | 1 1 1 = 367
    assert SW333(327) == 367
    # 241 = 0 1 1 | 1 1 0 | 0 0 1  ->  0 1 1 | 1 0 1 | 0 0 1 = 233
    assert SW333(241) == 233
    # row 0 (bits 8..6 = 0) is unchanged; bits above 8 are never touched
    assert [SW333(x) for x in range(64)] == list(range(64))
    assert SW333(512 + 327) == 512 + 367
    assert (SW333.yyy_mask, SW333.zzz_mask, SW333.period) == (0x1C0, 0x38, 512)


def test_negative_shift_hand_values():
    sw = Swizzle(2, 0, -3)  # yyy = bits 1..0, zzz = bits 4..3: zzz ^= yyy << 3
    assert (sw.yyy_mask, sw.zzz_mask) == (0b00011, 0b11000)
    # 5 = 00 1 01 -> 01 << 3 = 01000 -> 5 ^ 8 = 13 = 01 1 01
    assert sw(5) == 13 and sw(13) == 5
    assert sw(0b11011) == 0b00011


@settings(max_examples=100, deadline=None)
@given(swizzles())
def test_bijection_and_involution(sw):
    for n in (sw.period, 3 * sw.period):
        image = [sw(x) for x in range(n)]
        assert sorted(image) == list(range(n))  # permutation of each aligned block range
    assert all(sw(sw(x)) == x for x in range(2 * sw.period))
    # only zzz bits change
    assert all((sw(x) ^ x) & ~sw.zzz_mask == 0 for x in range(sw.period))


@settings(max_examples=60, deadline=None)
@given(swizzles())
def test_apply_matches_call(sw):
    """The array form runs the same bit function as one offset at a time."""
    x = np.concatenate([np.arange(3 * sw.period), np.random.default_rng(0).integers(0, 1 << 20, 200)])
    assert sw.apply(x).tolist() == [sw(int(v)) for v in x]
    with pytest.raises(ValueError, match="offsets must be >= 0"):
        sw.apply(np.array([1, -1]))


def test_composed_offsets_and_offsets_at():
    c = ComposedLayout(SW333, Layout((16, 64), (64, 1)))
    assert c.offsets().tolist() == [c(i) for i in range(c.size)]
    rows, cols = np.array([0, 1, 9, 15]), np.array([0, 8, 17, 63])
    assert c.offsets_at(rows, cols).tolist() == [c((int(r), int(k))) for r, k in zip(rows, cols)]


def test_identity():
    sw = Swizzle(0, 4, 0)
    assert sw.is_identity and not SW333.is_identity
    assert all(sw(x) == x for x in range(100))
    assert sw.to_cpp("a + b") == "a + b"


@pytest.mark.parametrize(
    "args, match",
    [
        ((3, 3, 2), r"\|S\| >= B .* got Sw<3,3,2>"),
        ((3, 3, -2), r"\|S\| >= B"),
        ((-1, 3, 3), r"B >= 0 and M >= 0; got Sw<-1,3,3>"),
        ((3, -1, 3), r"B >= 0 and M >= 0"),
        ((3, 3.0, 3), r"must be ints; got 3.0"),
    ],
)
def test_invalid_swizzles(args, match):
    with pytest.raises(ValueError, match=match):
        Swizzle(*args)


def test_bad_offsets():
    with pytest.raises(ValueError, match="offset must be an int >= 0; got -1"):
        SW333(-1)


# ------------------------------------------------------------------------ C++ text


def test_text_forms():
    assert str(SW333) == "Sw<3,3,3>"
    assert SW333.to_cpp("x") == "(x ^ ((x & 0x1c0) >> 3))"
    assert SW333.to_cpp("a + b") == "((a + b) ^ (((a + b) & 0x1c0) >> 3))"
    assert Swizzle(2, 0, -3).to_cpp("x") == "(x ^ ((x & 0x3) << 3))"
    c = ComposedLayout(SW333, Layout((64, 64), (64, 1)))
    assert str(c) == "Sw<3,3,3> o (64,64):(64,1)"
    assert c.to_cpp(["r", "c"]) == "((r * 64 + c) ^ (((r * 64 + c) & 0x1c0) >> 3))"


@settings(max_examples=60, deadline=None)
@given(swizzles())
def test_to_cpp_matches_call(sw):
    f = cpp_function(sw.to_cpp("x + y"), "x", "y")
    assert all(f(x, 3) == sw(x + 3) for x in range(2 * sw.period))


def test_composed_layout_eval_and_to_cpp():
    c = ComposedLayout(SW333, Layout(((8, 8), (64, 2)), ((64, 512), (1, 4096))))
    by_mode = cpp_function(c.to_cpp(["r", "c"]), "r", "c")
    one = cpp_function(c.to_cpp("i"), "i")
    for r, col in itertools.product(range(64), range(128)):
        expect = SW333(c.layout((r, col)))
        assert c((r, col)) == expect
        assert by_mode(r, col) == expect
    for i in range(c.size):
        assert one(i) == c(i)
    assert c.size == 64 * 128 and c.rank == 2 and c.shape == c.layout.shape
    assert c.cosize == max(c(i) for i in range(c.size)) + 1 == c.layout.cosize


def test_composed_cosize_can_exceed_layout_cosize():
    # element 0 of rows 0..7: offset 64r -> 64r + 8r (chunk r), so 448 -> 504
    c = ComposedLayout(SW333, Layout(8, 64))
    assert c.layout.cosize == 449 and c.cosize == 505
    assert ComposedLayout(SW333, Layout((2, 64), (64, 1))).cosize == 128


def test_composed_table_and_validation():
    c = ComposedLayout(Swizzle(1, 0, 1), Layout((2, 2), (2, 1)))
    assert c.table().splitlines()[0] == "Sw<1,0,1> o (2,2):(2,1)"
    assert [c((r, k)) for r in range(2) for k in range(2)] == [0, 1, 3, 2]
    with pytest.raises(TypeError):
        ComposedLayout(Layout(8, 1), SW333)


# ------------------------------------------------------------- shared-memory banks
# 2-byte elements, 64-element (128-byte) rows, tiles of 64 columns: what one 16-byte
# vector store per thread (8 threads per phase) and one ldmatrix 8x8 phase touch.
# Bank group = (byte_address // 16) % 8: the four 4-byte banks one 16-byte access uses.


def smem_tile(rows: int, d: int, swizzled: bool):
    layout = Layout(((rows,), (64, d // 64)), ((64,), (1, rows * 64)))
    return ComposedLayout(SW333, layout) if swizzled else layout


def bank_group(tile, r: int, col: int) -> int:
    return (tile((r, col)) * 2 // 16) % 8


def conflict_degree(groups: list[int]) -> int:
    return max(Counter(groups).values())


@pytest.mark.parametrize("rows", [32, 64, 128])
@pytest.mark.parametrize("d", [64, 128])
def test_swizzled_tile_is_bank_conflict_free(rows, d):
    tile = smem_tile(rows, d, swizzled=True)
    chunks = d // 8
    for r in range(rows):
        for c in range(chunks):  # a 16-byte chunk stays 8 contiguous elements
            base = tile((r, 8 * c))
            assert [tile((r, 8 * c + e)) for e in range(8)] == list(range(base, base + 8))
        for c0 in range(0, chunks, 8):  # 8 consecutive chunks of one row
            assert conflict_degree([bank_group(tile, r, 8 * (c0 + k)) for k in range(8)]) == 1
    for r0 in range(0, rows, 8):  # ldmatrix phase: rows r0..r0+7, same chunk column
        for c in range(chunks):
            assert conflict_degree([bank_group(tile, r0 + k, 8 * c) for k in range(8)]) == 1


@pytest.mark.parametrize("rows", [32, 64, 128])
@pytest.mark.parametrize("d", [64, 128])
def test_unswizzled_tile_has_8_way_column_conflicts(rows, d):
    tile = smem_tile(rows, d, swizzled=False)
    for r0, c in itertools.product(range(0, rows, 8), range(d // 8)):
        assert conflict_degree([bank_group(tile, r0 + k, 8 * c) for k in range(8)]) == 8
    # rows themselves are conflict free without the swizzle
    assert conflict_degree([bank_group(tile, 0, 8 * k) for k in range(8)]) == 1
