"""Layout algebra: every operation is checked by its postcondition at every coordinate."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashgen.dsl.layout import Layout, flatten, make_layout, product

FAST = settings(max_examples=150, deadline=None)

# ------------------------------------------------------------------------ oracles


def colex_oracle(layout: Layout) -> list[int]:
    """Offsets by an independent formula: numpy's Fortran-order unravel over the leaves."""
    shapes = flatten(layout.shape)
    strides = np.array(flatten(layout.stride))
    return [int(np.dot(np.unravel_index(i, shapes, order="F"), strides)) for i in range(layout.size)]


def all_offsets(layout) -> list[int]:
    return [layout(i) for i in range(layout.size)]


def cpp_eval(text: str, env: dict[str, int]) -> int:
    """Evaluate rendered C++ in Python: for non-negative ints C++ ``/`` is ``//``."""
    return eval(compile(text.replace("/", "//"), "<cpp>", "eval"), {"__builtins__": {}}, env)


def mode_coords(layout: Layout, i: int) -> tuple[int, ...]:
    """1-D index -> one int per top-level mode (colexicographic over mode sizes)."""
    sizes = [m.size for m in layout.modes()]
    return tuple(int(c) for c in np.unravel_index(i, sizes, order="F"))


def nested_coord(shape, i: int):
    """1-D index -> coordinate congruent to ``shape``."""
    leaves = [int(c) for c in np.unravel_index(i, flatten(shape), order="F")]
    it = iter(leaves)

    def build(s):
        return next(it) if isinstance(s, int) else tuple(build(e) for e in s)

    return build(shape)


# --------------------------------------------------------------------- strategies


def _shape_tree(leaf: st.SearchStrategy[int]) -> st.SearchStrategy:
    return st.recursive(
        leaf,
        lambda sub: st.lists(sub, min_size=1, max_size=3).map(tuple),
        max_leaves=5,
    )


def _strides_for(draw, shape, stride_leaf: st.SearchStrategy[int]):
    if isinstance(shape, int):
        return draw(stride_leaf)
    return tuple(_strides_for(draw, s, stride_leaf) for s in shape)


@st.composite
def layouts(draw, shape_leaf=st.integers(1, 6), stride_leaf=st.integers(0, 40), max_size=600):
    shape = draw(_shape_tree(shape_leaf).filter(lambda s: product(s) <= max_size))
    return Layout(shape, _strides_for(draw, shape, stride_leaf))


POW2_SHAPE = st.sampled_from([1, 2, 4, 8])
POW2_STRIDE = st.sampled_from([0, 1, 2, 4, 8, 16, 32, 64])


def pow2_layouts(max_size=512):
    return layouts(POW2_SHAPE, POW2_STRIDE, max_size)


@st.composite
def injective_layouts(draw, shape_leaf=st.integers(1, 5), gap=st.integers(1, 3)):
    """Injective layouts with sortable strides: sorted modes leave integer gaps."""
    n = draw(st.integers(1, 4))
    modes, cur = [], 1
    for _ in range(n):
        s, g = draw(shape_leaf), draw(gap)
        modes.append((s, cur * g))
        cur = s * cur * g
    modes = draw(st.permutations(modes))
    shapes, strides = [s for s, _ in modes], [d for _, d in modes]
    if n >= 2 and draw(st.booleans()):  # nest the first two modes
        return Layout(((shapes[0], shapes[1]), *shapes[2:]), ((strides[0], strides[1]), *strides[2:]))
    return Layout(tuple(shapes), tuple(strides))


def extent(layout: Layout) -> int:
    """max(shape * stride) over leaves: the span that complement() fills up to."""
    return max([s * d for s, d in layout.flat_modes()] + [1])


# ----------------------------------------------------------------- construction


def test_lists_become_tuples_and_values_hash():
    a = Layout([[8, 8], 4], [[64, 512], 1])
    assert a.shape == ((8, 8), 4) and a.stride == ((64, 512), 1)
    assert a == Layout(((8, 8), 4), ((64, 512), 1))
    assert hash(a) == hash(Layout(((8, 8), 4), ((64, 512), 1)))
    assert Layout(8, 1) != Layout((8,), (1,))
    assert len({Layout(8, 1), Layout(8, 1), Layout(8, 2)}) == 2


