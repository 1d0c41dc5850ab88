"""The emitted backward on a GPU (mma.sync; wgmma on compute capability 9.0): dQ, dK, dV of the three kernels
(preprocess, main, dQ conversion) against float64 autograd (flashgen.reference.gradients) within FlashAttention's rule,
measured by the same gradients at the kernel's 16-bit roundings (flashgen.sim.grad_reference).

The .cu is compiled to a shared library with nvcc and called through its C launcher with ctypes
(the backward is not bound to torch yet); o and lse come from the float64 forward."""
from __future__ import annotations

import ctypes
import math
import shutil
import subprocess

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from flashgen import reference  # noqa: E402
from flashgen.dsl.backward_config import BackwardConfig  # noqa: E402
from flashgen import engines  # noqa: E402
from flashgen.emit.abi import BACKWARD_FIELDS
from flashgen.sim.grad_reference import gradients as lowp_gradients  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to build the kernel")]

_CTYPES = {"const void*": ctypes.c_void_p, "void*": ctypes.c_void_p, "const float*": ctypes.c_void_p, "const int64_t*": ctypes.c_void_p, "const int*": ctypes.c_void_p,
           "int64_t": ctypes.c_int64, "int": ctypes.c_int, "float": ctypes.c_float}


class _Args(ctypes.Structure):
    """``<name>_args`` of the launcher, from the emitter's own field table."""

    _fields_ = [(n, _CTYPES[t] * k if k else _CTYPES[t]) for n, t, k, _ in BACKWARD_FIELDS]


_I64x3 = ctypes.c_int64 * 3


def _library(cfg: BackwardConfig, tmp_path):
    src = engines.emit_backward(cfg)
    cu, so = tmp_path / f"{src.name}.cu", tmp_path / f"{src.name}.so"
    cu.write_text(src.text)
    major, minor = torch.cuda.get_device_capability()
    # sm_90a's PTX (wgmma, setmaxnreg): -arch=sm_90a alone also embeds compute_90 PTX, which ptxas cannot assemble
    target = "-gencode=arch=compute_90a,code=sm_90a" if (major, minor) == (9, 0) else f"-arch=sm_{major}{minor}"
    subprocess.run(["nvcc", "-O3", "-std=c++17", "--expt-relaxed-constexpr", target, "-shared", "-Xcompiler", "-fPIC",
                    str(cu), "-o", str(so)], check=True, capture_output=True)
    return ctypes.CDLL(str(so)), src.name


def _strides(t):  # (batch, seq, heads, d) -> (batch, head, seq) element strides
    return _I64x3(t.stride(0), t.stride(2), t.stride(1))


