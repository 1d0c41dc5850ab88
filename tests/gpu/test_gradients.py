"""Training through flashgen on a GPU: dq, dk, dv of differentiable calls against float64 autograd.

Rule (FlashAttention's backward tests): each gradient's max error against the float64 gradients
(:func:`flashgen.reference.gradients`) is at most 2x the error of the same gradients computed at
16-bit precision (:func:`flashgen.sim.grad_reference.gradients`, the inputs and every 16-bit
operand of the backward rounded as a kernel rounds them) plus a small slack. Before each backward
the allocator is handed blocks full of NaN of the gradients' sizes, so a gradient element the
kernels never write shows up as NaN. Inputs are fresh random normals.
"""
from __future__ import annotations

import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from attention_inputs import random_qkv_do  # tests/ is on sys.path (the conftest's folder)

torch = pytest.importorskip("torch")

import flashgen  # noqa: E402
from flashgen import reference  # noqa: E402
from flashgen.dsl.backward_config import BackwardConfig  # noqa: E402
from flashgen.sim.grad_reference import gradients as lowp_gradients  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

#: (dtype, d_head, batch, seq_q, seq_k, heads, kv_heads, call keywords)
CASES = [
    ("fp16", 128, 2, 1, 1, 2, 2, {}),
    ("fp16", 128, 1, 17, 17, 4, 2, {"causal": True}),
    ("bf16", 128, 2, 113, 113, 4, 1, {"causal": True}),
    ("fp16", 128, 1, 1000, 1000, 2, 2, {}),
    ("bf16", 128, 1, 2047, 2047, 2, 1, {"causal": True}),
    ("fp16", 128, 1, 113, 1000, 2, 2, {"causal": True, "align": "bottom_right"}),
    ("fp16", 128, 1, 1000, 113, 2, 2, {"causal": True}),
    ("bf16", 128, 1, 777, 500, 4, 2, {"window": (100, 20)}),
    ("fp16", 128, 2, 300, 300, 2, 2, {"softmax_scale": 0.05}),
    ("fp16", 64, 2, 1000, 777, 8, 2, {}),
    ("bf16", 64, 1, 513, 513, 4, 4, {"causal": True, "align": "bottom_right"}),
    ("fp16", 256, 1, 400, 400, 2, 1, {"causal": True}),
    ("bf16", 96, 1, 300, 257, 2, 2, {}),
]


def _mask_of(kw: dict) -> str:
    return "causal" if kw.get("causal") else "window" if "window" in kw else "none"


@pytest.fixture(scope="module")
def auto():
    """compile("auto"), with every backward kernel the cases need built first, in parallel."""
    from flashgen.build import build_many

    cfgs = sorted({BackwardConfig.default(dt, d, _mask_of(kw)) for dt, d, *_, kw in CASES}, key=str)
    failures = build_many(cfgs, torch.cuda.get_device_capability())
    assert not failures, "\n".join(f"{k}: {v}" for k, v in failures.items())
    return flashgen.compile("auto")


def _poison_allocator(*tensors: torch.Tensor) -> None:
    """Free NaN-filled blocks of these tensors' sizes: the gradients about to be allocated get them."""
    blocks = [torch.full_like(t, float("nan")) for t in tensors]
    del blocks


def _inputs(dt, d, b, sq, sk, h, hk, seed):
    return random_qkv_do((b, sq, sk, h, hk), seed, getattr(torch, {"fp16": "float16", "bf16": "bfloat16"}[dt]), d)


def _check_gradients(got, q, k, v, do, what, **kw):
    want = reference.gradients(q, k, v, do, **kw)
    dtype = q.dtype
    vals = [x.to(torch.float64).cpu().numpy() for x in (q, k, v, do)]
    rnd = lambda x: torch.from_numpy(np.ascontiguousarray(x)).to(dtype).to(torch.float64).numpy()  # noqa: E731
    base = lowp_gradients(*vals, **kw, round16=rnd)
    for name, x, w, lowp in zip(("dq", "dk", "dv"), got, want, base):
        assert x.shape == w.shape and x.dtype == dtype, f"{what} {name}: {tuple(x.shape)} {x.dtype}"
        reference.check_close(x, w, torch.from_numpy(lowp).to(x.device), what=f"{what} {name}")


