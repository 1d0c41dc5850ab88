"""KernelConfig: validity rules (with their messages), derived sizes, names, round trips."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashgen.dsl.config import (
    KNOBS,
    ConfigError,
    KernelConfig,
    default_configs,
    is_tuning_candidate,
    kernel_progression,
    load_config,
    tuning_space,
)
from flashgen.dsl.dtypes import DType


def cfg(**kw) -> KernelConfig:
    return KernelConfig(**{"dtype": "fp16", **kw})


@pytest.mark.parametrize(
    "knobs, words",
    [
        ({"eager_load_blocks": True, "async_copy": False}, ["eager_load_blocks", "async_copy"]),
        ({"Q_mma_load_K_tiles": 2, "K_mma_load_K_tiles": 4}, ["Q_mma_load_K_tiles=2", "K_mma_load_K_tiles=4", "equal"]),
        ({"K_mma_load_K_tiles": 3, "Q_mma_load_K_tiles": 0}, ["K_mma_load_K_tiles=3", "power of two"]),
        ({"V_mma_load_K_tiles": 8, "mma_double_buffer_loads": True}, ["V_mma_load_K_tiles=8", "at most 4", "halved"]),
        ({"V_mma_load_K_tiles": 16, "mma_double_buffer_loads": False}, ["V_mma_load_K_tiles=16", "at most 8"]),
        ({"B_r": 96}, ["B_r=96", "multiple"]),
        ({"B_c": 24}, ["B_c=24", "multiple of 16"]),
        ({"n_warps": 3}, ["n_warps=3", "power of two"]),
        ({"d_head": 100}, ["d_head=100", "multiple of 8"]),
        ({"d_head": 264}, ["d_head=264"]),
        ({"d_head": 256, "B_r": 128}, ["accumulators", "registers"]),
        ({"B_r": 256, "B_c": 128, "n_warps": 16, "d_head": 256}, ["shared memory", "exceeds"]),
        ({"B_c": 48, "V_mma_load_K_tiles": 4, "mma_double_buffer_loads": False}, ["V_mma_load_K_tiles=4", "must divide the 48 columns"]),
        ({"mask": "diagonal"}, ["mask='diagonal'", "none, causal, window"]),
        ({"dtype": "fp32"}, ["fp32", "fp16, bf16"]),
        ({"B_r": 64.0}, ["B_r must be an integer"]),
        ({"swizzled": 1}, ["swizzled must be true or false"]),
    ],
)
def test_invalid_configs_name_the_rule_and_values(knobs, words):
    with pytest.raises(ConfigError) as err:
        cfg(**knobs)
    for w in words:
        assert w in str(err.value)


def test_pruning_is_not_validity():
    """The seed's tuning heuristics reject buildable configs; they stay constructible."""
    pruned = cfg(B_r=128, B_c=64, Q_mma_load_K_tiles=0, K_mma_load_K_tiles=2, V_mma_load_K_tiles=2, mma_double_buffer_loads=False)
    assert not is_tuning_candidate(pruned)
    assert all(is_tuning_candidate(c) for c in tuning_space())
    eight_warps = cfg(B_r=64, n_warps=4).replace(n_warps=8, B_r=128)
    assert eight_warps.n_warps == 8


def test_seed_sets():
    space = tuning_space()
    assert len(space) == 80 and len(set(space)) == 80
    assert {c.dtype for c in space} == {DType.FP16, DType.BF16}
    assert len(kernel_progression()) == 7
    assert all(c.B_r >= c.B_c and not (c.B_r < 128 and c.n_warps == 8) for c in kernel_progression(all_block_sizes=True))
    assert cfg() == default_configs()[0]


def test_derived_sizes():
    c = cfg(B_r=128, B_c=64, n_warps=4, d_head=128)
    assert c.threads == 128 and c.rows_per_warp == 32 and c.m_tiles_per_warp == 2
    assert c.smem_bytes == (128 + 2 * 64) * 128 * 2
    assert c.rf_buffers("Q") == 2 and c.load_k_tiles("Q") == 2
    # Q tile: 32 rows x 16 cols x 2 buffers x 2 bytes / (4 bytes x 32 lanes) = 16 registers
    assert c.rf_tile_regs("Q") == 16
    whole = c.replace(Q_mma_load_K_tiles=0, K_mma_load_K_tiles=2)
    assert whole.rf_buffers("Q") == 1 and whole.load_k_tiles("Q") == 16
    assert 1 <= c.ctas_per_sm_estimate <= 3
    odd = cfg(d_head=72, B_r=64, Q_mma_load_K_tiles=0)
    assert (odd.d_mma, odd.d_smem) == (80, 128)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(tuning_space() + kernel_progression(all_block_sizes=True)), st.sampled_from(["none", "causal", "window"]))
def test_round_trips(c, mask):
    c = c.replace(mask=mask)
    assert KernelConfig.from_dict(c.to_dict()) == c
    assert KernelConfig.from_yaml(c.to_yaml()) == c
    assert list(c.to_dict()) == list(KNOBS)
    assert load_config(c.short_form()) == c
    assert load_config(c.to_dict()) == c


def test_names_are_deterministic_and_distinct(tmp_path):
    cs = tuning_space() + kernel_progression(all_block_sizes=True)
    cs = cs + [c.replace(mask="causal") for c in cs]
    assert len({c.mangle() for c in set(cs)}) == len(set(cs))
    assert len({c.content_hash() for c in set(cs)}) == len(set(cs))
    c = cs[0]
    assert c.mangle() == KernelConfig.from_dict(c.to_dict()).mangle()
    assert c.mangle().isidentifier()
    path = tmp_path / "c.yaml"
    path.write_text(c.to_yaml())
    assert load_config(path) == load_config(str(path)) == c


def test_dict_errors():
    with pytest.raises(ConfigError, match="unknown config key"):
        KernelConfig.from_dict({"dtype": "fp16", "Br": 64})
    with pytest.raises(ConfigError, match="missing 'dtype'"):
        KernelConfig.from_dict({"B_r": 64})
    with pytest.raises(ConfigError, match="cannot read a config"):
        load_config("not-a-file-or-short-form")
    assert cfg(B_r=np.int64(64), Q_mma_load_K_tiles=0, B_c=64).B_r == 64


def test_dtype():
    assert DType.parse("BF16") is DType.BF16 and DType.parse("float16") is DType.FP16
    assert DType.FP16.cpp == "__half" and DType.BF16.ptx == "bf16" and DType.FP16.size == 2
    torch = pytest.importorskip("torch")
    assert DType.BF16.torch is torch.bfloat16
