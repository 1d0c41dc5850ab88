"""GPU tests of the features beyond the seed (marked ``gpu``): masks, tails, GQA, head dims, LSE.

Reference: ``flashgen.reference.attention`` (float64, the same causal/window/align contract,
k/v heads repeated for GQA). Tolerance: FlashAttention's rule (``check_close``) against the same
attention at a flash kernel's precision (``lowp_reference(pipeline="flash")``); rows that keep
no key must be exactly 0 with lse = -inf, the others' lse within 1e-3.
"""
from __future__ import annotations

import itertools

import pytest

torch = pytest.importorskip("torch")

from flashgen.dsl.notation import parse_config  # noqa: E402
from flashgen.reference import attention, check_close, lowp_reference  # noqa: E402

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
        out = torch.full_like(q, float("nan"))
        kwargs = {"causal": mask == "causal", "window": (17, 5) if mask == "window" else None, "align": align}
        o, lse = attn(q, k, v, out=out, return_lse=True, **kwargs)
        ref, ref_lse = attention(q, k, v, return_lse=True, **kwargs)
        what = f"{cfg.short_form()} shape {(b, sq, sk, hq, hk)} mask {mask} {align}"
        check_close(o, ref, lowp_reference(q, k, v, pipeline="flash", **kwargs), what)
        empty = torch.isneginf(ref_lse)  # (b, hq, sq): rows with no kept key
        assert (o.transpose(1, 2)[empty] == 0).all(), f"{what}: rows with no kept key must be 0"
        assert torch.isneginf(lse[empty]).all(), f"{what}: lse of empty rows must be -inf"
        if not empty.all():
            lse_err = (lse[~empty].double() - ref_lse[~empty]).abs().max().item()
            assert lse_err < 1e-3, f"{what}: lse error {lse_err:.3e}"


def test_unsupported_head_dims_are_refused():
    from flashgen.dsl.config import ConfigError, KernelConfig

    with pytest.raises(ConfigError, match="multiple of 8"):
        KernelConfig(dtype="fp16", d_head=100)
    with pytest.raises(ConfigError, match="accumulators"):
        KernelConfig(dtype="fp16", d_head=256, B_r=128, B_c=64, n_warps=4)
