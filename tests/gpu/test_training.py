"""Training through flashgen's backward on a GPU (marked ``gpu``): benchmarks/train_check.py, shortened.

A small transformer trained 150 steps with ``compile("auto")``'s causal attention must follow the loss
curve of the same model trained with SDPA from the same weights on the same batches, within the rule
of the tool's docstring (every logged loss within 2% + 0.02 of SDPA's; both losses at most half of
their first step's at the end)."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("train_check", REPO / "benchmarks" / "train_check.py")
tc = importlib.util.module_from_spec(_spec)
sys.modules["train_check"] = tc  # dataclasses look their module up while the class is made
_spec.loader.exec_module(tc)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_flashgen_attention_records_autograd(dtype):
    q, k, v = (torch.randn(2, 256, 4, 64, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    o = tc.flashgen_attention()(q, k, v)
    assert o.grad_fn is not None
    o.float().square().sum().backward()
    assert all(t.grad is not None and t.grad.shape == t.shape and bool(t.grad.isfinite().all()) for t in (q, k, v))


@pytest.mark.parametrize("d_head", [64, 128])
def test_training_with_flashgen_follows_sdpa(d_head, tmp_path):
    out = tmp_path / "train_check.json"
    status = tc.main(["--steps", "150", "--log-every", "10", "--d-head", str(d_head), "--out", str(out)])
    result = json.loads(out.read_text())
    verdict = result["verdict"]
    assert status == 0 and result["passed"], "\n".join(verdict["reasons"])
    for name, losses in result["losses"].items():
        assert len(losses) == 150
        assert verdict["curves"][-1][name] <= 0.5 * losses[0], name
