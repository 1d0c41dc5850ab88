"""GPU correctness of emitted kernels against a float64 reference (marked ``gpu``).

Rule (FlashAttention's tests, :func:`flashgen.reference.check_attention`): max|o - ref64| <=
2 * max|o_16 - ref64| + 1e-5, where o_16 is the same attention at a flash kernel's 16-bit
precision (fp32 scores and softmax, 16-bit probabilities and output); the output is poisoned
with NaN before every call and must hold no NaN/Inf afterwards. Inputs are fresh random normals.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from flashgen.dsl.config import default_configs, kernel_progression, tuning_space  # noqa: E402
from flashgen.reference import check_attention  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

REPO = Path(__file__).resolve().parents[2]


def _all_configs():
    prog = kernel_progression()
    prog = prog + [c.replace(dtype="bf16") for c in prog]
    seen = {}
    for c in tuning_space() + prog + default_configs():
        seen.setdefault(c, None)
    return list(seen)


CONFIGS = _all_configs()
SHAPES = [(2, 256, 3), (1, 512, 2), (3, 384, 1)]  # (batch, seq, heads); multiples of every B_r/B_c used


@pytest.fixture(scope="session")
def built():
    """Warm the build cache for every config in parallel, then hand out compiled ops."""
    import flashgen
    from flashgen.build import build_many

    failures = build_many(CONFIGS, torch.cuda.get_device_capability())
    assert not failures, "\n".join(f"{k}: {v}" for k, v in failures.items())
    return {c: flashgen.compile(c) for c in CONFIGS}


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.mangle())
def test_matches_float64_reference(built, cfg):
    attn = built[cfg]
    for b, s, h in SHAPES:
        if s % cfg.B_r or s % cfg.B_c:
            continue
        q, k, v = (torch.randn(b, s, h, cfg.d_head, device="cuda", dtype=cfg.dtype.torch) for _ in range(3))
        out = torch.full_like(q, float("nan"))
        attn(q, k, v, out=out)
        check_attention(out, q, k, v, f"shape {(b, s, h)}")
        o2 = attn(q, k, v)  # functional form allocates its own output
        assert torch.equal(o2, out)


@pytest.mark.parametrize("cfg", default_configs(), ids=lambda c: c.mangle())
def test_strided_inputs_and_scale(built, cfg):
    """(batch, heads, seq, d) tensors passed as transposed views, a custom scale, seq_q != seq_k."""
    attn = built[cfg]
    b, h, sq, sk = 2, 3, 256, 384
    q = torch.randn(b, h, sq, cfg.d_head, device="cuda", dtype=cfg.dtype.torch).transpose(1, 2)
    k = torch.randn(b, h, sk, cfg.d_head, device="cuda", dtype=cfg.dtype.torch).transpose(1, 2)
    v = torch.randn(b, h, sk, cfg.d_head, device="cuda", dtype=cfg.dtype.torch).transpose(1, 2)
    out = torch.full((b, sq, h, cfg.d_head), float("nan"), device="cuda", dtype=cfg.dtype.torch)
    attn(q, k, v, out=out, softmax_scale=0.05)
    check_attention(out, q, k, v, softmax_scale=0.05)
    # a batch slice of a larger tensor: non-zero offset, same strides
    big = torch.randn(4, sq, h, cfg.d_head, device="cuda", dtype=cfg.dtype.torch)
    qs = big[1:3]
    o = attn(qs, qs, qs)
    check_attention(o, qs, qs, qs)


def test_rejects_unsupported_inputs(built):
    from flashgen.runtime import InputError

    cfg = default_configs()[0]
    attn = built[cfg]
    good = lambda *shape, **kw: torch.randn(*shape, device=kw.get("device", "cuda"), dtype=kw.get("dtype", cfg.dtype.torch))
    q = good(1, 256, 2, 128)
    cases = [
        ((good(1, 256, 2, 128, dtype=torch.bfloat16), q, q), "dtype"),
        ((good(1, 256, 2, 128, device="cpu"), q, q), "CUDA"),
        ((good(1, 256, 2, 64), q, q), "d_head"),
        ((good(1, 0, 2, 128), q, q), "sequence lengths"),
        ((good(0, 256, 2, 128), good(0, 256, 2, 128), good(0, 256, 2, 128)), "batch and heads must be >= 1"),
        ((good(1, 256, 0, 128), q, q), "batch and heads must be >= 1"),
        ((q, good(1, 200, 2, 128), good(1, 100, 2, 128)), "same shape"),
        ((good(1, 256, 2, 256)[..., ::2], q, q), "contiguous"),
        ((q, good(1, 256, 4, 128), good(1, 256, 4, 128)), "multiple of k/v's 4 heads"),
        ((good(256, 2, 128), q, q), "4-D"),
    ]
    for (a, b_, c), words in cases:
        with pytest.raises(InputError, match=words):
            attn(a, b_, c)
    with pytest.raises(InputError, match="out has shape"):
        attn(q, q, q, out=good(1, 128, 2, 128))


def test_torch_compile_and_cuda_graph(built):
    cfg = default_configs()[0]
    attn = built[cfg]
    q, k, v = (torch.randn(2, 256, 2, 128, device="cuda", dtype=cfg.dtype.torch) for _ in range(3))
    expected = attn(q, k, v)

    compiled = torch.compile(lambda q, k, v: attn(q, k, v) * 2, fullgraph=True)
    assert torch.equal(compiled(q, k, v), expected * 2)
    with pytest.raises(Exception, match="must have the same shape"):  # traced calls: the operator's own check
        compiled(q, k[:, :100], v)

    check_graph_replay(attn, q, k, v)


def check_graph_replay(attn, q, k, v):
    """Capture ``attn(q, k, v, out=...)`` in a CUDA graph, poison the output, replay on new q, check."""
    out = torch.empty_like(q)
    attn(q, k, v, out=out)  # warm-up outside capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        attn(q, k, v, out=out)
    out.fill_(float("nan"))
    q.copy_(torch.randn_like(q))
    g.replay()
    torch.cuda.synchronize()
    check_attention(out, q, k, v)


def test_auto_under_torch_compile_and_cuda_graph_capture():
    """compile("auto") traces with fullgraph=True (the pick is a constant of the graph, sequence lengths of
    another bucket retrace) and captures into a CUDA graph; a CPU tensor gets flashgen's InputError."""
    import flashgen
    from flashgen.runtime import InputError

    auto = flashgen.compile("auto")
    compiled = torch.compile(lambda q, k, v: auto(q, k, v, causal=True) * 2, fullgraph=True)
    for seq in (200, 1000, 3000):
        q, k, v = (torch.randn(1, seq, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        assert torch.equal(compiled(q, k, v), auto(q, k, v, causal=True) * 2)
    check_graph_replay(auto, q, k, v)
    with pytest.raises(InputError, match="flashgen kernels run on CUDA devices"):
        auto(q.cpu(), k.cpu(), v.cpu())
    for args, kwargs, words in (((q, k[:, :100], v), {}, "same shape"), ((q, k, v), {"out": q[:, :10]}, "out has shape"),
                                ((q, k, v), {"align": "middle"}, "align="), ((q, k[..., ::2], v), {}, "d_head")):
        with pytest.raises(InputError, match=words):  # a dispatch hit checked by the launcher, explained by Python
            auto(*args, **kwargs)


def test_second_process_hits_cache(built):
    cfg = default_configs()[0]
    code = (
        "import flashgen; a = flashgen.compile(%r); "
        "print('HIT' if a.built.cache_hit else 'MISS', round(a.compile_seconds, 2))" % cfg.short_form()
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=os.environ.copy())
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("HIT"), res.stdout


@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
@pytest.mark.parametrize("cfg", kernel_progression(), ids=lambda c: c.mangle())
def test_compute_sanitizer_clean(built, cfg, tool):
    exe = shutil.which("compute-sanitizer")
    if exe is None:
        pytest.skip("compute-sanitizer not on PATH")
    res = subprocess.run(
        [exe, "--tool", tool, "--error-exitcode", "9", sys.executable, str(REPO / "tests/gpu/run_one.py"), cfg.short_form(), "128", "1", "1"],
        capture_output=True, text=True, cwd=REPO, timeout=600,
    )
    text = res.stdout + res.stderr
    assert res.returncode == 0, text[-6000:]
    # memcheck: "ERROR SUMMARY: 0 errors"; racecheck: "RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"
    assert "ERROR SUMMARY: 0 errors" in text or "(0 errors, 0 warnings)" in text, text[-3000:]


@pytest.mark.parametrize("cfg", ["(FP16, 72, 64, 64, 4): async+eager+swizzled+load_0_2_2_tiles+opt_softmax+causal",
                                 "(BF16, 128, 128, 64, 4): async+eager+swizzled+load_2_2_2_tiles+buffer+opt_softmax"])
def test_memcheck_clean_on_odd_lengths(cfg):
    """Tails: seq_q=37, seq_k=91 (no block is full), GQA 4 -> 2 heads; no out-of-bounds access."""
    exe = shutil.which("compute-sanitizer")
    if exe is None:
        pytest.skip("compute-sanitizer not on PATH")
    res = subprocess.run(
        [exe, "--tool", "memcheck", "--error-exitcode", "9", sys.executable, str(REPO / "tests/gpu/run_one.py"), cfg, "37", "2", "4", "91", "2"],
        capture_output=True, text=True, cwd=REPO, timeout=600,
    )
    text = res.stdout + res.stderr
    assert res.returncode == 0 and "ERROR SUMMARY: 0 errors" in text, text[-6000:]