@pytest.mark.parametrize(
    "shape, stride, match",
    [
        ((2, 3), (1,), r"shape \(2,3\) and stride \(1\) are not congruent"),
        ((2, 3), 1, r"shape \(2,3\) and stride 1 are not congruent"),
        (((2, 2), 3), ((1, 2), (6, 1)), r"not congruent"),
        ((4, 0), (1, 4), r"shape entries must be >= 1; got shape \(4,0\)"),
        (8, -1, r"stride entries must be >= 0; got stride -1"),
        ((2, "a"), (1, 2), r"shape must be an int or a nested tuple of ints; got \(2, 'a'\)"),
        ((2, 2), (1.5, 2), r"stride must be an int or a nested tuple of ints"),
        ((), (), r"must not contain an empty tuple"),
        (True, 1, r"shape must be an int"),
    ],
)
def test_invalid_layouts_are_rejected(shape, stride, match):
    with pytest.raises(ValueError, match=match):
        Layout(shape, stride)


def test_row_and_col_major():
    assert Layout.row_major((4, 6)) == Layout((4, 6), (6, 1))
    assert Layout.col_major((4, 6)) == Layout((4, 6), (1, 4))
    assert Layout.row_major([2, 3, 4]) == Layout((2, 3, 4), (12, 4, 1))
    assert Layout.col_major(8) == Layout(8, 1)
    assert Layout.col_major(((2, 4), 3)) == Layout(((2, 4), 3), ((1, 2), 8))
    rm = Layout.row_major((3, 5, 2))
    for idx in itertools.product(range(3), range(5), range(2)):
        assert rm(idx) == np.ravel_multi_index(idx, (3, 5, 2), order="C")


def test_size_cosize_rank_depth_getitem():
    a = Layout(((8, 8), (64, 2)), ((64, 512), (1, 4096)))
    assert (a.size, a.rank, a.depth) == (8 * 8 * 64 * 2, 2, 2)
    assert a.cosize == max(all_offsets(a)) + 1
    assert a[0] == Layout((8, 8), (64, 512)) and a[1] == Layout((64, 2), (1, 4096))
    assert a[-1] == a[1]
    assert Layout(8, 2).rank == 1 and Layout(8, 2).depth == 0 and Layout(8, 2)[0] == Layout(8, 2)
    assert Layout(8, 2).cosize == 15 and Layout(8, 0).cosize == 1
    assert Layout((4,), (3,)).depth == 1
    with pytest.raises(IndexError, match="mode 2 out of range"):
        a[2]


# -------------------------------------------------------------------- evaluation


@FAST
@given(layouts())
def test_eval_matches_independent_formula(a):
    assert all_offsets(a) == colex_oracle(a)
    assert a.cosize == max(colex_oracle(a)) + 1


@FAST
@given(layouts())
def test_bulk_offsets_match_independent_formula(a):
    """Layout.offsets (every coordinate at once, numpy) against the Fortran-order oracle."""
    out = a.offsets()
    assert out.dtype == np.int64 and out.tolist() == colex_oracle(a)
    assert not out.flags.writeable  # memoized: callers must not change a shared table


@FAST
@given(layouts(), st.data())
def test_offsets_at_matches_tuple_coordinates(a, data):
    idx = np.array(data.draw(st.lists(st.integers(0, a.size - 1), min_size=1, max_size=20)))
    coords = [mode_coords(a, int(i)) for i in idx]
    per_mode = [np.array([c[k] for c in coords]) for k in range(a.rank)]
    assert a.offsets_at(*per_mode).tolist() == [a(c) for c in coords]


def test_offsets_at_rejects_out_of_range_and_wrong_rank():
    a = Layout((4, 8), (8, 1))
    assert a.offsets_at(np.array([3]), np.array([7])).tolist() == [a((3, 7))]
    with pytest.raises(IndexError, match="outside mode 8"):
        a.offsets_at(np.array([0]), np.array([8]))
    with pytest.raises(IndexError, match="outside mode 4"):
        a.offsets_at(np.array([-1]), np.array([0]))
    with pytest.raises(ValueError, match="1 coordinate arrays for rank-2"):
        a.offsets_at(np.array([0]))


@FAST
@given(layouts())
def test_tuple_coordinates_agree_with_1d(a):
    for i in range(a.size):
        assert a(nested_coord(a.shape, i)) == a(i)
        assert a(mode_coords(a, i)) == a(i)


