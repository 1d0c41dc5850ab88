"""The torch-free gradient reference (flashgen.sim.grad_reference) against autograd through
flashgen.reference.attention: masks, both alignments, GQA, rows without a kept key."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from flashgen import reference  # noqa: E402
from flashgen.sim import hardware as hw  # noqa: E402
from flashgen.sim.grad_reference import gradients, head_gradients  # noqa: E402


@pytest.mark.parametrize("seq_q, seq_k, heads, kv_heads, mask", [
    (1, 1, 1, 1, {}),
    (17, 29, 2, 1, {"causal": True}),
    (29, 17, 4, 2, {"causal": True, "align": "bottom_right"}),
    (23, 23, 2, 2, {"window": (5, 3)}),
    (13, 40, 3, 1, {"window": (-1, 2), "align": "bottom_right", "softmax_scale": 0.3}),
])
def test_numpy_gradients_equal_autograd(seq_q, seq_k, heads, kv_heads, mask):
    rng = np.random.default_rng(seq_q * 100 + seq_k)
    q, do = (rng.standard_normal((2, seq_q, heads, 24)) for _ in range(2))
    k, v = (rng.standard_normal((2, seq_k, kv_heads, 24)) for _ in range(2))
    got = gradients(q, k, v, do, **mask)
    want = reference.gradients(*(torch.from_numpy(x) for x in (q, k, v, do)), **mask)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(g, w.numpy(), rtol=1e-10, atol=1e-12, err_msg=name)


def test_head_forward_results_equal_the_reference_attention():
    rng = np.random.default_rng(5)
    q, do = rng.standard_normal((9, 16)), rng.standard_normal((9, 16))
    k, v = rng.standard_normal((12, 16)), rng.standard_normal((12, 16))
    keep = np.tril(np.ones((9, 12), bool), -1)  # row 0 keeps no key
    g = head_gradients(q, k, v, do, 0.25, keep)
    t = [torch.from_numpy(x)[None, :, None] for x in (q, k, v)]
    o, lse = reference.attention(*t, softmax_scale=0.25, mask_mod=lambda b, h, i, j: torch.from_numpy(keep)[i, j], return_lse=True)
    np.testing.assert_allclose(g.o, o[0, :, 0].numpy(), rtol=1e-12, atol=1e-14)
    assert np.isneginf(g.lse[0]) and (g.o[0] == 0).all() and (g.dq[0] == 0).all()
    np.testing.assert_allclose(g.lse[1:], lse[0, 0, 1:].numpy(), rtol=1e-12)
    np.testing.assert_allclose(g.delta, (do * g.o).sum(axis=1))


def _bf16(x: np.ndarray) -> np.ndarray:
    return hw.decode(hw.encode(x, hw.BF16), hw.BF16).astype(np.float64)


def test_the_16_bit_baseline_reads_d_from_the_16_bit_output():
    """A flash backward's D = rowsum(dO * O) reads the forward's 16-bit O. A dQ made at exactly the baseline's
    other roundings but with that D must pass FlashAttention's rule against the baseline: with D from the
    exact O the baseline erred less than half as much as such a dQ on these inputs (causal, seq 1024)."""
    rng = np.random.default_rng(83)
    q, k, v, do = (_bf16(rng.standard_normal((1024, 64))) for _ in range(4))
    keep, scale = np.tril(np.ones((1024, 1024), bool)), 0.125
    exact, base = head_gradients(q, k, v, do, scale, keep), head_gradients(q, k, v, do, scale, keep, round16=_bf16)
    np.testing.assert_allclose(base.delta, (do * _bf16(exact.o)).sum(axis=1))
    s = np.where(keep, scale * (q @ k.T), -np.inf)
    p = np.exp(s - exact.lse[:, None])
    d16 = (do * _bf16(p @ v)).sum(axis=1)
    dq = _bf16(scale * (_bf16(p * (do @ v.T - d16[:, None])) @ k))
    err = np.abs(dq - exact.dq).max()
    assert err <= reference.tolerance(np.abs(base.dq - exact.dq).max())


def test_numpy_gradients_with_mods_equal_autograd():
    """``head_mods``: a mask_mod's keep and a score_mod with its derivative per (batch, query head), GQA."""
    rng = np.random.default_rng(11)
    q, do = (rng.standard_normal((2, 19, 4, 16)) for _ in range(2))
    k, v = (rng.standard_normal((2, 23, 2, 16)) for _ in range(2))
    slope = torch.tensor([0.5, 0.25, 0.125, 1.0])
    score_mod = lambda s, b, h, i, j: 3.0 * torch.tanh(s / 3.0) - slope[h] * (i - j) + b  # noqa: E731
    mask_mod = lambda b, h, i, j: (j <= i + 2) | (j < 4 + h)  # noqa: E731
    i, j = np.arange(19)[:, None], np.arange(23)[None, :]

    def head_mods(b, h):
        def score(s):
            t = np.tanh(s / 3.0)
            return 3.0 * t - float(slope[h]) * (i - j) + b, 1.0 - t * t
        return (j <= i + 2) | (j < 4 + h), score

    got = gradients(q, k, v, do, causal=True, align="bottom_right", head_mods=head_mods)
    want = reference.gradients(*(torch.from_numpy(x) for x in (q, k, v, do)), causal=True, align="bottom_right",
                               score_mod=score_mod, mask_mod=mask_mod)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(g, w.numpy(), rtol=1e-10, atol=1e-12, err_msg=name)


def test_causal_is_the_key_window_both_references_and_the_runtime_share():
    """One rule turns a call's causal / window into the kernels' (left, right): causal keeps what window (-1, 0)
    keeps in the numpy and the torch reference alike, and asking for both is refused everywhere."""
    from flashgen.attention.score_mask import CAUSAL_WINDOW, key_window
    from flashgen.sim.grad_reference import keep_mask

    assert key_window(True, None) == CAUSAL_WINDOW == (-1, 0) and key_window(False, None) == (-1, -1)
    assert key_window(False, (np.int64(5), 3)) == (5, 3) and all(type(x) is int for x in key_window(False, (np.int64(5), 3)))
    for align in ("top_left", "bottom_right"):
        np.testing.assert_array_equal(keep_mask(7, 11, causal=True, align=align), keep_mask(7, 11, window=CAUSAL_WINDOW, align=align))
    q = torch.randn(1, 7, 1, 8, dtype=torch.float64)
    k, v = torch.randn(1, 11, 1, 8, dtype=torch.float64), torch.randn(1, 11, 1, 8, dtype=torch.float64)
    torch.testing.assert_close(reference.attention(q, k, v, causal=True), reference.attention(q, k, v, window=CAUSAL_WINDOW))
    with pytest.raises(ValueError, match="expected \\(left, right\\)"):
        key_window(False, (1, 2, 3))
    for refuse in (lambda: key_window(True, (1, 1)), lambda: keep_mask(3, 3, causal=True, window=(1, 1)),
                   lambda: reference.attention(q, k, v, causal=True, window=(1, 1))):
        with pytest.raises(ValueError, match="either causal=True or window"):
            refuse()