@pytest.mark.parametrize("case", range(len(CASES)), ids=lambda i: f"{CASES[i][0]}-d{CASES[i][1]}-{CASES[i][3]}x{CASES[i][4]}-"
                         f"h{CASES[i][5]}/{CASES[i][6]}-{_mask_of(CASES[i][7])}")
def test_gradients_match_float64_autograd(auto, case):
    dt, d, b, sq, sk, h, hk, kw = CASES[case]
    q, k, v, do = _inputs(dt, d, b, sq, sk, h, hk, seed=case)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o = auto(*leaves, **kw)
    reference.check_attention(o.detach(), q, k, v, f"case {case} o", **kw)
    _poison_allocator(q, k, v)
    got = torch.autograd.grad(o, leaves, do)
    _check_gradients(got, q, k, v, do, f"case {case}", **kw)


def test_strided_inputs_and_an_mma_sync_forward():
    """(batch, heads, seq, d) tensors passed as transposed views, through a fixed mma.sync forward kernel."""
    from flashgen.dsl.config import default_configs

    cfg = next(c for c in default_configs() if c.dtype.value == "bf16").replace(d_head=64)
    attn = flashgen.compile(cfg)
    g = torch.Generator(device="cuda").manual_seed(7)
    q, k, v, do = (torch.randn(2, 4, 333, 64, device="cuda", generator=g).to(torch.bfloat16).transpose(1, 2)
                   for _ in range(4))
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o = attn(*leaves, causal=True)
    got = torch.autograd.grad(o, leaves, do)
    assert all(x.stride() == t.stride() for x, t in zip(got, (q, k, v)))  # gradients keep the inputs' layout
    _check_gradients(got, q, k, v, do, "strided", causal=True)


#: (dtype, d_head, batch, seq_q, seq_k, heads, kv_heads, call keywords, deterministic): head sizes between 128
#: and 256, whose backward splits d_head's columns over four warps with shares past d_head
MID_CASES = [
    ("bf16", 160, 1, 300, 257, 4, 2, {"causal": True}, False),
    ("fp16", 192, 2, 1000, 777, 4, 2, {}, False),
    ("bf16", 224, 1, 513, 513, 2, 1, {"window": (100, 20)}, False),
    ("fp16", 240, 1, 400, 400, 2, 2, {"causal": True, "align": "bottom_right"}, False),
    ("bf16", 192, 1, 1000, 777, 4, 2, {"causal": True}, True),
]


@pytest.mark.parametrize("case", range(len(MID_CASES)), ids=lambda i: f"{MID_CASES[i][0]}-d{MID_CASES[i][1]}-"
                         f"{_mask_of(MID_CASES[i][7])}{'-det' if MID_CASES[i][8] else ''}")
def test_gradients_of_head_sizes_between_128_and_256(case):
    """Through an mma.sync forward of 64 query rows (the engines' default forwards do not take every
    such head size); the deterministic case twice, bit-identical."""
    from flashgen.dsl.config import KernelConfig

    dt, d, b, sq, sk, h, hk, kw, det = MID_CASES[case]
    mask = _mask_of(kw)
    fwd = KernelConfig.from_short_form(f"({dt.upper()}, {d}, 64, 64, 4): async+eager+swizzled+load_2_2_2_tiles+buffer+opt_softmax"
                                       + ("" if mask == "none" else f"+{mask}"))
    attn = flashgen.compile(fwd, deterministic=det)
    q, k, v, do = _inputs(dt, d, b, sq, sk, h, hk, seed=200 + case)
    _poison_allocator(q, k, v)
    got = _grads(attn, q, k, v, do, **kw)
    if det:
        again = _grads(attn, q, k, v, do, **kw)
        assert all(torch.equal(a.view(torch.int16), x.view(torch.int16)) for a, x in zip(got, again))
    _check_gradients(got, q, k, v, do, f"d_head {d} case {case}", **kw)