def test_eval_concrete():
    a = Layout((64, 128), (128, 1))
    assert a((3, 5)) == 3 * 128 + 5 and a(3 + 5 * 64) == 3 * 128 + 5
    b = Layout(((8, 8), (64, 2)), ((64, 512), (1, 4096)))
    assert b((13, 70)) == (13 % 8) * 64 + (13 // 8) * 512 + 6 + 4096
    assert b(((5, 1), (6, 1))) == 5 * 64 + 512 + 6 + 4096
    assert Layout(8, 3)((5,)) == 15
    # a 1-D index past the size extends the last mode (CuTe convention)
    assert Layout((4, 2), (1, 10))(9) == 1 + 2 * 10


@pytest.mark.parametrize(
    "coord, exc, match",
    [
        ((4, 0), IndexError, r"component 4 is out of range for mode 4"),
        ((0, 8), IndexError, r"component 8 is out of range for mode \(2,4\)"),
        (((0, 1), 0), ValueError, r"not congruent to shape 4"),
        ((1, 2, 3), ValueError, r"not congruent to shape \(4,\(2,4\)\)"),
        (-1, IndexError, r"must be >= 0"),
        ("x", ValueError, r"not congruent"),
    ],
)
def test_bad_coordinates(coord, exc, match):
    with pytest.raises(exc, match=match):
        Layout((4, (2, 4)), (1, (4, 8)))(coord)


# --------------------------------------------------------------------------- text


def test_text_forms():
    assert str(Layout((64, 128), (128, 1))) == "(64,128):(128,1)"
    assert str(Layout(((8, 8), (64, 2)), ((64, 512), (1, 4096)))) == "((8,8),(64,2)):((64,512),(1,4096))"
    assert str(Layout(8, 1)) == "8:1"
    assert str(Layout((8,), (1,))) == "(8):(1)"


def test_table():
    expected = "\n".join(
        [
            "(2,3):(3,1)",
            "    0   1   2",
            "  +---+---+---+",
            "0 | 0 | 1 | 2 |",
            "  +---+---+---+",
            "1 | 3 | 4 | 5 |",
            "  +---+---+---+",
        ]
    )
    assert Layout((2, 3), (3, 1)).table() == expected
    t = Layout(((2, 2), 12), ((1, 24), 2)).table()
    assert t.splitlines()[3].split("|")[1:-1][-1].strip() == "22"  # cell (0, 11)
    with pytest.raises(ValueError, match="rank-2"):
        Layout((2, 2, 2), (1, 2, 4)).table()


# ----------------------------------------------------------------------- coalesce


@FAST
@given(layouts())
def test_coalesce_preserves_function_and_is_minimal(a):
    c = a.coalesce()
    assert c.size == a.size
    assert all_offsets(c) == all_offsets(a)
    assert c.depth <= 1
    modes = c.flat_modes()
    if modes != ((1, 0),):
        assert all(s > 1 for s, _ in modes)
    assert not any(d1 == s0 * d0 for (s0, d0), (_, d1) in zip(modes, modes[1:]))
    assert c.coalesce() == c


def test_coalesce_concrete():
    assert Layout((2, (1, 6)), (1, (6, 2))).coalesce() == Layout(12, 1)
    assert Layout((4, 1, 8), (2, 7, 8)).coalesce() == Layout(32, 2)
    assert Layout((4, 3), (3, 1)).coalesce() == Layout((4, 3), (3, 1))
    assert Layout((1, 1), (5, 7)).coalesce() == Layout(1, 0)
    assert Layout((2, 4), (0, 0)).coalesce() == Layout(8, 0)


def test_flatten():
    a = Layout(((8, 8), (64, 2)), ((64, 512), (1, 4096)))
    f = a.flatten()
    assert f == Layout((8, 8, 64, 2), (64, 512, 1, 4096))
    assert all_offsets(f) == all_offsets(a)
    assert Layout(8, 1).flatten() == Layout(8, 1)


# -------------------------------------------------------------------- composition


def check_composition(a: Layout, b: Layout, r: Layout) -> None:
    assert r.size == b.size
    for i in range(b.size):
        assert r(i) == a(b(i)), (str(a), str(b), str(r), i)
    if b.rank > 1:  # R keeps B's top-level modes
        assert r.rank == b.rank
        assert [m.size for m in r.modes()] == [m.size for m in b.modes()]


def test_composition_cute_examples():
    a, b = Layout((6, 2), (8, 2)), Layout((4, 3), (3, 1))
    r = a.composition(b)
    assert r == Layout(((2, 2), 3), ((24, 2), 8))
    check_composition(a, b, r)
    assert Layout(20, 2).composition(Layout((5, 4), (4, 1))) == Layout((5, 4), (8, 2))
    assert Layout((10, 2), (16, 4)).composition(Layout((5, 4), (1, 5))) == Layout((5, (2, 2)), (16, (80, 4)))
    assert Layout((4, 2), (1, 8)).composition(8) == Layout((4, 2), (1, 8))


@FAST
@given(pow2_layouts(), injective_layouts(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4])))
def test_composition_pow2_always_defined(a, b):
    """Power-of-two shapes and strides satisfy both divisibility conditions, and an
    injective power-of-two B occupies disjoint bits, so its modes never carry."""
    check_composition(a, b, a.composition(b))


