"""The bulk (numpy) evaluation of layouts and swizzles agrees with evaluating one coordinate at a time."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashgen.dsl.layout import Layout
from flashgen.dsl.swizzle import ComposedLayout, Swizzle
from flashgen.sim.layout_eval import offsets, swizzle_array

SW333 = Swizzle(3, 3, 3)


def python_offsets(layout) -> list[int]:
    return [layout(i) for i in range(layout.size)]


@st.composite
def small_layouts(draw):
    shape = draw(
        st.recursive(
            st.integers(1, 6),
            lambda sub: st.lists(sub, min_size=1, max_size=3).map(tuple),
            max_leaves=5,
        )
    )

    def strides(s):
        return draw(st.integers(0, 50)) if isinstance(s, int) else tuple(strides(e) for e in s)

    return Layout(shape, strides(shape))


@settings(max_examples=100, deadline=None)
@given(small_layouts(), st.sampled_from([None, Swizzle(3, 3, 3), Swizzle(2, 1, 3), Swizzle(2, 4, -2)]))
def test_offsets_match_python(layout, swz):
    obj = layout if swz is None else ComposedLayout(swz, layout)
    out = offsets(obj)
    assert out.dtype == np.int64 and out.shape == (obj.size,)
    assert out.tolist() == python_offsets(obj)


@pytest.mark.parametrize(
    "obj",
    [
        ComposedLayout(SW333, Layout((128, 128), (128, 1))),
        ComposedLayout(SW333, Layout(((128,), (64, 2)), ((64,), (1, 128 * 64)))),
        ComposedLayout(SW333, Layout(((8, 16), (64, 2)), ((64, 512), (1, 8192)))),
        Layout((256, 128), (128, 1)),
        Layout(((2, 4), (8, 4), 16), ((1, 64), (2, 16), 256)),
    ],
    ids=str,
)
def test_offsets_large(obj):
    assert offsets(obj).tolist() == python_offsets(obj)


def test_offsets_compact_is_a_permutation():
    out = offsets(ComposedLayout(SW333, Layout((128, 128), (128, 1))))
    assert np.array_equal(np.sort(out), np.arange(128 * 128))


@pytest.mark.parametrize("swz", [SW333, Swizzle(2, 0, -3), Swizzle(0, 3, 0), Swizzle(4, 2, 5)], ids=str)
def test_swizzle_array(swz):
    x = np.arange(4 * swz.period, dtype=np.int64)
    assert swizzle_array(swz, x).tolist() == [swz(int(v)) for v in x]
    rnd = np.random.default_rng(0).integers(0, 1 << 20, 1000)
    assert swizzle_array(swz, rnd).tolist() == [swz(int(v)) for v in rnd]
    assert swizzle_array(swz, x.astype(np.int32)).dtype == np.int64


def test_errors():
    with pytest.raises(ValueError, match="offsets must be >= 0"):
        swizzle_array(SW333, np.array([3, -1]))
    with pytest.raises(ValueError, match="expected a Layout or ComposedLayout"):
        offsets("8:1")