def _run(cfg, tmp_path, q, k, v, do, mask):
    lib, name = _library(cfg, tmp_path)
    o, lse = reference.attention(q, k, v, return_lse=True, **mask)
    o, lse = o.to(q.dtype), lse.to(torch.float32).contiguous()
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))  # poisoned: every element must be written
    Sq, Sk = q.shape[1], k.shape[1]
    left, right = (-1, 0) if mask.get("causal") else mask.get("window", (-1, -1))
    a = _Args(*(t.data_ptr() for t in (q, k, v, o, do, dq, dk, dv, lse)), None, *(_strides(t) for t in (q, k, v, o, do, dq, dk, dv)),
              q.shape[0], q.shape[2], k.shape[2], Sq, Sk, 1 / math.sqrt(q.shape[3]),
              Sk - Sq if mask.get("align") == "bottom_right" else 0, left, right, None)
    size, zeroed = ctypes.c_size_t(), ctypes.c_size_t()
    assert getattr(lib, f"{name}_workspace")(ctypes.byref(a), ctypes.byref(size), ctypes.byref(zeroed)) == 0
    # poisoned but for the part the launch asks to be zero: the kernels zero the dQ buffer themselves
    ws = torch.full((size.value // 4,), float("nan"), dtype=torch.float32, device=q.device)
    ws[:zeroed.value // 4] = 0
    a.workspace = ws.data_ptr()
    assert getattr(lib, f"{name}_launch")(ctypes.byref(a), ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)) == 0
    torch.cuda.synchronize()
    return dq, dk, dv


CASES = [
    (BackwardConfig("fp16", d_head=64), 1, 17, 113, 2, 2, {}),
    (BackwardConfig("bf16", d_head=64, mask="causal"), 2, 113, 113, 4, 2, {"causal": True}),
    (BackwardConfig("fp16", d_head=64, B_r=128, B_c=128, n_warps=8, mask="causal"), 1, 300, 520, 2, 1, {"causal": True, "align": "bottom_right"}),
    (BackwardConfig("fp16", d_head=40, B_c=32, n_warps=2, swizzled=False, mask="window"), 1, 200, 77, 2, 2, {"window": (30, 5)}),
    (BackwardConfig("bf16", d_head=128), 1, 257, 129, 1, 1, {}),
    (BackwardConfig("fp16", n_warps=8, d_split=2), 2, 257, 129, 4, 2, {}),
    (BackwardConfig("bf16", n_warps=8, d_split=2, mask="causal"), 1, 300, 520, 2, 1, {"causal": True, "align": "bottom_right"}),
    (BackwardConfig("fp16", n_warps=8, d_split=2, stages=2), 2, 1000, 777, 4, 2, {}),
    (BackwardConfig("bf16", n_warps=8, d_split=2, mask="causal", stages=2), 1, 300, 520, 2, 1, {"causal": True, "align": "bottom_right"}),
    (BackwardConfig("fp16", d_head=64, mask="window", stages=2), 1, 513, 200, 2, 2, {"window": (50, 7)}),
    (BackwardConfig("bf16", d_head=256, n_warps=8, d_split=2, stages=2), 1, 1, 1, 1, 1, {}),
    # split_scores: each warp its query columns of S^T and dP^T, P^T and dS^T through shared memory (d_head 256: over
    # sm_80's shared memory, as the d_head 256 case above)
    (BackwardConfig("bf16", d_head=256, n_warps=8, d_split=2, mask="causal", stages=2, split_scores=True), 1, 300, 520, 2, 1,
     {"causal": True, "align": "bottom_right"}),
    (BackwardConfig("bf16", d_head=256, n_warps=8, d_split=4, stages=2, split_scores=True), 2, 1000, 777, 4, 2, {}),
    (BackwardConfig("fp16", d_head=256, n_warps=8, d_split=4, mask="causal", split_scores=True, deterministic=True), 1, 333, 333,
     2, 2, {"causal": True}),
    (BackwardConfig("fp16", n_warps=8, d_split=2, mask="window", stages=2, split_scores=True), 1, 513, 200, 2, 2, {"window": (50, 7)}),
    (BackwardConfig("bf16", d_head=64, n_warps=8, d_split=4, stages=2, split_scores=True), 2, 257, 129, 4, 2, {}),
    # the shipped mma_sync shapes: 128 x 128 blocks of 8 warps (d_head 64), pairs on 128 key rows (up to 128), fours
    # on 64 (past 128), with split scores past 64; d_head 96 and 192 pad each warp's columns to a power of two
    (BackwardConfig.default("bf16", 64, "window"), 1, 513, 200, 2, 2, {"window": (50, 7)}),
    (BackwardConfig.default("fp16", 96), 2, 257, 129, 4, 2, {}),
    (BackwardConfig.default("bf16", 128, "causal"), 1, 300, 520, 2, 1, {"causal": True, "align": "bottom_right"}),
    (BackwardConfig.default("fp16", 192, "causal"), 2, 1000, 777, 4, 2, {"causal": True}),
    # wgmma, d_head 128: 64-row query blocks (shipped under a mask) and 80-row ones (shipped unmasked; dQ^T = K^T dS^T)
    (BackwardConfig.wgmma("bf16", 128).replace(B_r=64), 1, 1000, 777, 4, 2, {}),
    (BackwardConfig.wgmma("bf16", 128), 1, 1000, 777, 4, 2, {}),
    (BackwardConfig.wgmma("fp16", 128, "causal").replace(B_r=80), 2, 300, 520, 2, 1, {"causal": True, "align": "bottom_right"}),
    (BackwardConfig.wgmma("bf16", 128, "causal", stages=1).replace(B_r=80, deterministic=True), 1, 333, 333, 2, 2, {"causal": True}),
    (BackwardConfig.wgmma("bf16", 128, "window").replace(B_r=80), 1, 241, 101, 2, 1, {"window": (40, 7)}),
    # exp_first: the exponentials under dP^T's GEMM (80 rows; d_head 64's 128 rows ship it, so their split order
    # here); longest_first: key blocks slowest in the grid, with the ordered adds too (a lower key block of a pair must
    # still start first)
    (BackwardConfig.wgmma("bf16", 128).replace(exp_first=True), 2, 1000, 777, 4, 2, {}),
    (BackwardConfig.wgmma("fp16", 64, "causal").replace(exp_first=False), 1, 300, 520, 2, 1, {"causal": True, "align": "bottom_right"}),
    (BackwardConfig.wgmma("bf16", 128, "causal").replace(longest_first=True, deterministic=True), 2, 333, 333, 4, 2, {"causal": True}),
    (BackwardConfig.default("bf16", 128, "causal").replace(longest_first=True), 1, 300, 520, 2, 1, {"causal": True, "align": "bottom_right"}),
    (BackwardConfig.default("fp16", 64, "causal").replace(longest_first=True, deterministic=True), 2, 1000, 777, 4, 2, {"causal": True}),
    # more (kv head, batch) pairs than longest_first's tail (4 key blocks: 66 pairs on 132 SMs), so that both parts run
    (BackwardConfig.wgmma("bf16", 128, "causal").replace(longest_first=True, deterministic=True), 5, 500, 500, 32, 16, {"causal": True}),
    (BackwardConfig.default("bf16", 128, "causal").replace(longest_first=True), 5, 400, 500, 16, 16, {"causal": True, "align": "bottom_right"}),
    # dq_split: dQ on a warp grid of its own (d_head 128: 32 x 32 warp tiles instead of 16 x 64; d_head 64: 64 x 16),
    # odd lengths, GQA, the ordered adds
    (BackwardConfig.default("bf16", 128).replace(dq_split=4), 2, 1000, 777, 4, 2, {}),
    (BackwardConfig.default("bf16", 128, "causal").replace(dq_split=4, deterministic=True), 1, 300, 520, 2, 1,
     {"causal": True, "align": "bottom_right"}),
    (BackwardConfig.default("fp16", 64, "causal").replace(dq_split=4), 2, 333, 333, 4, 2, {"causal": True}),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_backward_kernels_match_float64_autograd(case, tmp_path):
    cfg, B, Sq, Sk, H, Hk, mask = CASES[case]
    if cfg.engine == "wgmma" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma backward needs sm_90a")
    g = torch.Generator(device="cuda").manual_seed(case)
    dt = cfg.dtype.torch
    q, do = (torch.randn(B, Sq, H, cfg.d_head, device="cuda", generator=g).to(dt) for _ in range(2))
    k, v = (torch.randn(B, Sk, Hk, cfg.d_head, device="cuda", generator=g).to(dt) for _ in range(2))
    got = _run(cfg, tmp_path, q, k, v, do, mask)
    want = reference.gradients(q, k, v, do, **mask)
    vals = [x.to(torch.float64).cpu().numpy() for x in (q, k, v, do)]
    rnd = lambda x: torch.from_numpy(x).to(dt).to(torch.float64).numpy()
    base = lowp_gradients(*vals, **mask, round16=rnd)
    for name, x, w, b in zip(("dq", "dk", "dv"), got, want, base):
        reference.check_close(x, w, torch.from_numpy(b).to(x.device), what=f"{cfg} {name}")