@settings(max_examples=200, deadline=None)
@given(layouts(max_size=200), layouts(st.integers(1, 6), st.integers(0, 12), max_size=64))
def test_composition_general(a, b):
    try:
        r = a.composition(b)
    except ValueError as e:
        assert "condition fails" in str(e)
        return
    check_composition(a, b, r)


@FAST
@given(injective_layouts())
def test_composition_with_own_right_inverse_is_identity(a):
    r = a.right_inverse()
    for i in range(r.size):
        assert a(r(i)) == i
    check_composition(a, r, a.composition(r))


def test_composition_by_mode():
    a = Layout((12, (4, 8)), (59, (13, 1)))
    tiler = (Layout(3, 4), None)
    r = a.composition(tiler)
    assert r[0] == a[0].composition(Layout(3, 4)) and r[1] == a[1]
    for i, j in itertools.product(range(3), range(32)):
        assert r((i, j)) == a((4 * i, j))
    r2 = a.composition((Layout(3, 4), 8))
    for i, j in itertools.product(range(3), range(8)):
        assert r2((i, j)) == a((4 * i, j))
    with pytest.raises(ValueError, match="3 tilers for rank-2 layout"):
        a.composition((None, None, None))


@pytest.mark.parametrize(
    "a, b, match",
    [
        (Layout((4, 3), (1, 10)), Layout(6, 1), r"shape divisibility condition fails: remaining shape 6 is not a multiple of 4"),
        (Layout((3, 4), (1, 10)), Layout(4, 2), r"stride divisibility condition fails: mode shape 3 is not a multiple of remaining stride 2"),
        (Layout((4, 3), (1, 10)), Layout(2, 6), r"stride divisibility condition fails: remaining stride 6 is not a multiple of mode shape 4"),
        # B(1,1) = 2 carries out of A's first mode: A(2) = 1 but A(1) + A(1) = 0
        (Layout((2, 1), (0, 1)), Layout((2, 2), (1, 1)), r"by-mode distributivity condition fails: .* summing to 2 in mode 2:0"),
        (Layout((4, 3), (1, 10)), Layout((2, 2), (2, 2)), r"by-mode distributivity condition fails"),
    ],
)
def test_composition_errors(a, b, match):
    with pytest.raises(ValueError, match=match):
        a.composition(b)
    assert str(a) in _error(a, b) and str(b) in _error(a, b)


def _error(a, b) -> str:
    try:
        a.composition(b)
    except ValueError as e:
        return str(e)
    raise AssertionError("expected ValueError")


def test_composition_overlapping_modes_in_the_unbounded_last_mode():
    a, b = Layout(8, 1), Layout((2, 2), (1, 1))
    check_composition(a, b, a.composition(b))


def test_composition_within_one_mode_needs_no_divisibility():
    # stride 2 does not divide mode shape 3, but both elements lie inside mode 0
    a, b = Layout((3, 4), (1, 10)), Layout(2, 2)
    check_composition(a, b, a.composition(b))


# --------------------------------------------------------------------- complement


def test_complement_concrete():
    assert Layout(4, 1).complement(24) == Layout(6, 4)
    assert Layout(6, 4).complement(24) == Layout(4, 1)
    assert Layout((4, 6), (1, 4)).complement(24) == Layout(1, 0)
    assert Layout((2, 2), (1, 6)).complement(24) == Layout((3, 2), (2, 12))
    assert Layout((2, 4), (4, 1)).complement() == Layout(1, 0)
    assert Layout((2, 4), (8, 1)).complement() == Layout(2, 4) == Layout((2, 4), (8, 1)).complement(16)
    assert Layout((2, 4), (8, 1)).complement(32) == Layout((2, 2), (4, 16))
    assert Layout((4, 8), (0, 2)).complement(32) == Layout((2, 2), (1, 16))  # stride-0 ignored


