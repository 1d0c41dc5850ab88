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


def test_the_wgmma_tuning_space_times_both_query_block_sizes_of_a_head_size():
    """Each shipped stage count with the head size's other query block size: 64 beside 128 at d_head 64, 64 beside
    80 at d_head 128 (80 beside 64 under a causal mask), each past 64 rows also with exp_first, but for 128 rows with
    one stage (its window kernel with ordered dQ adds spilled); a forward with mods is differentiated in 64-row blocks
    either way (ptxas spilled softcap's code and serialized the wgmma with ALiBi at 80 rows), exp_first dropped."""
    from flashgen.dsl.dtypes import DType

    ef = "exp_first"
    for d_head, mask, space in (
            (64, "none", [(128, 2), (128, 2, ef), (64, 2), (128, 1), (64, 1)]),
            (128, "none", [(80, 2), (80, 2, ef), (64, 2), (80, 1), (80, 1, ef), (64, 1)]),
            (128, "causal", [(64, 2), (80, 2), (80, 2, ef), (64, 1), (80, 1), (80, 1, ef)])):
        cfgs = engines.ENGINES["wgmma"].backward.tuning_space(DType.BF16, d_head, mask)
        assert [(c.B_r, c.stages) + ((ef,) if c.exp_first else ()) for c in cfgs] == space
        shipped = BackwardConfig.wgmma("bf16", d_head, mask)
        assert shipped in cfgs and [c for c in cfgs if not c.exp_first][0] == shipped.replace(exp_first=False)
    narrow = BackwardConfig.wgmma("bf16", 128)
    assert engines.backward_of(narrow).with_mods(narrow) == narrow.replace(B_r=64)
    wide = narrow.replace(B_r=80, exp_first=True)
    assert engines.backward_of(wide).with_mods(wide) == engines.backward_of(wide).fallback(wide) == narrow.replace(B_r=64)


def test_a_forward_with_mods_is_differentiated_in_64_row_query_blocks(monkeypatch):
    """The wgmma backward at d_head 64 ships 128-row query blocks, where ptxas spills the mods' code: a forward
    carrying a score_mod or mask_mod gets its 64-row variant (its ordered dQ adds kept); without mods, or on an
    engine that builds every shape with mods, the config stays."""
    from types import SimpleNamespace

    from flashgen.runtime import Attention
    from flashgen.dsl.config import KernelConfig

    wide = BackwardConfig.wgmma("bf16", 64, "causal").replace(deterministic=True)
    narrow = wide.replace(B_r=64, exp_first=False)
    assert wide.exp_first and engines.backward_of(wide).with_mods(wide) == narrow
    assert engines.backward_of(narrow).with_mods(narrow) == narrow
    sync = BackwardConfig("bf16", d_head=64, B_r=128)
    assert engines.backward_of(sync).with_mods(sync) == sync
    monkeypatch.setattr("flashgen.runtime.backward_lookup", lambda *a, **k: wide)
    fwd = KernelConfig.wgmma("bf16", d_head=64, mask="causal")
    call = lambda mods: Attention.backward_config(  # noqa: E731
        SimpleNamespace(cfg=fwd, built=SimpleNamespace(capability=(9, 0), mods=mods), deterministic=True, backward_engine=None))
    assert call(None) == wide and call(_mods(mask=True)) == narrow


def _mods(score: bool = False, mask: bool = False):
    """KernelMods of a softcap score_mod and / or a prefix-LM mask_mod."""
    import torch

    from flashgen.mods.kernel_mods import prepare_mods

    return prepare_mods(score_mod=(lambda s, b, h, q, kv: 20.0 * torch.tanh(s / 20.0)) if score else None,
                        mask_mod=(lambda b, h, q, kv: (kv <= q) | (kv < 5)) if mask else None)[0]


@pytest.mark.parametrize("d_head, deterministic, score, rows", [
    (64, False, False, 128),   # a mask_mod alone: its code fits beside 128-row blocks
    (64, True, False, 64),     # ordered dQ adds: ptxas serialized the wgmma with prefix LM there
    (64, False, True, 64),     # with a score_mod: ptxas spilled
    (128, False, False, 64),   # 80 rows: ptxas serialized the wgmma with the sliding window with sinks
])
def test_a_mask_mod_alone_keeps_wide_query_blocks_where_its_code_fits(d_head, deterministic, score, rows):
    cfg = BackwardConfig.wgmma("bf16", d_head).replace(deterministic=deterministic)
    assert engines.backward_of(cfg).with_mods(cfg, _mods(score=score, mask=True)).B_r == rows
    assert engines.backward_of(cfg).with_mods(cfg, _mods(score=True)).B_r == 64
