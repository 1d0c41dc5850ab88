"""flashgen.mods.diagonal: a mask_mod's diagonal conjuncts as the built-in top-left window, the rest as a mask_mod.

The oracle is the user's function itself, called on torch index tensors as FlexAttention calls it: on every
(b, h, q_idx, kv_idx) of a small grid, the built-in rule's keep (ScoreMask, kind "window", top-left) with the
split's (left, right), and the rest's trace, must keep exactly what the function keeps.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings, strategies as st  # noqa: E402

from flashgen.attention.score_mask import ScoreMask  # noqa: E402
from flashgen.mods import trace  # noqa: E402
from flashgen.mods.diagonal import LIMIT, combine, split  # noqa: E402
from flashgen.mods.expr import INT32_MAX  # noqa: E402

SEQ_Q, SEQ_K, BATCH, HEADS = 9, 11, 2, 3
B, H, Q, KV = np.meshgrid(np.arange(BATCH), np.arange(HEADS), np.arange(SEQ_Q), np.arange(SEQ_K), indexing="ij")


def _brute(fn) -> np.ndarray:
    """What ``fn`` keeps on the grid, computed by torch on int64 index tensors (no tracing)."""
    args = [torch.from_numpy(x.astype(np.int64)) for x in (B, H, Q, KV)]
    out = fn(*args)
    return np.broadcast_to(out.numpy() if isinstance(out, torch.Tensor) else np.asarray(out), Q.shape).astype(bool)


def _builtin(left: int, right: int) -> np.ndarray:
    """What the built-in window (top-left, kind "window") keeps on the grid."""
    rule = ScoreMask("window", 64, 64)
    keep = np.array([[rule.keep(i, j, SEQ_K, 0, left, right) for j in range(SEQ_K)] for i in range(SEQ_Q)])
    return np.broadcast_to(keep, Q.shape)


def _split_keeps(fn):
    """(the split's Diagonal, what the built-in window and the rest's trace keep together), or (None, None)."""
    found = trace(fn, "mask").diagonal
    if found is None:
        return None, None
    diagonal, rest = found
    keep = _builtin(*diagonal.window)
    if rest is not None:
        values = rest.bind(fn).values()
        keep = keep & np.broadcast_to(rest.evaluate(B, H, Q, KV, args=values), Q.shape)
    return diagonal, keep


# ---- the forms of the docstring ------------------------------------------------------------------

FORMS = [  # (mask_mod, (lo, hi) on q_idx - kv_idx)
    (lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, (0, None)),
    (lambda b, h, q_idx, kv_idx: kv_idx <= q_idx, (0, None)),
    (lambda b, h, q_idx, kv_idx: q_idx - kv_idx >= 0, (0, None)),
    (lambda b, h, q_idx, kv_idx: 0 <= q_idx - kv_idx, (0, None)),
    (lambda b, h, q_idx, kv_idx: q_idx - kv_idx <= 3, (None, 3)),
    (lambda b, h, q_idx, kv_idx: kv_idx >= q_idx - 3, (None, 3)),
    (lambda b, h, q_idx, kv_idx: kv_idx + 3 >= q_idx, (None, 3)),
    (lambda b, h, q_idx, kv_idx: kv_idx - q_idx <= 2, (-2, None)),
    (lambda b, h, q_idx, kv_idx: kv_idx < q_idx + 3, (-2, None)),
    (lambda b, h, q_idx, kv_idx: ~(kv_idx > q_idx), (0, None)),
    (lambda b, h, q_idx, kv_idx: q_idx == kv_idx, (0, 0)),
    (lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx <= 4), (0, 4)),
    (lambda b, h, q_idx, kv_idx: torch.logical_and(q_idx - kv_idx < 5, -(kv_idx - q_idx) > -3), (-2, 4)),
    (lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & ((kv_idx >= q_idx - 5) & (q_idx - kv_idx <= 2)), (0, 2)),
]


@pytest.mark.parametrize("fn, bounds", FORMS)
def test_each_diagonal_form_becomes_its_window_and_keeps_what_the_function_keeps(fn, bounds):
    diagonal, keep = _split_keeps(fn)
    assert (diagonal.lo, diagonal.hi) == bounds and diagonal.rest is None
    np.testing.assert_array_equal(keep, _brute(fn))


def test_the_rest_keeps_the_other_conjuncts_in_their_order_with_their_captured_values():
    doc = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 3])
    shift = 2

    def fn(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx) & (h != b + shift - 2) & (kv_idx > q_idx - 4)

    diagonal, keep = _split_keeps(fn)
    assert (diagonal.lo, diagonal.hi) == (0, 3)
    rest = trace(fn, "mask").diagonal[1]
    assert [s.source.name for s in rest.scalars] == ["shift"] and [t.source.name for t in rest.tensors] == ["doc"]
    assert rest.arguments_read == {"b", "h", "q_idx", "kv_idx"}
    np.testing.assert_array_equal(keep, _brute(fn))
    shift = 3  # the rest reads the captured number anew
    np.testing.assert_array_equal(_split_keeps(fn)[1], _brute(fn))


# ---- what stays a mask_mod -----------------------------------------------------------------------

def test_captured_numbers_float_literals_and_disjunctions_stay_mask_mods():
    c = 1
    prefix = 3
    stays = [
        lambda b, h, q_idx, kv_idx: q_idx > kv_idx + c,  # a captured number: a run-time value
        lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) | (kv_idx < prefix),  # a disjunction
        lambda b, h, q_idx, kv_idx: q_idx - kv_idx <= 2.5,  # a float comparison
        lambda b, h, q_idx, kv_idx: q_idx > kv_idx,  # d >= 1: no window holds it
        lambda b, h, q_idx, kv_idx: kv_idx - q_idx >= 1,  # d <= -1
        lambda b, h, q_idx, kv_idx: q_idx != kv_idx,
        lambda b, h, q_idx, kv_idx: 2 * q_idx >= 2 * kv_idx,  # not q_idx - kv_idx
        lambda b, h, q_idx, kv_idx: q_idx + h >= kv_idx,  # reads h
        lambda b, h, q_idx, kv_idx: q_idx - kv_idx <= LIMIT,  # a window past the sizes the built-in rule takes
    ]
    for fn in stays:
        assert trace(fn, "mask").diagonal is None
        assert split(trace(fn, "mask").expr) is None


def test_conjuncts_no_window_holds_stay_in_the_rest_beside_those_that_split():
    def fn(b, h, q_idx, kv_idx):
        return (q_idx > kv_idx) & (q_idx - kv_idx <= 5) & (h == 1)

    diagonal, keep = _split_keeps(fn)
    assert (diagonal.lo, diagonal.hi) == (None, 5) and diagonal.rest is not None
    np.testing.assert_array_equal(keep, _brute(fn))


def test_a_score_mod_has_no_diagonal():
    assert trace(lambda s, b, h, q_idx, kv_idx: s + (q_idx >= kv_idx), "score").diagonal is None


# ---- exactness in int32 --------------------------------------------------------------------------

def test_lengths_at_which_a_side_could_leave_int32_keep_the_mask_mod():
    big = 2_000_000_000
    diagonal = split(trace(lambda b, h, q_idx, kv_idx: kv_idx + 2_000_000_000 >= q_idx + 1_999_999_990, "mask").expr)
    assert (diagonal.lo, diagonal.hi) == (None, 10)
    assert diagonal.max_seq == INT32_MAX - big + 1  # kv_idx + big stays in int32 for kv_idx < max_seq
    assert diagonal.exact_for(diagonal.max_seq, 5) and not diagonal.exact_for(5, diagonal.max_seq + 1)
    assert split(trace(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, "mask").expr).max_seq == LIMIT
    low = split(trace(lambda b, h, q_idx, kv_idx: (q_idx - 2_000_000_000) - kv_idx <= -2_000_000_000 + 7, "mask").expr)
    assert (low.lo, low.hi) == (None, 7) and low.max_seq == 147483649  # q - big - kv >= INT32_MIN needs q, kv small


# ---- combining with the call's own window --------------------------------------------------------

@given(st.integers(-3, 6), st.integers(-3, 6), st.integers(-3, 6), st.integers(-3, 6))
def test_combine_keeps_what_both_windows_keep(l1, r1, l2, r2):
    both = _builtin(l1, r1) & _builtin(l2, r2)
    np.testing.assert_array_equal(_builtin(*combine((l1, r1), (l2, r2))), both)


# ---- random conjunctions against the function itself ---------------------------------------------

_ATOM = st.one_of(st.integers(-4, 4), st.sampled_from(["q_idx", "kv_idx", 1, 2, -3]))  # mostly literals
_SIDE = st.lists(st.tuples(st.sampled_from(["+", "-"]), _ATOM), min_size=0, max_size=3)
_OP = st.sampled_from(["<", "<=", ">", ">=", "==", "!="])
_DIAGONAL = st.tuples(st.sampled_from(["q_idx", "kv_idx"]), _SIDE, _OP, st.sampled_from(["q_idx", "kv_idx", "0"]), _SIDE,
                      st.booleans())
_DIAGONAL = st.one_of(_DIAGONAL, _DIAGONAL.filter(lambda d: d[0] != d[3]))
_OTHER = st.sampled_from(["h % 2 == 0", "DOC[q_idx] == DOC[kv_idx]", "b <= h", "(q_idx + kv_idx) % 3 != 1",
                          "q_idx == q_idx", "q_idx + SHIFT >= kv_idx"])
_CONJUNCT = st.one_of(_DIAGONAL, _OTHER)
DOC = torch.tensor([0, 0, 1, 1, 1, 1, 2, 3, 3, 3, 3])


def _conjunct(spec) -> str:
    """A conjunct's source: one of the other conditions, or a comparison of two sums of indices and literals."""
    if isinstance(spec, str):
        return f"({spec})"
    head, left, op, other, right, negate = spec
    text = " ".join([head] + [f"{s} {a}" for s, a in left] + [op, other] + [f"{s} {a}" for s, a in right])
    return f"~({text})" if negate else f"({text})"


