"""GPU tests of the features beyond the seed (marked ``gpu``): masks, tails, GQA, head dims, LSE.

Reference: float64 attention with the same kept-score rule (``ScoreMask.keep`` semantics
written out here with torch ops), k/v heads repeated for GQA. Tolerance: FlashAttention's
rule against PyTorch's SDPA in the same dtype given the same boolean mask, over rows that
keep at least one key; rows that keep none must be exactly 0 with lse = -inf.
"""
from __future__ import annotations

import itertools
import math

import pytest

torch = pytest.importorskip("torch")

from flashgen.dsl.notation import parse_config  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

FAMILIES = [
    "(FP16, 64, 128, 64, 4): async+eager+swizzled+load_2_2_2_tiles+buffer+opt_softmax",
    "(BF16, 64, 128, 64, 4): async+eager+swizzled+load_2_2_2_tiles+buffer+opt_softmax",
    "(FP16, 96, 128, 64, 4): async+eager+swizzled+load_2_2_2_tiles+buffer+opt_softmax",
    "(BF16, 96, 128, 64, 4): async+eager+swizzled+load_2_2_2_tiles+buffer+opt_softmax",
    "(FP16, 128, 128, 64, 4): async+eager+swizzled+load_2_2_2_tiles+buffer+opt_softmax",
    "(BF16, 128, 128, 64, 4): async+eager+swizzled+load_2_2_0_tiles+buffer+opt_softmax",
    "(FP16, 256, 64, 64, 4): async+eager+swizzled+load_2_2_2_tiles+buffer+opt_softmax",
    "(BF16, 256, 64, 32, 4): async+eager+swizzled+load_2_2_2_tiles+opt_softmax",
    "(FP16, 72, 64, 64, 4): async+eager+swizzled+load_0_2_2_tiles+opt_softmax",
    "(BF16, 40, 64, 64, 4): async+swizzled+load_0_0_0_tiles",
    "(FP16, 128, 64, 64, 4): load_0_0_0_tiles",  # synchronous copies, unswizzled, plain softmax
]
MASKS = ["none", "causal", "window"]
# (batch, seq_q, seq_k, heads_q, heads_kv)
SHAPES = [(2, 1, 1, 2, 1), (1, 37, 91, 4, 2), (2, 200, 130, 3, 3), (1, 129, 129, 8, 1), (1, 64, 300, 2, 2)]


@pytest.fixture(scope="module")
def ops():
    import flashgen
    from flashgen.build import build_many

    cfgs = [parse_config(f).replace(mask=m) for f in FAMILIES for m in MASKS]
    failures = build_many(cfgs, torch.cuda.get_device_capability())
    assert not failures, failures
    return {f: flashgen.compile(parse_config(f)) for f in FAMILIES}


def kept(sq, sk, mask, offset, left, right, device):
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    keep = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if mask == "causal":
        keep &= j <= i + offset
    elif mask == "window":
        if right >= 0:
            keep &= j <= i + offset + right
        if left >= 0:
            keep &= j >= i + offset - left
    return keep


def reference(q, k, v, keep, scale):
    group = q.shape[2] // k.shape[2]
    qd = q.double().transpose(1, 2)
    kd = k.double().repeat_interleave(group, dim=2).transpose(1, 2)
    vd = v.double().repeat_interleave(group, dim=2).transpose(1, 2)
    s = (qd @ kd.transpose(-1, -2)) * scale
    s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return (p @ vd).transpose(1, 2), lse


@pytest.mark.parametrize("family", FAMILIES)
def test_masks_tails_gqa(ops, family):
    check_masks_tails_gqa(ops[family], SHAPES, seed=hash(family) % 1000)


def check_masks_tails_gqa(attn, shapes, seed=0):
    """Every shape x mask x alignment against the float64 reference (FA rule), with LSE; poisoned output."""
    cfg = attn.cfg
    dt = cfg.dtype.torch
    torch.manual_seed(seed)
    for (b, sq, sk, hq, hk), mask, align in itertools.product(shapes, MASKS, ("top_left", "bottom_right")):
        if mask == "none" and align == "bottom_right":
            continue
        q = torch.randn(b, sq, hq, cfg.d_head, device="cuda", dtype=dt)
        k = torch.randn(b, sk, hk, cfg.d_head, device="cuda", dtype=dt)
        v = torch.randn(b, sk, hk, cfg.d_head, device="cuda", dtype=dt)
        offset = 0 if align == "top_left" else sk - sq
        left, right = (-1, 0) if mask == "causal" else ((17, 5) if mask == "window" else (-1, -1))
        keep = kept(sq, sk, mask, offset, left, right, "cuda")
        scale = 1 / math.sqrt(cfg.d_head)
        out = torch.full_like(q, float("nan"))
        kwargs = {"causal": mask == "causal", "window": (left, right) if mask == "window" else None, "align": align}
        o, lse = attn(q, k, v, out=out, return_lse=True, **kwargs)
        ref, ref_lse = reference(q, k, v, keep, scale)
        what = f"{cfg.short_form()} shape {(b, sq, sk, hq, hk)} mask {mask} {align}"
        assert torch.isfinite(o).all(), f"{what}: NaN/Inf in the output"
        rows = keep.any(-1)  # (sq,)
        assert (o[:, ~rows] == 0).all(), f"{what}: rows with no kept key must be 0"
        assert torch.isneginf(lse[:, :, ~rows]).all(), f"{what}: lse of empty rows must be -inf"
        group = hq // hk
        o_t = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.repeat_interleave(group, 2).transpose(1, 2), v.repeat_interleave(group, 2).transpose(1, 2),
            attn_mask=keep, scale=scale,
        ).transpose(1, 2)
        err = (o[:, rows].double() - ref[:, rows]).abs().max().item() if rows.any() else 0.0
        err_t = (o_t[:, rows].double() - ref[:, rows]).abs().max().item() if rows.any() else 0.0
        assert err <= 2 * err_t + 1e-5, f"{what}: max error {err:.3e} > 2 * torch's {err_t:.3e} + 1e-5"
        if rows.any():
            lse_err = (lse[:, :, rows].double() - ref_lse[:, :, rows]).abs().max().item()
            assert lse_err < 1e-3, f"{what}: lse error {lse_err:.3e}"


def test_unsupported_head_dims_are_refused():
    from flashgen.dsl.config import ConfigError, KernelConfig

    with pytest.raises(ConfigError, match="multiple of 8"):
        KernelConfig(dtype="fp16", d_head=100)
    with pytest.raises(ConfigError, match="accumulators"):
        KernelConfig(dtype="fp16", d_head=256, B_r=128, B_c=64, n_warps=4)
