"""benchmarks/mods_bench.py on the CPU: its cases are the examples' functions, the FLOPs it credits a mask
with are the share of pairs the mask keeps, and without a GPU it refuses to run."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("mods_bench", REPO / "benchmarks" / "mods_bench.py")
mb = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mb)


def test_every_case_traces_into_a_kernel_mod():
    from flashgen.mods import prepare_mods

    for name, (score, mask) in mb.cases(512, 4, "cpu").items():
        mods, _ = prepare_mods(score, mask)
        assert (mods.score is not None) == (score is not None) and (mods.mask is not None) == (mask is not None), name


def test_kept_fraction_counts_the_pairs_a_mask_keeps():
    n = 300
    cases = mb.cases(n, 4, "cpu")
    assert mb.kept_fraction(None, n, "cpu") == 1.0
    assert mb.kept_fraction(cases["causal_mod"][1], n, "cpu") == pytest.approx((n + 1) / (2 * n))
    lengths = [75 - 37, 75 + 37, 150]
    assert mb.kept_fraction(cases["document"][1], n, "cpu") == pytest.approx(sum(x * x for x in lengths) / n**2)


def test_without_a_gpu_it_says_so(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        mb.main(["--seqs", "256"])
    assert exc.value.code == 2 and "needs a CUDA GPU" in capsys.readouterr().err


def test_with_backward_gives_the_gradients_of_either_layout():
    q = torch.randn(2, 5, 3, 4, requires_grad=True)
    do = torch.randn(2, 5, 3, 4)
    (g,) = mb.with_backward(lambda: q * 2.0, [q], do)()
    assert torch.equal(g, do * 2.0)
    (g,) = mb.with_backward(lambda: q.transpose(1, 2) * 3.0, [q], do)()  # flex's (batch, heads, seq, d)
    assert torch.allclose(g, do * 3.0)


def test_backward_of_runs_the_forward_once_and_the_gradients_every_time():
    q = torch.randn(2, 5, 3, 4, requires_grad=True)
    do = torch.randn(2, 5, 3, 4)
    calls = []

    def forward():
        calls.append(1)
        return q.transpose(1, 2) * 3.0  # flex's (batch, heads, seq, d)
    run = mb.backward_of(forward, [q], do)
    grads = [run()[0] for _ in range(3)]
    assert len(calls) == 1 and all(torch.allclose(g, do * 3.0) for g in grads)


def test_the_gradient_check_passes_a_right_attention_and_fails_a_wrong_one():
    from flashgen import reference

    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(2, 24, 2, 16, generator=g).bfloat16() for _ in range(4))
    softcap = mb.examples.softcap(2.0)
    right = lambda q, k, v, **kw: reference.attention(q, k, v, dtype=torch.float32, **kw).bfloat16()  # noqa: E731
    mb.check_gradients(right, q, k, v, do, "right", score_mod=softcap)
    wrong = lambda q, k, v, **kw: reference.attention(q, k, v, dtype=torch.float32).bfloat16()  # noqa: E731 (ignores the mod)
    with pytest.raises(AssertionError, match="dq"):
        mb.check_gradients(wrong, q, k, v, do, "wrong", score_mod=softcap)
