"""The backward behind the engine registry: the mma_sync engine's backward kernels build, emit and
simulate a BackwardConfig, the wgmma engine's are covered, proven and simulated; an engine without
backward kernels says so."""
from __future__ import annotations

import numpy as np
import pytest

from flashgen import engines
from flashgen.dsl.backward_config import BackwardConfig


def test_the_mma_sync_engine_carries_the_backward():
    cfg = BackwardConfig("fp16", d_head=64, mask="causal")
    kernels = engines.backward_of(cfg)
    plan = kernels.make_plan(cfg)
    assert engines.emit_backward(cfg).text == kernels.emit(plan).text
    assert all(c.ok for c in kernels.coverage(plan).values())
    rng = np.random.default_rng(0)
    q, do = rng.standard_normal((1, 20, 2, 64)), rng.standard_normal((1, 20, 2, 64))
    k, v = rng.standard_normal((1, 20, 1, 64)), rng.standard_normal((1, 20, 1, 64))
    res = kernels.simulate(plan, q, k, v, do, causal=True)
    assert res.ok and res.dq.shape == q.shape and res.dk.shape == k.shape


def test_the_wgmma_engine_carries_its_backward_simulator():
    cfg = BackwardConfig("bf16", d_head=64, B_r=64, B_c=128, n_warps=12, engine="wgmma", stages=2, mask="causal")
    kernels = engines.backward_of(cfg)
    plan = kernels.make_plan(cfg)
    assert all(c.ok for c in kernels.coverage(plan).values())
    assert all(c.ok for c in kernels.verify_checks(plan))
    rng = np.random.default_rng(0)
    q, do = rng.standard_normal((1, 20, 2, 64)), rng.standard_normal((1, 20, 2, 64))
    k, v = rng.standard_normal((1, 20, 1, 64)), rng.standard_normal((1, 20, 1, 64))
    res = kernels.simulate(plan, q, k, v, do, causal=True)
    assert res.ok and res.dq.shape == q.shape and res.dk.shape == k.shape


def test_an_engine_without_a_backward_is_refused(monkeypatch):
    cfg = BackwardConfig("bf16", d_head=64, B_r=64, B_c=128, n_warps=12, engine="wgmma")
    monkeypatch.setattr(engines.ENGINES["wgmma"], "backward", None)
    with pytest.raises(ValueError, match="engine wgmma has no backward kernels yet; use one of mma_sync"):
        engines.backward_of(cfg)
