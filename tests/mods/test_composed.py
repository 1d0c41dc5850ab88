"""Mods that call other functions through their captures: FlexAttention's ``and_masks`` / ``or_masks``, masks
composed by hand, helpers read from the globals. What those functions capture is traced as the mod's own
captures are: a new number or tensor flows into the same kernel, a new function retraces."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from flashgen.mods import ModError, prepare_mods
from flashgen.mods.call_values import CallValues

flex = pytest.importorskip("torch.nn.attention.flex_attention")

N = 24
DOC = torch.tensor([0] * 5 + [1] * 7 + [2] * 12)
EDGE = 9  # a global number a helper reads


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def document(b, h, q_idx, kv_idx):
    return DOC[q_idx] == DOC[kv_idx]


def below_edge(b, h, q_idx, kv_idx):
    return kv_idx < EDGE


def _evaluated(fn) -> np.ndarray:
    """The traced mask_mod evaluated on every (query, key) pair of N x N, as the simulators evaluate it."""
    mods, (_, mask_args) = prepare_mods(None, fn)
    i, j = np.arange(N)[:, None], np.arange(N)[None, :]
    return np.broadcast_to(mods.mask.evaluate(0, 0, i, j, args=mask_args.values()), (N, N))


def _by_torch(fn) -> np.ndarray:
    idx = torch.arange(N)
    return fn(torch.tensor(0), torch.tensor(0), idx[:, None], idx[None, :]).expand(N, N).numpy()


def _prefix(n):
    def prefix(b, h, q_idx, kv_idx):
        return kv_idx < n
    return prefix


@pytest.mark.parametrize("make", [
    lambda: flex.and_masks(causal, document),
    lambda: flex.or_masks(causal, _prefix(7)),
    lambda: flex.or_masks(_prefix(3), flex.and_masks(causal, document)),
    lambda: flex.and_masks(causal, below_edge),
    lambda: (lambda b, h, q_idx, kv_idx: causal(b, h, q_idx, kv_idx) & ~document(b, h, q_idx, kv_idx)),
], ids=["and_masks", "or_masks", "nested", "global_number", "by_hand"])
def test_composed_masks_trace_to_what_torch_evaluates(make):
    fn = make()
    np.testing.assert_array_equal(_evaluated(fn), _by_torch(fn))


def test_and_masks_with_causal_runs_the_causal_part_as_the_built_in_mask():
    mods, _ = prepare_mods(None, flex.and_masks(causal, document))
    assert mods.mask.diagonal is not None


def test_new_values_of_a_composed_masks_captures_keep_its_kernel():
    """A number in a part's closure and a tensor a part reads from its globals are the kernel's arguments: new
    values give the same kernel key and the new mask."""
    global DOC
    before = DOC
    try:
        fn = flex.or_masks(_prefix(3), flex.and_masks(causal, document))
        key = prepare_mods(None, fn)[0].mask.key
        assert prepare_mods(None, flex.or_masks(_prefix(11), flex.and_masks(causal, document)))[0].mask.key == key
        DOC = torch.tensor([0] * 20 + [1] * 4)
        assert prepare_mods(None, fn)[0].mask.key == key
        np.testing.assert_array_equal(_evaluated(fn), _by_torch(fn))
    finally:
        DOC = before


def test_a_helpers_captured_number_is_read_at_every_call():
    """A global number a helper reads is the mod's run-time scalar: a new value reaches the next call (it was once
    compiled in as a literal and never read again)."""
    global EDGE
    before = EDGE

    def mask(b, h, q_idx, kv_idx):
        return below_edge(b, h, q_idx, kv_idx) & causal(b, h, q_idx, kv_idx)

    key = prepare_mods(None, mask)[0].mask.key
    try:
        EDGE = 3
        assert prepare_mods(None, mask)[0].mask.key == key
        np.testing.assert_array_equal(_evaluated(mask), _by_torch(mask))
    finally:
        EDGE = before


def test_a_new_helper_function_retraces():
    """The function a mod calls is compiled in: rebinding the global to another one makes a new trace."""
    global below_edge
    before = below_edge

    def mask(b, h, q_idx, kv_idx):
        return below_edge(b, h, q_idx, kv_idx) & causal(b, h, q_idx, kv_idx)

    first = _evaluated(mask)
    try:
        below_edge = lambda b, h, q_idx, kv_idx: kv_idx >= EDGE  # noqa: E731
        np.testing.assert_array_equal(_evaluated(mask), _by_torch(mask))
        assert not np.array_equal(_evaluated(mask), first)
    finally:
        below_edge = before


def test_call_values_read_a_parts_captures_where_they_live():
    """The fast path reads a part's global number and tensor from that part's own globals: a new value reads as
    the full path packs it."""
    global EDGE, DOC
    fn = flex.and_masks(below_edge, document)
    mods, (sa, ma) = prepare_mods(None, fn)
    reader = CallValues(mods, None, fn)
    before = EDGE, DOC
    try:
        EDGE, DOC = 4, torch.tensor([1] * 12 + [2] * 12)
        words, tensors = reader.read(torch.device("cpu"))
        mods, (sa, ma) = prepare_mods(None, fn)
        want_words, want_tensors = mods.pack(sa, ma)
        assert words == want_words and [t.tolist() for t in tensors] == [t.tolist() for t in want_tensors]
    finally:
        EDGE, DOC = before


@pytest.mark.parametrize("call, match", [
    (lambda b: b.new_ones((2,), dtype=torch.bool), r"new_ones\(\(2,\).*0-d constants"),
    (lambda b: b.new_full((), 1.5, dtype=torch.float16), "dtype=torch.float16"),
])
def test_a_constant_of_another_size_or_dtype_is_refused_by_name(call, match):
    with pytest.raises(ModError, match=match):
        prepare_mods(None, lambda b, h, q_idx, kv_idx: call(b) & (q_idx >= kv_idx))


def test_flex_noop_mask_keeps_every_score_and_calls_run_without_a_mask():
    """FlexAttention's default mask_mod (``b.new_ones((), dtype=bool, device=b.device)``) traces to a constant; a
    call with it runs as a call without one."""
    assert _evaluated(flex.noop_mask).all()
    assert prepare_mods(None, flex.noop_mask, diagonal=True) == (None, (None, None))
    mods, _ = prepare_mods(lambda s, b, h, q_idx, kv_idx: s * 2, flex.noop_mask, diagonal=True)
    assert mods.mask is None and mods.score is not None


def test_attention_gyms_alibi_traces_as_a_bias():
    """ALiBi written with the slope computed inside the mod, ``exp2(-(h + 1) * 8 / H)``: the score plus a bias (the
    kernels add it before the S GEMM), equal to torch's evaluation."""
    from flashgen.mods.bias import bias_over_scale

    heads = 4

    def alibi(score, b, h, q_idx, kv_idx):
        return score + (kv_idx - q_idx) * torch.exp2(-((h + 1) * 8.0 / heads))

    mods, (score_args, _) = prepare_mods(alibi, None)
    assert bias_over_scale(mods.score.expr) is not None
    s = np.random.default_rng(0).normal(size=(1, heads, N, N)).astype(np.float32)
    b, h, i, j = (np.arange(n).reshape(shape) for n, shape in ((1, (1, 1, 1, 1)), (heads, (1, heads, 1, 1)),
                                                                (N, (1, 1, N, 1)), (N, (1, 1, 1, N))))
    got = np.broadcast_to(mods.score.evaluate(s, b, h, i, j, args=score_args.values()), s.shape)
    want = alibi(torch.from_numpy(s), *(torch.from_numpy(x.astype(np.int32)) for x in (b, h, i, j))).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)
