"""GPU tests of the wgmma engine (TMA + wgmma + warp specialization), marked ``gpu``; sm_90 only.

Same rules as the mma.sync suites: float64 reference, FlashAttention's tolerance against
the same attention at a flash kernel's 16-bit precision (``flashgen.reference``), outputs
poisoned with NaN first, fresh random inputs;
masks, tails, GQA and LSE through ``test_features.check_masks_tails_gqa``; the sanitizer
on the default config.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from flashgen.dsl.config import KernelConfig, hopper_configs  # noqa: E402
from flashgen.reference import check_attention  # noqa: E402
from flashgen.tune import HOPPER_B_C, hopper_default  # noqa: E402

from test_features import SHAPES as FEATURE_SHAPES, check_masks_tails_gqa  # noqa: E402


def _is_sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _is_sm90(), reason="needs an sm_90 GPU (H100/H200) for wgmma kernels")]

REPO = Path(__file__).resolve().parents[2]
# the d_head-128 set (default + ablations) and the default of every other head size the engine takes
CONFIGS = list(dict.fromkeys(hopper_configs() + [KernelConfig.wgmma(dt, d_head=d, B_c=bc) for d, bc in HOPPER_B_C.items() for dt in ("fp16", "bf16")]
                             + [hopper_default(KernelConfig.wgmma(dt).dtype, d) for d in HOPPER_B_C for dt in ("fp16", "bf16")]
                             # three consumer warpgroups passing pingpong turns in a ring
                             + [KernelConfig.wgmma("bf16", B_r=192, B_c=64, persistent=True), KernelConfig.wgmma("fp16", B_r=192, B_c=64)]))
SHAPES = [(2, 1024, 4), (1, 640, 3), (3, 384, 2)]  # (batch, seq, heads)
MANY_TILES = (1, 2048, 10)  # 160 tiles: more than an H100/H200 has SMs, so persistent CTAs loop
FEATURE_BLOCKS = [(64, 128), (128, 128), (128, 160)]  # (d_head, B_c): B_c 160 has a key tail at most lengths


@pytest.fixture(scope="module")
def built():
    import flashgen
    from flashgen.build import build_many

    feature = [KernelConfig.wgmma(dt, d_head=d, B_c=bc, persistent=pe) for dt in ("fp16", "bf16") for d, bc in FEATURE_BLOCKS
               for pe in (False, True)]
    masked = [c.replace(mask=m) for c in feature for m in ("causal", "window")]
    failures = build_many(list(dict.fromkeys(CONFIGS + feature + masked)), torch.cuda.get_device_capability())
    assert not failures, "\n".join(f"{k}: {v}" for k, v in failures.items())
    return {c: flashgen.compile(c) for c in dict.fromkeys(CONFIGS + feature)}


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.mangle())
def test_matches_float64_reference(built, cfg):
    attn = built[cfg]
    torch.manual_seed(cfg.d_head + cfg.B_c)
    for b, s, h in SHAPES + ([MANY_TILES] if cfg.persistent else []):
        q, k, v = (torch.randn(b, s, h, cfg.d_head, device="cuda", dtype=cfg.dtype.torch) for _ in range(3))
        out = torch.full_like(q, float("nan"))
        o = attn(q, k, v, out=out)
        check_attention(o, q, k, v, f"shape {(b, s, h)}")


@pytest.mark.parametrize("persistent", [False, True], ids=["grid", "persistent"])
@pytest.mark.parametrize("d_head, B_c", FEATURE_BLOCKS, ids=[f"d{d}-bc{bc}" for d, bc in FEATURE_BLOCKS])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_masks_tails_gqa(built, dtype, d_head, B_c, persistent):
    # the last shape has 576 tiles: persistent CTAs run several, with masks, tails and GQA
    shapes = FEATURE_SHAPES + [(1, 1000, 1500, 4, 1)] + ([(2, 700, 1100, 48, 8)] if persistent else [])
    check_masks_tails_gqa(built[KernelConfig.wgmma(dtype, d_head=d_head, B_c=B_c, persistent=persistent)], shapes, seed=d_head + B_c)


@pytest.mark.parametrize("persistent", [False, True], ids=["grid", "persistent"])
def test_strided_and_transposed_inputs(built, persistent):
    """(b, h, s, d) storage passed as its transpose, and a slice of a wider tensor: tensor maps take the
    strides, of the inputs and of the output the TMA stores write (a transposed view, poisoned first)."""
    cfg = KernelConfig.wgmma("bf16", persistent=persistent)
    attn = built[cfg]
    q = torch.randn(2, 4, 300, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    kv = torch.randn(2, 300, 4, 256, device="cuda", dtype=torch.bfloat16)
    k, v = kv[..., :128], kv[..., 128:]
    check_attention(attn(q, k, v, softmax_scale=0.07), q, k, v, softmax_scale=0.07)
    storage = torch.full((2, 4, 301, 136), float("nan"), device="cuda", dtype=torch.bfloat16)
    out = storage[:, :, :300, :128].transpose(1, 2)  # rows 272 elements apart, heads 301 rows apart
    assert attn(q, k, v, out=out, softmax_scale=0.07) is out
    check_attention(out, q, k, v, softmax_scale=0.07)
    assert storage[:, :, 300].isnan().all() and storage[..., 128:].isnan().all()  # nothing written outside the view


@pytest.mark.parametrize("B_c", [128, 160])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_wave_tail_split(built, dtype, B_c):
    """A partial last round (tiles = SMs + tail, or fewer tiles than SMs) splits its tiles' key
    blocks over idle CTAs (plan.tail_split): shapes from this GPU's SM count that split into 2 to
    8 parts, with key tails and GQA/MQA, against float64 (outputs and LSE; the masked calls split
    where a launch has fewer tiles than SMs with long enough tiles, e.g. causal bottom-right, and
    run unsplit elsewhere)."""
    from flashgen.dsl.hopper_plan import make_hopper_plan

    cfg = KernelConfig.wgmma(dtype, B_c=B_c, persistent=True)
    split = make_hopper_plan(cfg).tail_split
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = [(sms + 3, 128, 1100, 1, 1), (1, 300, 777, sms // 2, 1), (2, 200, 1000, sms // 2 + 1, sms // 2 + 1),
              (1, 256, 4000, 4, 2), (1, 100, 700, 1, 1)]  # fewer tiles than SMs: a grid of tiles x parts
    parts = [split.parts(-(-sq // cfg.B_r) * b * hq, sms, -(-sk // B_c)) for b, sq, sk, hq, _ in shapes]
    assert min(parts) >= 2, f"shapes {shapes} do not split on {sms} SMs: parts {parts}"
    check_masks_tails_gqa(built[cfg], shapes, seed=B_c)
    # the split really runs: its one workspace allocation per call; full last rounds allocate none, nor
    # do masked launches of more tiles than SMs (their rounds pair long and short tiles)
    cases = [(shapes[0], {}, 1), (shapes[3], {}, 1), ((sms, 128, 1100, 1, 1), {}, 0),
             (shapes[3], {"causal": True, "align": "bottom_right"}, 1), (shapes[0], {"causal": True, "align": "bottom_right"}, 0)]
    for (b, sq, sk, hq, hk), kwargs, want in cases:
        q = torch.randn(b, sq, hq, cfg.d_head, device="cuda", dtype=cfg.dtype.torch)
        k, v = (torch.randn(b, sk, hk, cfg.d_head, device="cuda", dtype=cfg.dtype.torch) for _ in range(2))
        out = torch.empty_like(q)
        built[cfg](q, k, v, out=out, **kwargs)  # builds the masked variant outside the count
        torch.cuda.synchronize()
        before = torch.cuda.memory_stats()["allocation.all.allocated"]
        built[cfg](q, k, v, out=out, **kwargs)
        assert torch.cuda.memory_stats()["allocation.all.allocated"] - before == want, (b, sq, sk, hq, hk, kwargs)


@pytest.mark.parametrize("d_head, B_c", [(128, 128), (256, 64)])
def test_grid_kernels_split_launches_of_few_tiles(built, d_head, B_c):
    """One CTA per tile: a launch of fewer tiles than SMs splits like a persistent kernel's (the grid
    grows to tiles x parts, one workspace allocation); more tiles than SMs run unsplit. Float64
    checks (d_head 128 also with every mask and alignment; d_head 256 unmasked)."""
    from flashgen.dsl.hopper_plan import make_hopper_plan

    cfg = KernelConfig.wgmma("bf16", d_head=d_head, B_c=B_c)
    split = make_hopper_plan(cfg).tail_split
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    shapes = [(1, 200, 3000, 4, 2), (1, 64, 5000, 2, 1)]  # (batch, seq_q, seq_k, heads, kv_heads): 8 and 2 tiles
    assert min(split.parts(-(-sq // cfg.B_r) * b * hq, sms, -(-sk // B_c)) for b, sq, sk, hq, _ in shapes) >= 2
    if d_head == 128:
        check_masks_tails_gqa(built[cfg], shapes, seed=d_head)
    torch.manual_seed(d_head)
    for (b, sq, sk, hq, hk), want in ((shapes[0], 1), ((1, 128 * sms, 300, 1, 1), 0)):
        q = torch.randn(b, sq, hq, d_head, device="cuda", dtype=cfg.dtype.torch)
        k, v = (torch.randn(b, sk, hk, d_head, device="cuda", dtype=cfg.dtype.torch).repeat_interleave(hq // hk, 2) for _ in range(2))
        out = torch.full_like(q, float("nan"))
        built[cfg](q, k, v, out=out)
        check_attention(out, q, k, v)
        torch.cuda.synchronize()
        before = torch.cuda.memory_stats()["allocation.all.allocated"]
        built[cfg](q, k, v, out=out)
        assert torch.cuda.memory_stats()["allocation.all.allocated"] - before == want, (b, sq, sk, hq, hk)


SANITIZED = {  # the causal grid and persistent kernels, and the unmasked B_c-160 default with a key tail
    "grid": (KernelConfig.wgmma("fp16", mask="causal"), ["300", "1", "2", "333", "1"]),
    # 3 query blocks x 96 heads = 288 tiles of unequal length (causal), more than twice the SMs,
    # so CTAs loop (paired rounds, then the rest) and reuse Q, the K/V ring and the O staging
    "persistent": (KernelConfig.wgmma("fp16", persistent=True, mask="causal"), ["300", "1", "96", "333", "8"]),
    "persistent-bc160": (KernelConfig.wgmma("fp16", B_c=160, persistent=True), ["300", "1", "96", "333", "8"]),
    # 135 tiles: on 132 SMs a wave tail of 3 tiles split into 4 parts each (workspace, counters, merge)
    "persistent-split": (KernelConfig.wgmma("fp16", persistent=True), ["300", "1", "45", "1000", "5"]),
    # causal bottom-right, 6 tiles of 2-3 query blocks' rows over 2000 keys: fewer tiles than SMs, so
    # the masked kernel splits each (shortest tile 15 blocks -> up to 7 parts), diagonal in the last part
    "persistent-causal-split": (KernelConfig.wgmma("fp16", persistent=True, mask="causal"), ["300", "2", "1", "2000", "1", "bottom_right"]),
    # one CTA per tile: 3 tiles over 1000 keys split 4 ways (a grid of 12 CTAs)
    "grid-split": (KernelConfig.wgmma("fp16"), ["300", "1", "1", "1000", "1"]),
    # three consumers in a pingpong ring (named barriers 1-3, staging barriers 4-6), looping over 288 causal tiles (3 query blocks x 96 heads)
    "persistent-3-consumers": (KernelConfig.wgmma("bf16", B_r=192, B_c=64, persistent=True, mask="causal"), ["400", "1", "96", "400", "8"]),
}


@pytest.mark.parametrize("variant", list(SANITIZED))
@pytest.mark.parametrize("tool", ["memcheck", "racecheck", "synccheck"])
def test_sanitizer_clean(built, tool, variant):
    exe = shutil.which("compute-sanitizer")
    if exe is None:
        pytest.skip("compute-sanitizer not on PATH")
    cfg, shape = SANITIZED[variant]
    res = subprocess.run(
        [exe, "--tool", tool, "--error-exitcode", "9", sys.executable, str(REPO / "tests/gpu/run_one.py"), cfg.short_form(), *shape],
        capture_output=True, text=True, cwd=REPO, timeout=600,
    )
    text = res.stdout + res.stderr
    assert res.returncode == 0, text[-6000:]
    assert "ERROR SUMMARY: 0 errors" in text or "(0 errors, 0 warnings)" in text, text[-3000:]


def test_auto_runs_the_wgmma_engine_on_sm90(built):
    """compile("auto") with no tuned entry picks the wgmma default on sm_90 and computes the right thing."""
    import flashgen
    from flashgen.tune import lookup

    assert lookup(torch.cuda.get_device_name(), KernelConfig.wgmma("fp16").dtype, 128, 1024, cache={},
                  capability=torch.cuda.get_device_capability()) == hopper_default(KernelConfig.wgmma("fp16").dtype, 128)
    auto = flashgen.compile("auto")
    q, k, v = (torch.randn(1, 1024, 2, 128, device="cuda", dtype=torch.float16) for _ in range(3))
    check_attention(auto(q, k, v), q, k, v)
    # long sequences take the default too, masked or not (the key block of 160 long unmasked ones once took no
    # longer pays; a length of 2048 with a block of 128 has no tail block)
    q, k, v = (torch.randn(1, 2048, 2, 128, device="cuda", dtype=torch.float16) for _ in range(3))
    assert auto.select(q) == auto.select(q, masked=True) == hopper_default(KernelConfig.wgmma("fp16").dtype, 128)
    check_attention(auto(q, k, v), q, k, v)
