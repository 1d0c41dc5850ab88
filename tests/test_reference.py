"""``flashgen.reference``: float64 attention against a loop over every (batch, head, query, key),
its autograd backward against finite differences, FlashAttention's tolerance rule, and FlexAttention's
score_mod / mask_mod conventions."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from flashgen import reference  # noqa: E402
from flashgen.reference import attention, check_attention, check_close, gradients, lowp_reference  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
F64 = torch.float64


def kept_by_rule(i: int, j: int, seq_q: int, seq_k: int, causal: bool, window, align: str) -> bool:
    """Whether query i keeps key j under runtime.Attention's causal / window / align contract."""
    diag = i + (seq_k - seq_q if align == "bottom_right" else 0)
    left, right = (-1, 0) if causal else (window or (-1, -1))
    return (left < 0 or j >= diag - left) and (right < 0 or j <= diag + right)


def loop_attention(q, k, v, scale, keep, mod=None):
    """(o, lse) one query row at a time with Python floats; ``keep(b, h, i, j)`` and
    ``mod(s, b, h, i, j)`` are scalar functions; -inf scores count as masked."""
    B, Sq, H, _ = q.shape
    Sk, Hk, Dv = k.shape[1], k.shape[2], v.shape[3]
    ql, kl, vl = q.tolist(), k.tolist(), v.tolist()
    o = torch.zeros(B, Sq, H, Dv, dtype=F64)
    lse = torch.full((B, H, Sq), -math.inf, dtype=F64)
    for b in range(B):
        for h in range(H):
            g = h // (H // Hk)
            for i in range(Sq):
                scores = {}
                for j in range(Sk):
                    if keep(b, h, i, j):
                        s = scale * sum(x * y for x, y in zip(ql[b][i][h], kl[b][j][g]))
                        s = mod(s, b, h, i, j) if mod else s
                        if s != -math.inf:
                            scores[j] = s
                if not scores:
                    continue
                m = max(scores.values())
                z = sum(math.exp(s - m) for s in scores.values())
                lse[b, h, i] = m + math.log(z)
                for c in range(Dv):
                    o[b, i, h, c] = sum(math.exp(s - m) / z * vl[b][j][g][c] for j, s in scores.items())
    return o, lse


def inputs(b, sq, sk, h, hk, d, dv=None, seed=0, dtype=F64, std=1.0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, h, d, generator=gen, dtype=F64) * std
    k = torch.randn(b, sk, hk, d, generator=gen, dtype=F64) * std
    v = torch.randn(b, sk, hk, dv or d, generator=gen, dtype=F64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def assert_matches_loop(q, k, v, keep, mod=None, scale=None, **kwargs):
    o, lse = attention(q, k, v, return_lse=True, softmax_scale=scale, **kwargs)
    want_o, want_lse = loop_attention(q, k, v, 1 / math.sqrt(q.shape[3]) if scale is None else scale, keep, mod)
    assert o.dtype == F64 and o.shape == want_o.shape and lse.shape == want_lse.shape
    torch.testing.assert_close(o, want_o, rtol=1e-12, atol=1e-12)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
    return o, lse


masks = st.sampled_from(["none", "causal", "window"])
sides = st.integers(-1, 4)


@settings(max_examples=60, deadline=None)
@given(b=st.integers(1, 2), sq=st.integers(1, 6), sk=st.integers(1, 7), hk=st.integers(1, 2), group=st.integers(1, 3),
       d=st.integers(1, 4), dv=st.integers(1, 3), mask=masks, left=sides, right=sides,
       align=st.sampled_from(["top_left", "bottom_right"]), scale=st.sampled_from([None, 0.3, 2.0]), seed=st.integers(0, 99))
def test_masks_alignments_gqa_and_scale_match_the_loop(b, sq, sk, hk, group, d, dv, mask, left, right, align, scale, seed):
    """Causal and window masks with both alignments, GQA/MQA, seq_q != seq_k, d_v != d_head, a custom
    scale; rows that keep no key (causal bottom-right with seq_q > seq_k, narrow windows) included."""
    q, k, v = inputs(b, sq, sk, hk * group, hk, d, dv, seed)
    window = (left, right) if mask == "window" else None
    keep = lambda _b, _h, i, j: kept_by_rule(i, j, sq, sk, mask == "causal", window, align)  # noqa: E731
    o, lse = assert_matches_loop(q, k, v, keep, scale=scale, causal=mask == "causal", window=window, align=align)
    empty = torch.isneginf(lse).transpose(1, 2)  # (b, sq, h)
    assert (o[empty] == 0).all()


def test_rows_without_keys_give_zero_and_minus_infinity_with_finite_gradients():
    """Causal bottom-right with seq_q = 6 > seq_k = 3: the first 3 query rows keep nothing."""
    q, k, v = inputs(1, 6, 3, 2, 1, 4)
    o, lse = assert_matches_loop(q, k, v, lambda b, h, i, j: j <= i - 3, causal=True, align="bottom_right")
    assert torch.equal(o[:, :3], torch.zeros_like(o[:, :3])) and torch.isneginf(lse[..., :3]).all()
    assert torch.isfinite(o).all() and torch.isfinite(lse[..., 3:]).all()
    dq, dk, dv = gradients(q, k, v, torch.randn(o.shape, dtype=F64), causal=True, align="bottom_right")
    assert all(torch.isfinite(g).all() for g in (dq, dk, dv))
    assert (dq[:, :3] == 0).all()
    o_low, lse_low = lowp_reference(q.half(), k.half(), v.half(), causal=True, align="bottom_right", return_lse=True)
    assert (o_low[:, :3] == 0).all() and torch.isneginf(lse_low[..., :3]).all() and torch.isfinite(o_low).all()


def softcap(score, b, h, q_idx, kv_idx):
    return 30 * torch.tanh(score / 30)


def test_softcap_score_mod_matches_the_loop():
    q, k, v = inputs(2, 5, 6, 4, 2, 8, std=4.0)  # scores of tens: the cap bends them
    o, _ = assert_matches_loop(q, k, v, lambda *_: True, lambda s, *_: 30 * math.tanh(s / 30), score_mod=softcap)
    assert (o - attention(q, k, v)).abs().max() > 1e-3  # the cap changed the result


def test_alibi_bias_score_mod_uses_the_query_head_and_combines_with_causal():
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=F64)
    q, k, v = inputs(1, 6, 6, 4, 2, 4, seed=3)
    alibi = lambda score, b, h, q_idx, kv_idx: score + slopes[h] * (kv_idx - q_idx)  # noqa: E731
    assert_matches_loop(q, k, v, lambda b, h, i, j: j <= i, lambda s, b, h, i, j: s + slopes[h].item() * (j - i),
                        score_mod=alibi, causal=True)


