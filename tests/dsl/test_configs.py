"""Either kind of config (flashgen.dsl.configs): backward short forms through the grammar and the
knob table's flags, records that name their kind, and the forward-only loader's refusal."""
from __future__ import annotations

import pytest

from flashgen.dsl import configs
from flashgen.dsl.backward_config import BackwardConfig
from flashgen.dsl.config import ConfigError, KernelConfig
from flashgen.dsl.grammar import NotationError
from flashgen.dsl.sets import NAMED_SETS

ODD = [BackwardConfig("fp16", d_head=40, B_c=32, n_warps=2, swizzled=False, mask="window"),
       BackwardConfig("bf16", d_head=32, B_r=128, B_c=128, n_warps=8, mask="causal"),
       BackwardConfig("fp16", d_head=256, n_warps=8, d_split=2, mask="causal", deterministic=True)]


@pytest.mark.parametrize("cfg", NAMED_SETS["backward"]() + ODD, ids=str)
def test_a_backward_config_reads_back_from_its_name_and_its_record(cfg):
    assert configs.load(cfg.short_form()) == cfg
    assert configs.load(" ".join(cfg.short_form().split()).replace("bwd(", "bwd (\n")) == cfg
    assert configs.from_dict(configs.to_record(cfg)) == cfg
    assert configs.kind_of(cfg) == "backward"


def test_the_backward_set_holds_both_dtypes_and_head_sizes_unmasked_and_causal():
    cfgs = NAMED_SETS["backward"]()
    assert {(c.dtype.value, c.d_head, c.mask) for c in cfgs} == {
        (dt, d, m) for dt in ("fp16", "bf16") for d in (64, 128, 256) for m in ("none", "causal")}
    assert all(isinstance(c, BackwardConfig) for c in cfgs)


def test_a_forward_record_is_its_dict_and_reads_back():
    cfg = KernelConfig("fp16", d_head=64, mask="causal")
    assert configs.to_record(cfg) == cfg.to_dict()
    assert configs.from_dict(configs.to_record(cfg)) == cfg
    assert configs.load(cfg.short_form()) == cfg


def test_a_flag_left_out_takes_its_absent_value():
    cfg = configs.load("bwd(FP16, 64, 64, 4)")
    assert (cfg.d_head, cfg.swizzled, cfg.mask, cfg.engine) == (128, False, "none", "mma_sync")


@pytest.mark.parametrize("text, words", [
    ("bwd(FP16, 64, 64, 64, 4): swizzled+async", ["flag 'async' is not a backward knob", "column 36", "swizzled, causal, window"]),
    ("bwd(FP16, 64, 64, 64, 4): causal+window", ["causal and window exclude each other"]),
    ("bwd(FP16, 64, 64, 64, 4): swizzled+swizzled", ["duplicate flag 'swizzled'"]),
    ("bwd(FP16, 64, 64, 64, 4):", ["expected a flag", "bwd(DTYPE, d_head"]),
    ("bwd(FP32, 64, 64, 64, 4)", ["unknown dtype 'FP32'"]),
])
def test_a_malformed_backward_name_says_where_and_why(text, words):
    with pytest.raises(NotationError) as err:
        configs.load(text)
    for w in words:
        assert w in str(err.value)


@pytest.mark.parametrize("text, words", [
    ("bwd(FP16, 64, 64, 64, 3)", ["invalid backward config 'bwd(FP16, 64, 64, 64, 3)'", "n_warps=3"]),
    ("bwd(FP16, 64, 64, 64, 4): wgmma", ["n_warps=4", "producer"]),
    ("bwd(FP16, 96, 64, 128, 12): wgmma", ["d_head=96", "engine=mma_sync"]),
])
def test_a_backward_name_of_kernels_that_cannot_be_built_names_the_rule(text, words):
    with pytest.raises(ConfigError) as err:
        configs.load(text)
    for w in words:
        assert w in str(err.value)


def test_a_record_of_an_unknown_kind_is_refused():
    with pytest.raises(ConfigError, match="kind='sideways': expected one of forward, backward"):
        configs.from_dict({"kind": "sideways", "dtype": "fp16"})
    with pytest.raises(ConfigError, match="unknown backward config key"):
        configs.from_dict({"kind": "backward", "dtype": "fp16", "async_copy": True})


def test_the_forward_loader_refuses_a_backward_config_by_name():
    for source in (BackwardConfig("fp16", d_head=64), "bwd(FP16, 64, 64, 64, 4): causal", {"kind": "backward", "dtype": "bf16"}):
        with pytest.raises(ConfigError, match=r"flashgen.compile runs forward attention; bwd\(.*is a backward config. Backward kernels run through autograd"):
            configs.forward(source, "flashgen.compile")
    assert configs.forward("(FP16, 128, 64, 4): load_2_2_2_tiles") == KernelConfig.from_short_form("(FP16, 128, 64, 4): load_2_2_2_tiles")


def test_a_backward_knob_in_a_forward_short_form_is_refused_by_name():
    text = "(FP16, 128, 128, 64, 4): async+eager+swizzled+load_2_2_2_tiles+buffer+opt_softmax+d_split_2"
    with pytest.raises(NotationError, match="flag 'd_split_2' is a knob of the backward kernels"):
        KernelConfig.from_short_form(text)


@pytest.mark.parametrize("capability", [(8, 0), (8, 6), (9, 0)])
def test_the_default_backward_takes_two_stages_where_the_gpus_shared_memory_holds_them(capability):
    from flashgen.dsl.backward_config import _default_shapes
    from flashgen.dsl.dtypes import DType
    from flashgen.policy import backward_lookup
    from flashgen.targets import of_capability

    limit = of_capability(capability).smem_per_block
    for d in (32, 64, 96, 128, 256):
        shapes = [BackwardConfig("bf16", d_head=d, mask="causal", **knobs) for knobs in _default_shapes(d)]
        if all(c.replace(stages=1).smem_bytes > limit for c in shapes):
            with pytest.raises(ConfigError, match=f"no backward kernel takes d_head={d} within the {limit}-byte"):
                backward_lookup(DType.BF16, d, "causal", capability)
            continue
        cfg = backward_lookup(DType.BF16, d, "causal", capability)
        two = any(c.replace(stages=2).smem_bytes <= limit for c in shapes)
        assert cfg.smem_bytes <= limit and cfg.stages == (2 if two else 1), (d, cfg)
    assert backward_lookup(DType.FP16, 128, "none", (9, 0)).stages == 2
    assert backward_lookup(DType.FP16, 128, "none", (8, 6)).stages == 1  # 107,520 bytes > 99 KiB