@settings(max_examples=200, deadline=None)
@given(injective_layouts().filter(lambda a: extent(a) <= 1024), st.integers(1, 3))
def test_complement_completes_a_bijection(a, k):
    m = extent(a) * k
    c = a.complement(m)
    whole = make_layout(a, c)
    assert whole.size == m
    assert sorted(all_offsets(whole)) == list(range(m))
    strides = [d for s, d in c.flat_modes() if s > 1]
    assert strides == sorted(strides)
    assert c.coalesce() == c


@pytest.mark.parametrize(
    "a, match",
    [
        (Layout((2, 2), (1, 1)), r"\(2,2\):\(1,1\) is not injective with sortable strides: stride 1 is not a multiple of the extent 2"),
        (Layout((2, 2), (1, 3)), r"stride 3 is not a multiple of the extent 2"),
    ],
)
def test_complement_rejects_non_injective(a, match):
    with pytest.raises(ValueError, match=match):
        a.complement(64)


def test_complement_rejects_bad_cotarget():
    with pytest.raises(ValueError, match="cotarget must be an int >= 1"):
        Layout(4, 1).complement(0)


# ------------------------------------------------------------------ divide/product


@st.composite
def divide_cases(draw):
    """(A, tiler): pow2 injective tiler; A's size a multiple of the tiler's extent."""
    tiler = draw(injective_layouts(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2])))
    total = extent(tiler) * draw(st.sampled_from([1, 2, 4]))
    leaves, rest = [], total
    while rest > 1:
        f = math.gcd(draw(st.sampled_from([2, 4, 8])), rest)  # total is a power of two
        leaves.append(f)
        rest //= f
    shape = tuple(leaves) if leaves else (1,)
    stride = tuple(draw(POW2_STRIDE) for _ in shape)
    return Layout(shape, stride), tiler


@settings(max_examples=200, deadline=None)
@given(divide_cases())
def test_logical_divide_laws(case):
    a, tiler = case
    r = a.logical_divide(tiler)
    b = make_layout(tiler, tiler.complement(a.size))
    assert r.size == a.size and r.rank == 2
    assert r[0].size == tiler.size
    for i in range(r.size):
        assert r(i) == a(b(i))
    for j in range(tiler.size):
        assert r((j, 0)) == a(tiler(j))
    assert sorted(all_offsets(r)) == sorted(all_offsets(a))


def test_logical_divide_concrete():
    a = Layout((4, 2, 3), (2, 1, 8))
    r = a.logical_divide(Layout(4, 2))
    assert r == Layout(((2, 2), (2, 3)), ((4, 1), (2, 8)))
    assert a.logical_divide(4) == a.composition(make_layout(Layout(4, 1), Layout(6, 4)))


def test_logical_divide_by_mode_tiles_a_matrix():
    a = Layout.row_major((8, 16))
    r = a.logical_divide((2, Layout(4, 1)))
    assert r.shape == ((2, 4), (4, 4))
    for i, j, k, l in itertools.product(range(2), range(4), range(4), range(4)):
        assert r(((i, j), (k, l))) == a((i + 2 * j, k + 4 * l))
    assert a.logical_divide((None, 4))[0] == a[0]


def test_logical_product_needs_divisible_complement():
    # complement((2):(2), 6) = (2,2):(1,4) cannot hold 3 copies as a layout
    with pytest.raises(ValueError, match="shape divisibility condition fails"):
        Layout((2,), (2,)).logical_product(3)


def test_logical_product_concrete():
    r = Layout((2, 2), (4, 1)).logical_product(Layout(6, 1))
    assert r == Layout(((2, 2), (2, 3)), ((4, 1), (2, 8)))
    assert Layout(4, 1).logical_product(3) == Layout((4, 3), (1, 4))


@settings(max_examples=150, deadline=None)
@given(
    injective_layouts(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2])),
    st.lists(st.sampled_from([1, 2, 4]), min_size=1, max_size=2),
)
def test_logical_product_is_injective_copies(a, b_shape):
    b = Layout.col_major(tuple(b_shape))
    r = a.logical_product(b)
    assert r[0] == a
    assert r.size == a.size * b.size
    offs = all_offsets(r)
    assert len(set(offs)) == len(offs)
    for j in range(b.size):
        base = r((0, j))
        assert [r((i, j)) - base for i in range(a.size)] == all_offsets(a)