def test_score_mod_returning_minus_infinity_masks_the_score():
    """As FlexAttention's: -inf scores are masked ones, and a row of them gives o = 0, lse = -inf."""
    q, k, v = inputs(2, 5, 3, 2, 1, 4, seed=4)
    masked = lambda score, b, h, q_idx, kv_idx: torch.where(kv_idx <= q_idx - 2, score, -math.inf)  # noqa: E731
    got = attention(q, k, v, score_mod=masked, return_lse=True)
    assert all(torch.equal(a, b) for a, b in zip(got, attention(q, k, v, causal=True, align="bottom_right", return_lse=True)))
    assert (got[0][:, :2] == 0).all() and torch.isneginf(got[1][..., :2]).all()


def test_document_mask_from_a_captured_tensor():
    doc = torch.tensor([0, 0, 1, 1, 1, 2, 2])
    q, k, v = inputs(2, 7, 7, 4, 1, 4, seed=5)
    same_doc = lambda b, h, q_idx, kv_idx: doc[q_idx] == doc[kv_idx]  # noqa: E731
    assert_matches_loop(q, k, v, lambda b, h, i, j: doc[i] == doc[j], mask_mod=same_doc)
    assert_matches_loop(q, k, v, lambda b, h, i, j: doc[i] == doc[j] and j <= i, mask_mod=same_doc, causal=True)


def test_prefix_lm_mask():
    prefix = 3
    q, k, v = inputs(1, 6, 6, 2, 2, 4, seed=6)
    prefix_lm = lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx) | (kv_idx < prefix)  # noqa: E731
    assert_matches_loop(q, k, v, lambda b, h, i, j: j <= i or j < prefix, mask_mod=prefix_lm)