def _conjunction(specs: list, shape: list):
    """A plain function (literals in its code, DOC and SHIFT captured) returning the conjunction of ``specs``,
    nested as ``shape`` says (True: the next conjunct joins on the right)."""
    text = _conjunct(specs[0])
    for spec, nest in zip(specs[1:], shape):
        text = f"({text}) & {_conjunct(spec)}" if nest else f"{_conjunct(spec)} & ({text})"
    scope = {"DOC": DOC, "SHIFT": 2, "torch": torch}
    exec(f"def fn(b, h, q_idx, kv_idx):\n    return {text}\n", scope)  # noqa: S102 - generated test functions
    return scope["fn"]


@settings(max_examples=300, deadline=None)
@given(st.lists(_CONJUNCT, min_size=1, max_size=4), st.lists(st.booleans(), min_size=3, max_size=3))
def test_random_conjunctions_split_into_a_window_and_a_rest_that_keep_what_the_function_keeps(specs, shape):
    fn = _conjunction([_conjunct(s) for s in specs], shape)
    diagonal, keep = _split_keeps(fn)
    if diagonal is None:
        return  # nothing to split: the mask_mod stays as it is
    assert diagonal.exact_for(SEQ_Q, SEQ_K)
    np.testing.assert_array_equal(keep, _brute(fn))