def test_right_inverse_concrete():
    a = Layout((4, 8), (8, 1))
    r = a.right_inverse()
    assert r == Layout((8, 4), (4, 1))
    assert [a(r(i)) for i in range(32)] == list(range(32))
    assert Layout(4, 2).right_inverse() == Layout(1, 0)


# ------------------------------------------------------------------------- to_cpp


@settings(max_examples=200, deadline=None)
@given(layouts(max_size=300))
def test_to_cpp_per_mode_matches_call(a):
    names = [f"m{k}" for k in range(a.rank)]
    code = compile(a.to_cpp(names).replace("/", "//"), "<cpp>", "eval")
    for i in range(a.size):
        crd = mode_coords(a, i)
        assert eval(code, {}, dict(zip(names, crd))) == a(crd)


@settings(max_examples=200, deadline=None)
@given(layouts(max_size=300))
def test_to_cpp_1d_and_nested_match_call(a):
    one = compile(a.to_cpp("i").replace("/", "//"), "<cpp>", "eval")
    names = iter(f"v{k}" for k in range(len(flatten(a.shape))))

    def exprs(s):
        return next(names) if isinstance(s, int) else [exprs(e) for e in s]

    nested = exprs(a.shape)
    nested_text = a.to_cpp(nested if isinstance(a.shape, tuple) else [nested])
    nested_code = compile(nested_text.replace("/", "//"), "<cpp>", "eval")
    for i in range(a.size):
        assert eval(one, {}, {"i": i}) == a(i)
        leaves = flatten(nested_coord(a.shape, i))
        env = {f"v{k}": c for k, c in enumerate(leaves)}
        assert eval(nested_code, {}, env) == a(i)


def test_to_cpp_golden_text():
    a = Layout(((8, 8), (64, 2)), ((64, 512), (1, 4096)))
    assert a.to_cpp(["r", "c"]) == "((r % 8) * 64 + (r / 8) * 512 + (c % 64) + (c / 64) * 4096)"
    assert Layout((64, 128), (128, 1)).to_cpp(["row", "col"]) == "(row * 128 + col)"
    assert Layout(8, 1).to_cpp("i") == "i"
    assert Layout(8, 1).to_cpp(["threadIdx.x"]) == "threadIdx.x"
    assert Layout(8, 0).to_cpp("i") == "0"
    assert Layout((4, 2), (0, 1)).to_cpp(["a", "b"]) == "b"
    assert Layout((4, 2), (3, 1)).to_cpp(["a", 1]) == "(a * 3 + 1)"
    assert Layout((4, 2), (3, 1)).to_cpp(["2", "1"]) == "7"
    assert Layout((4, 1), (3, 5)).to_cpp("i") == "(i * 3)"  # shape-1 leaf dropped
    assert Layout((1, (4, 1)), (7, (3, 5))).to_cpp(["a", "b"]) == "(b * 3)"
    assert a.to_cpp(["r", "c"]) == a.to_cpp(["r", "c"])  # deterministic


def test_to_cpp_parenthesizes_compound_expressions():
    a = Layout(((8, 8), 64), ((64, 512), 1))
    text = a.to_cpp(["warp * 16 + lane % 8", "k + 8"])
    assert text == "(((warp * 16 + lane % 8) % 8) * 64 + ((warp * 16 + lane % 8) / 8) * 512 + (k + 8))"
    for warp, lane, k in itertools.product(range(4), range(32), range(0, 56, 7)):
        row = warp * 16 + lane % 8
        assert cpp_eval(text, {"warp": warp, "lane": lane, "k": k}) == a((row, k + 8))


@pytest.mark.parametrize(
    "exprs, match",
    [
        (["a"], r"1 coordinate expressions for rank-2 layout"),
        (["a", ["b", "c"]], r"not congruent to mode 8"),
        (["a", 1.5], r"must be a str or int"),
        (["a", ""], r"empty coordinate expression"),
        (["a", -1], r"must be >= 0"),
        (3.0, r"expected a str or a list"),
    ],
)
def test_to_cpp_errors(exprs, match):
    with pytest.raises(ValueError, match=match):
        Layout((4, 8), (8, 1)).to_cpp(exprs)