def test_a_gradient_through_the_returned_lse(auto):
    q, k, v, do = _inputs("fp16", 128, 1, 300, 400, 2, 2, seed=11)
    dlse = torch.randn(1, 2, 300, device="cuda", dtype=torch.float64)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o, lse = auto(*leaves, causal=True, return_lse=True)
    got = torch.autograd.grad((o.double() * do.double()).sum() + (lse.double() * dlse).sum(), leaves)
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_o, ref_lse = reference.attention(*ref_leaves, causal=True, return_lse=True)
    want = torch.autograd.grad((ref_o * do.double()).sum() + (ref_lse * dlse).sum(), ref_leaves)
    for name, x, w in zip(("dq", "dk", "dv"), got, want):
        err = (x.double() - w).abs().max().item()
        assert math.isfinite(err) and err <= 2e-2 * max(1.0, w.abs().max().item()), f"{name}: max error {err:.3e}"


def test_training_steps_under_torch_compile_match_eager(auto):
    q, k, v, do = _inputs("bf16", 128, 2, 512, 512, 4, 2, seed=5)

    def step(q, k, v):
        return torch.autograd.grad(auto(q, k, v, causal=True), (q, k, v), do)

    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    eager = step(*leaves)
    compiled = torch.compile(lambda q, k, v: auto(q, k, v, causal=True), fullgraph=True)
    traced = torch.autograd.grad(compiled(*leaves), leaves, do)
    for a, b in zip(eager, traced):
        assert torch.equal(a.isnan(), b.isnan())
        torch.testing.assert_close(a, b, atol=2e-2, rtol=0)  # dq's fp32 atomics add in a varying order


REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
@pytest.mark.parametrize("args", [["(FP16, 128, 128, 128, 12): wgmma+stages_2+pingpong+intra+causal", "37", "2", "4", "91", "2", "bottom_right"],
                                  ["(BF16, 64, 128, 64, 4): async+eager+swizzled+load_2_2_2_tiles+buffer+opt_softmax", "130", "1", "2", "77", "1"],
                                  ["(BF16, 192, 64, 64, 4): async+eager+swizzled+load_2_2_2_tiles+buffer+opt_softmax+causal", "130", "1", "4",
                                   "77", "2", "bottom_right"]],
                         ids=["wgmma-fwd-causal-gqa", "mma_sync-fwd-mqa", "d192-causal-gqa"])
def test_compute_sanitizer_clean(args, tool):
    """The backward's three kernels (and the forward) on odd lengths: no out-of-bounds access, no race."""
    exe = shutil.which("compute-sanitizer")
    if exe is None:
        pytest.skip("compute-sanitizer not on PATH")
    if "wgmma" in args[0] and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma forward needs sm_90a")
    res = subprocess.run([exe, "--tool", tool, "--error-exitcode", "9", sys.executable, str(REPO / "tests/gpu/run_one.py"),
                          *args, "--backward"], capture_output=True, text=True, cwd=REPO, timeout=600)
    text = res.stdout + res.stderr
    assert res.returncode == 0, text[-6000:]
    assert "ERROR SUMMARY: 0 errors" in text or "(0 errors, 0 warnings)" in text, text[-3000:]


# ---- deterministic backward: bit-identical gradients run to run ------------------------------------------

#: (dtype, d_head, batch, seq_q, seq_k, heads, kv_heads, call keywords): odd lengths, GQA, several key
#: blocks per query block (the ordered dQ adds), causal and not
DET_CASES = [
    ("fp16", 128, 2, 1000, 777, 4, 2, {}),
    ("bf16", 128, 1, 1000, 777, 8, 2, {"causal": True}),
    ("fp16", 64, 2, 777, 1000, 4, 1, {"causal": True, "align": "bottom_right"}),
    ("bf16", 64, 1, 1000, 1000, 4, 4, {"window": (300, 40)}),
    ("fp16", 256, 1, 1000, 777, 2, 1, {"causal": True}),
]
RUNS = 10