def test_random_conjunctions_do_split():
    """The property above is not vacuous: conjunctions with a usable diagonal conjunct split."""
    fn = _conjunction(["DOC[q_idx] == DOC[kv_idx]", ("kv_idx", [("+", 2)], ">=", "q_idx", [], False), "h % 2 == 0"],
                      [True, False, True])
    diagonal, keep = _split_keeps(fn)
    assert (diagonal.lo, diagonal.hi) == (None, 2)
    np.testing.assert_array_equal(keep, _brute(fn))


def test_the_emitted_kernels_manifest_names_the_window_calls_run_the_diagonal_as():
    from flashgen.dsl.config import KernelConfig
    from flashgen.engines import emit
    from flashgen.mods import KernelMods

    def causal_document(b, h, q_idx, kv_idx):
        return (DOC[q_idx] == DOC[kv_idx]) & (q_idx - kv_idx <= 7) & (kv_idx <= q_idx)

    meta = emit(KernelConfig(dtype="fp16", d_head=64), KernelMods(mask=trace(causal_document, "mask"))).meta["mods"]
    assert meta["mask_diagonal"] == {"window": [7, 0], "align": "top_left", "rest": meta["mask_mod"] + " less its diagonal"}
    assert KernelMods(mask=trace(lambda b, h, q_idx, kv_idx: kv_idx <= q_idx, "mask")).manifest()["mask_diagonal"] == {
        "window": [-1, 0], "align": "top_left", "rest": None}
    assert KernelMods(mask=trace(lambda b, h, q_idx, kv_idx: DOC[q_idx] == DOC[kv_idx], "mask")).manifest()["mask_diagonal"] is None


def test_the_trace_a_call_splits_follows_new_code_and_changed_literal_kept_numbers():
    from flashgen.mods.cache import current

    width = 3

    def window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= int(width))  # int(): compiled in as a literal

    assert current(window, "mask").diagonal[0].window == (3, 0)
    assert current(window, "mask") is current(window, "mask")  # no retrace while nothing changed
    width = 9
    assert current(window, "mask").diagonal[0].window == (9, 0)
    window.__code__ = (lambda b, h, q_idx, kv_idx: (kv_idx - q_idx <= 4) | (width < 0)).__code__
    assert current(window, "mask").diagonal is None
