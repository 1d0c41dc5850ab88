"""`flashgen tune --passes bwd` on a GPU: the gradient check that guards a winner fails a wrong kernel,
and a tuned winner is stored where ``compile("auto")``'s gradients find it."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import flashgen  # noqa: E402
from flashgen.build import build  # noqa: E402
from flashgen.dsl.backward_config import BackwardConfig  # noqa: E402
from flashgen.dsl.dtypes import DType  # noqa: E402
from flashgen.policy import backward_bucket_key, load_cache  # noqa: E402
from flashgen.runtime import _load  # noqa: E402
from flashgen.tune_backward import Bucket, tune_backward  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _handle(cfg: BackwardConfig) -> int:
    return _load(build(cfg), False)


def test_the_gradient_check_passes_the_right_kernel_and_fails_a_wrong_one():
    bucket = Bucket(DType.FP16, 128, batch=1, seq=300, heads=2, causal=False, seed=1)
    assert bucket.check(_handle(BackwardConfig.default("fp16", 128))) is None
    why = bucket.check(_handle(BackwardConfig.default("fp16", 128, "causal")))  # masks keys the call keeps
    assert why is not None and "bound" in why


def test_a_tuned_backward_is_stored_and_used_by_compile_auto(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHGEN_TUNE_CACHE", str(tmp_path / "tune.json"))
    candidates = [BackwardConfig.default("bf16", 128), BackwardConfig("bf16", d_head=128, B_r=64, B_c=32, n_warps=8, d_split=4)]
    found = tune_backward(candidates, [512], heads=2, rounds=1, finalists=2)
    [entry] = found.values()
    assert entry["config"] in {c.short_form() for c in candidates} and entry["tflops"] > 0
    stored = load_cache()[torch.cuda.get_device_name()]["bf16"]["128"][backward_bucket_key(512)]
    assert stored["config"] == entry["config"]
    auto = flashgen.compile("auto")
    q, k, v = (torch.randn(1, 512, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    auto(q, k, v).sum().backward()
    attn = auto.pick(q.device, q.dtype, 128, 512, "none")
    assert attn.backward_config(512).short_form() == entry["config"]
