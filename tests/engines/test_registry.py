"""The engine registry and the target table: which engine builds a config, which GPUs run it."""
from __future__ import annotations

import pytest

import flashgen
from flashgen import engines, targets
from flashgen.dsl.config import KernelConfig, default_configs, hopper_configs


def test_every_config_has_its_engine_and_plan():
    for cfg in default_configs() + hopper_configs():
        engine = engines.engine_of(cfg)
        assert engine.name == cfg.engine
        plan = engine.make_plan(cfg)
        assert plan.cfg == cfg and engine.emit(plan).text == flashgen.emit(cfg).text


def test_an_engine_runs_on_the_targets_that_have_its_instructions():
    mma, wgmma = engines.engine_named("mma_sync"), engines.engine_named("wgmma")
    on = {name: [e.name for e in engines.runnable_on(t)] for name, t in targets.TARGETS.items()}
    assert on == {"sm_80": ["mma_sync"], "sm_86": ["mma_sync"], "sm_87": ["mma_sync"], "sm_89": ["mma_sync"],
                  "sm_90a": ["wgmma", "mma_sync"]}
    newer = targets.of_capability((12, 0))  # not in the table: the Ampere families carry over, sm_90a's do not
    assert mma.runs_on(newer) and not wgmma.runs_on(newer) and not mma.runs_on(targets.of_capability((7, 5)))
    assert wgmma.refusal(targets.named("sm_80")) == "wgmma kernels need sm_90a"
    assert mma.refusal(targets.of_capability((7, 5))) == "mma_sync kernels need sm_80 or newer"
    assert wgmma.needs == "compute capability 9.0 (sm_90a)" and mma.needs == "compute capability 8.0 (sm_80) or newer"


def test_targets_name_their_nvcc_flags():
    sm90 = targets.of_capability((9, 0))
    assert (sm90.name, sm90.arch, sm90.gencode) == ("sm_90a", "9.0a", "-gencode=arch=compute_90a,code=sm_90a")
    assert targets.named("sm_86").gencode == "-gencode=arch=compute_86,code=sm_86"
    with pytest.raises(targets.UnknownTarget, match="supported: sm_80"):
        targets.named("sm_70")


def test_the_preferred_engine_gives_the_shipped_defaults():
    assert engines.preferred(targets.named("sm_90a")).name == "wgmma"
    assert engines.preferred(None).name == "mma_sync"
    with pytest.raises(ValueError, match="unknown engine 'tpu'"):
        engines.engine_named("tpu")


def test_the_emitted_manifest_names_the_engines_target():
    wgmma = flashgen.emit(KernelConfig.wgmma("fp16"))
    assert wgmma.meta["arch"] == "sm_90a" and "-gencode=arch=compute_90a,code=sm_90a" in wgmma.text
    assert "arch" not in flashgen.emit(default_configs()[0]).meta


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_the_mma_sync_default_takes_every_head_size_from_24_to_256(dtype):
    """Past d_head 160 the seed default's 128 query rows leave its O and S accumulators too few registers:
    the default falls back to 64 rows (16 per warp) there, and keeps 128 rows where they fit."""
    from flashgen.dsl.dtypes import DType

    engine = engines.ENGINES["mma_sync"]
    for d_head in range(24, 257, 8):
        cfg = engine.default_config(DType.parse(dtype), d_head)
        assert cfg.d_head == d_head and cfg.B_r == (128 if d_head <= 160 else 64), cfg