def _grads(attn, q, k, v, do, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    return torch.autograd.grad(attn(*leaves, **kw), leaves, do)


@pytest.fixture(scope="module")
def deterministic_auto():
    """compile("auto", deterministic=True), with the deterministic backward kernels of DET_CASES built first."""
    from flashgen.build import build_many

    cfgs = sorted({BackwardConfig.default(dt, d, _mask_of(kw)).replace(deterministic=True) for dt, d, *_, kw in DET_CASES}, key=str)
    failures = build_many(cfgs, torch.cuda.get_device_capability())
    assert not failures, "\n".join(f"{k}: {v}" for k, v in failures.items())
    return flashgen.compile("auto", deterministic=True)


@pytest.mark.parametrize("case", range(len(DET_CASES)), ids=lambda i: f"{DET_CASES[i][0]}-d{DET_CASES[i][1]}-{DET_CASES[i][3]}x"
                         f"{DET_CASES[i][4]}-h{DET_CASES[i][5]}/{DET_CASES[i][6]}-{_mask_of(DET_CASES[i][7])}")
def test_deterministic_gradients_are_bit_identical_and_right(deterministic_auto, case):
    dt, d, b, sq, sk, h, hk, kw = DET_CASES[case]
    q, k, v, do = _inputs(dt, d, b, sq, sk, h, hk, seed=100 + case)
    first = _grads(deterministic_auto, q, k, v, do, **kw)
    for run in range(1, RUNS):
        _poison_allocator(q, k, v)
        again = _grads(deterministic_auto, q, k, v, do, **kw)
        for name, a, x in zip(("dq", "dk", "dv"), first, again):
            assert torch.equal(a.view(torch.int16), x.view(torch.int16)), f"case {case} run {run}: {name} differs"
    _check_gradients(first, q, k, v, do, f"deterministic case {case}", **kw)


def test_torch_deterministic_mode_gives_bit_identical_gradients(auto):
    """A plain compile("auto") object under torch.use_deterministic_algorithms: the deterministic backward."""
    q, k, v, do = _inputs("fp16", 128, 1, 1000, 777, 4, 2, seed=21)
    was, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
        runs = [_grads(auto, q, k, v, do, causal=True) for _ in range(RUNS)]
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn)
    for run in runs[1:]:
        for name, a, x in zip(("dq", "dk", "dv"), runs[0], run):
            assert torch.equal(a.view(torch.int16), x.view(torch.int16)), f"{name} differs between runs"
    _check_gradients(runs[0], q, k, v, do, "torch deterministic mode", causal=True)


def _backward_ms(attn, q, k, v, do, reps: int = 10, **kw) -> float:
    """Median milliseconds of one backward (the three kernels and the autograd glue) of a recorded call."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o = attn(*leaves, **kw)
    times = []
    for i in range(reps + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.autograd.grad(o, leaves, do, retain_graph=True)
        end.record()
        torch.cuda.synchronize()
        if i >= 3:  # warm-up: builds, caches, clocks
            times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


@pytest.mark.parametrize("kw", [{}, {"causal": True}], ids=["none", "causal"])
def test_report_the_cost_of_the_deterministic_backward(auto, deterministic_auto, kw):
    """Not an assertion: prints the backward's time with and without ordered dQ adds at seq 4096 (run with -s)."""
    q, k, v, do = _inputs("bf16", 128, 2, 4096, 4096, 16, 16, seed=3)
    plain, ordered = _backward_ms(auto, q, k, v, do, **kw), _backward_ms(deterministic_auto, q, k, v, do, **kw)
    print(f"\n[deterministic cost] {torch.cuda.get_device_name()} bf16 d128 batch 2 seq 4096 heads 16 {_mask_of(kw)}: "
          f"backward {plain:.3f} ms, deterministic {ordered:.3f} ms ({100 * (ordered / plain - 1):+.1f}%)")