@pytest.mark.parametrize("sq, sk", [(5, 5), (4, 7), (7, 4)])
@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
def test_a_causal_mask_mod_gives_the_causal_result(sq, sk, align):
    offset = sk - sq if align == "bottom_right" else 0
    q, k, v = inputs(2, sq, sk, 2, 1, 4, seed=7)
    causal_mod = lambda b, h, q_idx, kv_idx: kv_idx <= q_idx + offset  # noqa: E731
    got = attention(q, k, v, mask_mod=causal_mod, return_lse=True)
    want = attention(q, k, v, causal=True, align=align, return_lse=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_flex_attention_agrees_on_score_and_mask_mods():
    """FlexAttention itself (its eager CPU path, float64, GQA): same output and lse for a softcap
    with a per-batch-and-head bias and a sliding-window mask_mod that leaves some rows empty."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    q, k, v = inputs(2, 6, 9, 4, 2, 8, seed=8, std=3.0)
    bias = torch.randn(2, 4, dtype=F64)
    score_mod = lambda score, b, h, q_idx, kv_idx: softcap(score, b, h, q_idx, kv_idx) + bias[b, h]  # noqa: E731
    mask_mod = lambda b, h, q_idx, kv_idx: (kv_idx - q_idx >= 3) & (kv_idx - q_idx <= 5) & (q_idx != 4)  # noqa: E731
    block_mask = flex.create_block_mask(mask_mod, 2, 4, 6, 9, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        o_flex, lse_flex = flex.flex_attention(*(t.transpose(1, 2) for t in (q, k, v)), score_mod=score_mod,
                                               block_mask=block_mask, enable_gqa=True, return_lse=True)
    o, lse = attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, return_lse=True)
    assert torch.isneginf(lse[:, :, 4]).all()
    torch.testing.assert_close(o, o_flex.transpose(1, 2).to(F64), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, lse_flex.to(F64), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kwargs", [{}, {"causal": True, "align": "bottom_right"}, {"window": (1, 1), "softmax_scale": 0.7}],
                         ids=["none", "causal-bottom-right", "window"])
def test_autograd_passes_gradcheck(kwargs):
    """GQA (4 query heads on 2 kv heads), seq_q > seq_k so causal bottom-right leaves empty rows."""
    q, k, v = (t.requires_grad_(True) for t in inputs(1, 4, 3, 4, 2, 3, seed=9))
    assert torch.autograd.gradcheck(lambda q, k, v: attention(q, k, v, **kwargs), (q, k, v))


def test_gradients_are_the_directional_derivatives_and_gqa_sums_over_the_group():
    q, k, v = inputs(2, 5, 6, 4, 2, 3, seed=10)
    do = torch.randn(2, 5, 4, 3, dtype=F64)
    dq, dk, dv = gradients(q.half(), k.half(), v.half(), do, causal=True)  # 16-bit inputs: float64 gradients
    q, k, v = q.half().double(), k.half().double(), v.half().double()
    assert (dq.dtype, dq.shape, dk.shape, dv.shape) == (F64, q.shape, k.shape, v.shape)
    loss = lambda q, k, v: (attention(q, k, v, causal=True) * do).sum().item()  # noqa: E731
    gen, eps = torch.Generator().manual_seed(1), 1e-6
    for _ in range(3):
        e = [torch.randn(t.shape, generator=gen, dtype=F64) for t in (q, k, v)]
        plus, minus = ([t + sign * eps * et for t, et in zip((q, k, v), e)] for sign in (1, -1))
        fd = (loss(*plus) - loss(*minus)) / (2 * eps)
        assert fd == pytest.approx(sum((g * et).sum().item() for g, et in zip((dq, dk, dv), e)), rel=1e-7, abs=1e-9)
    # the kv heads repeated to MHA: each kv head's gradient is the sum over its 2 query heads
    _, dk_mha, dv_mha = gradients(q, k.repeat_interleave(2, 2), v.repeat_interleave(2, 2), do, causal=True)
    torch.testing.assert_close(dk, dk_mha.view(2, 6, 2, 2, 3).sum(3))
    torch.testing.assert_close(dv, dv_mha.view(2, 6, 2, 2, 3).sum(3))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_check_close_accepts_a_good_output_and_rejects_a_perturbed_one(dtype):
    q, k, v = inputs(2, 40, 50, 4, 2, 16, seed=11, dtype=dtype)
    kwargs = {"causal": True, "align": "bottom_right"}
    ref, ref_lowp = attention(q, k, v, **kwargs), lowp_reference(q, k, v, **kwargs)
    assert ref_lowp.dtype == dtype and (ref_lowp.double() - ref).abs().max() > 0
    good = ref.to(dtype)  # the float64 result rounded once: closer than any 16-bit computation
    check_close(good, ref, ref_lowp)
    check_attention(good, q, k, v, **kwargs)
    check_attention(good, q, k, v, pipeline="plain", **kwargs)
    bad = good.clone()
    bad[1, 30, 2, 5] += 0.05
    with pytest.raises(AssertionError, match=r"max error .* at \(1, 30, 2, 5\)"):
        check_close(bad, ref, ref_lowp)
    bad[1, 30, 2, 5] = float("nan")
    with pytest.raises(AssertionError, match=r"1 NaN/Inf values in the output, the first at \(1, 30, 2, 5\)"):
        check_attention(bad, q, k, v, "poisoned", **kwargs)
    with pytest.raises(ValueError, match="shape"):
        check_close(good[:, :10], ref, ref_lowp)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_flash_pipeline_rounds_only_the_probabilities_and_the_output(dtype):
    q, k, v = inputs(1, 64, 80, 2, 2, 32, seed=13, dtype=dtype)
    o, lse = lowp_reference(q, k, v, pipeline="flash", causal=True, return_lse=True)
    assert o.dtype == dtype and lse.dtype == torch.float32
    s = (q.float().transpose(1, 2) @ k.float().transpose(1, 2).transpose(-1, -2)) / math.sqrt(32)
    s = s.masked_fill(torch.ones(64, 80, dtype=torch.bool).triu(1), -math.inf)
    p = torch.softmax(s, -1).to(dtype).float()
    torch.testing.assert_close(o, (p @ v.float().transpose(1, 2)).transpose(1, 2).to(dtype), rtol=0, atol=0)
    torch.testing.assert_close(lse, torch.logsumexp(s, -1))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_check_attention_measures_against_the_flash_pipeline(dtype):
    """An output erring between the two baselines' tolerances passes FlashAttention's plain rule and
    fails the flash one: the default check is the stricter."""
    q, k, v = inputs(1, 256, 256, 2, 2, 64, seed=14, dtype=dtype)
    ref = attention(q, k, v)
    t_flash, t_plain = (reference.tolerance(reference.max_errors(ref, ref, lowp_reference(q, k, v, pipeline=p))[1])
                        for p in ("flash", "plain"))
    assert t_plain > 1.5 * t_flash  # 16-bit scores and sums err 2-4x more than a flash kernel
    out = ref.to(dtype)
    at = tuple(int(i) for i in torch.nonzero(ref.abs() == ref.abs().min())[0])  # a tiny value: exact rounding
    out[at] = ref[at] + (t_flash + t_plain) / 2
    check_attention(out, q, k, v, pipeline="plain")
    with pytest.raises(AssertionError, match="max error"):
        check_attention(out, q, k, v)
    with pytest.raises(ValueError, match="pipeline='fast'"):
        lowp_reference(q, k, v, pipeline="fast")


def test_the_absolute_slack_admits_rounding_only_where_the_16_bit_reference_is_exact():
    """Rows without a key: the 16-bit reference is exactly 0, so only ATOL is allowed there."""
    q, k, v = inputs(1, 6, 3, 2, 2, 8, seed=12, dtype=torch.float16)
    kwargs = {"causal": True, "align": "bottom_right"}
    ref, ref_lowp = attention(q, k, v, **kwargs), lowp_reference(q, k, v, **kwargs)
    out = ref.half()
    out[0, 0, 0, 0] = reference.ATOL / 2
    check_close(out, ref, ref_lowp)
    out[0, 0, 0, 0] = 1e-3
    with pytest.raises(AssertionError, match=r"at \(0, 0, 0, 0\)"):
        check_close(out, ref, ref_lowp)


@pytest.mark.parametrize("args, words", [
    ({"causal": True, "window": (2, 0)}, "either causal=True or window"),
    ({"align": "middle"}, "align='middle'"),
])
def test_bad_options_are_refused(args, words):
    q, k, v = inputs(1, 4, 4, 2, 2, 4)
    with pytest.raises(ValueError, match=words):
        attention(q, k, v, **args)


def test_bad_shapes_are_refused():
    q, k, v = inputs(1, 4, 4, 3, 2, 4)
    with pytest.raises(ValueError, match="3 heads are not a multiple of k/v's 2 heads"):
        attention(q, k, v)
    with pytest.raises(ValueError, match="do not match"):
        attention(q, k, v[:, :2])
    with pytest.raises(ValueError, match="4-D"):
        attention(q[0], k, v)
    with pytest.raises(ValueError, match="return_lse"):
        gradients(q, k, v, q, return_lse=True)


def test_the_package_imports_it_lazily():
    code = ("import json, sys, flashgen; before = 'torch' in sys.modules; "
            "f = flashgen.reference.attention; print(json.dumps([before, 'torch' in sys.modules]))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True, cwd=ROOT)
    assert json.loads(out.stdout) == [False, True]
