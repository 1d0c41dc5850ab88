"""Bounds of a mod's integers (flashgen.mods.ranges) and the fast int -> float conversion they allow."""
from __future__ import annotations

import numpy as np
import torch

from flashgen.mods import prepare
from flashgen.mods.expr import Cast, postorder
from flashgen.mods.kernel_mods import prepare_mods
from flashgen.mods.ranges import INDEX_LIMIT, SMALL, fast_casts, int_ranges

TABLE = torch.arange(10)


def _casts(fn):
    mod, _ = prepare(fn, "score")
    casts = [n for n in postorder(mod.expr) if isinstance(n, Cast) and n.x.dtype == "int32"]
    return casts, fast_casts(mod.expr), int_ranges(mod.expr)


def test_index_differences_are_small_and_their_bounds_are_exact():
    casts, fast, ranges = _casts(lambda s, b, h, q, k: s - 0.5 * (q - k).abs() + (h * 3 - b))
    assert len(casts) == 2 and set(casts) == fast
    bounds = sorted(ranges[c.x] for c in casts)
    assert bounds == sorted([(0, INDEX_LIMIT - 1), (-(2**16 - 1), 3 * (2**16 - 1))])


def test_loaded_scaled_or_captured_ints_keep_the_plain_conversion():
    n = 7
    for fn in (lambda s, b, h, q, k: s + TABLE[q % 10],  # a load: unbounded
               lambda s, b, h, q, k: s + q * 4096,  # past 2^22
               lambda s, b, h, q, k: s + (q - n)):  # a captured number: unbounded
        casts, fast, _ = _casts(fn)
        assert casts and not fast


def test_floor_division_and_modulo_by_constants_are_bounded():
    casts, fast, ranges = _casts(lambda s, b, h, q, k: s + (q // 64) + (k % 7))
    assert set(casts) == fast and {ranges[c.x] for c in casts} <= {(0, (INDEX_LIMIT - 1) // 64), (0, 6), (0, (INDEX_LIMIT - 1) // 64 + 6)}


def test_the_bit_trick_is_exact_on_its_whole_range():
    """fg_i2f_small: x's bits added to those of 1.5 * 2^23, minus 1.5 * 2^23, equals float(x) on [-2^22, 2^22)."""
    x = np.concatenate([np.arange(-SMALL, -SMALL + 4096), np.arange(-4096, 4096), np.arange(SMALL - 4096, SMALL),
                        np.random.default_rng(0).integers(-SMALL, SMALL, 100_000)]).astype(np.int32)
    magic = np.float32(1.5 * 2**23)
    got = (np.int32(magic.view(np.int32)) + x).view(np.float32) - magic
    assert np.array_equal(got, x.astype(np.float32))


def test_kernels_with_fast_conversions_state_their_sequence_limit():
    with_fast, _ = prepare_mods(lambda s, b, h, q, k: s - 0.25 * (q - k))
    plain, _ = prepare_mods(lambda s, b, h, q, k: s + TABLE[q % 10])
    assert with_fast.index_limit == INDEX_LIMIT and plain.index_limit is None
