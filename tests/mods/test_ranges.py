"""Splitting int -> float conversions of index arithmetic (flashgen.mods.ranges): which casts split, and the
sequence limit of kernels that have them. The rendered split's bits are checked against numpy by every
host-compiled mod test (tests/mods/host.py calls the functions with split indices)."""
from __future__ import annotations

import torch

from flashgen.mods import prepare
from flashgen.mods.expr import Cast, postorder
from flashgen.mods.kernel_mods import prepare_mods
from flashgen.mods.ranges import EXACT, INDEX_LIMIT, int_ranges, split_casts

TABLE = torch.arange(10)


def _split(fn):
    mod, _ = prepare(fn, "score")
    casts = [n for n in postorder(mod.expr) if isinstance(n, Cast) and n.x.dtype == "int32"]
    return casts, split_casts(mod.expr)


def test_affine_index_arithmetic_splits_with_its_literal_coefficients():
    casts, split = _split(lambda s, b, h, q, k: s - 0.5 * (q - k) + (2 * q - k + h) + (3 - k) * 2)
    assert len(casts) == 3 and set(split) == set(casts)
    assert sorted(split.values()) == sorted([(1, -1), (2, -1), (0, -2)])


def test_casts_that_do_not_split():
    n = 7
    for fn in (lambda s, b, h, q, k: s + TABLE[q % 10],  # a load
               lambda s, b, h, q, k: s + (q - k).abs(),  # not affine
               lambda s, b, h, q, k: s + q * k,  # not affine
               lambda s, b, h, q, k: s + (q - n) * n,  # a captured number: no literal coefficient, unbounded
               lambda s, b, h, q, k: s + q * 8,  # past 2^24 for the longest sequences taken
               lambda s, b, h, q, k: s + (h - b)):  # no index: nothing per score to save
        casts, split = _split(fn)
        assert casts and not split, fn


def test_bounds_follow_the_index_limit():
    mod, _ = prepare(lambda s, b, h, q, k: s + (q - k), "score")
    (cast,) = split_casts(mod.expr)
    assert int_ranges(mod.expr)[cast.x] == (-(INDEX_LIMIT - 1), INDEX_LIMIT - 1)
    assert 4 * INDEX_LIMIT <= EXACT  # room for small multiples of an index


def test_kernels_with_split_conversions_state_their_sequence_limit():
    with_split, _ = prepare_mods(lambda s, b, h, q, k: s - 0.25 * (q - k))
    plain, _ = prepare_mods(lambda s, b, h, q, k: s + TABLE[q % 10])
    assert with_split.index_limit == INDEX_LIMIT and plain.index_limit is None
