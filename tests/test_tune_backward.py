"""`flashgen tune --passes bwd` on the CPU: the backward tuning space, the spill filter, the choice of a
checked winner, the cache's backward keys (never a forward entry's) and how they are looked up, and the
command line. Timings, checks and ptxas reports are doubles; ``tests/gpu/test_backward_tuning.py`` runs
the real ones."""
from __future__ import annotations

import functools
import itertools
import re
from pathlib import Path

import pytest

from flashgen import engines

from flashgen.check import CheckResult
from flashgen.ptxas import PtxasStats
from flashgen.cli import main
from flashgen.dsl.backward_config import TUNING_KNOBS, BackwardConfig, tuning_space
from flashgen.dsl.config import ConfigError
from flashgen.dsl.dtypes import DType
from flashgen.policy import (backward_bucket_key, backward_lookup, bucket_key, load_cache, lookup, save_cache,
                             tuned_backward)
from flashgen.targets import of_capability
from flashgen.tune_backward import choose, default_space, fitting, runnable, spill_free, store

H100 = "NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize("d_head", [64, 128, 256])
@pytest.mark.parametrize("dtype, mask", [("bf16", "none"), ("fp16", "causal")])
def test_the_space_is_every_valid_combination_of_the_knobs(dtype, d_head, mask):
    space = tuning_space(dtype, d_head, mask)
    assert space and len(set(space)) == len(space)
    assert BackwardConfig.default(dtype, d_head, mask) in space
    assert {(c.dtype, c.d_head, c.mask) for c in space} == {(DType.parse(dtype), d_head, mask)}
    # what the space leaves out, the config's own rules refuse, but for dQ grids no wider than dK's and dV's
    for values in itertools.product(*TUNING_KNOBS.values()):
        knobs = dict(zip(TUNING_KNOBS, values))
        if 0 < knobs["dq_split"] <= knobs["d_split"]:
            assert not any(c.dq_split and c.dq_split <= c.d_split for c in space)
            continue
        if not any(all(getattr(c, k) == v for k, v in knobs.items()) for c in space):
            with pytest.raises(ConfigError):
                BackwardConfig(dtype, d_head=d_head, mask=mask, **knobs)
    assert {c.swizzled for c in space} == {True, False} and len({c.d_split for c in space}) > 1


def test_the_default_space_is_the_engines_per_dtype_and_head_size():
    space = default_space(["fp16", "bf16"], [64, 128], True, (8, 0))
    assert space == [c for dt in ("fp16", "bf16") for d in (64, 128) for c in tuning_space(dt, d, "causal")]
    assert default_space(["bf16"], [264], False, (9, 0)) == []  # no backward takes d_head 264


def _result(cfg, ok=True, spills=0, stack=0, serialized=False):
    stats = PtxasStats("k", 255, spills, spills, stack, 0, serialized=serialized) if ok else None
    return CheckResult(cfg, "sm_90a", ok, stats, Path("k.cu"), "nvcc ...", "ptxas error: too bad", 1.0)


def test_configs_that_spill_or_do_not_compile_are_dropped_with_why():
    clean, spills, stack, broken, refused, serial = (BackwardConfig("bf16", d_head=d) for d in (32, 48, 64, 80, 96, 112))
    asked = []

    def check(cfgs, archs):
        asked.append(archs)
        return [_result(clean), _result(spills, spills=116), _result(stack, stack=8), _result(broken, ok=False),
                _result(serial, serialized=True)]

    kept, dropped = spill_free([clean, spills, stack, broken, refused, serial], (9, 0), check)
    assert kept == [clean] and asked == [["sm_90a"]]
    assert "serialized its wgmma on sm_90a" in dropped[serial.short_form()]
    assert "spills on sm_90a: 116 B stores" in dropped[spills.short_form()]
    assert "8 B stack" in dropped[stack.short_form()]
    assert "does not compile for sm_90a" in dropped[broken.short_form()] and "too bad" in dropped[broken.short_form()]
    assert "cannot be compiled for sm_90a" in dropped[refused.short_form()]


def test_configs_whose_shared_memory_the_gpu_lacks_are_dropped():
    space = tuning_space("bf16", 256)
    kept, dropped = fitting(space, (8, 0))  # sm_80: 163 KiB per block, the config's rule allows sm_90's 227
    assert kept == [c for c in space if c.smem_bytes <= 163 * 1024] and len(kept) < len(space)
    assert all("shared memory" in why for why in dropped.values()) and len(dropped) + len(kept) == len(space)
    assert fitting(space, (9, 0)) == (space, {})


def test_candidates_whose_first_launch_fails_drop_out(capsys):
    def refused():
        raise RuntimeError("flashgen: the kernel needs 200000 bytes of shared memory\nmore")

    def fine():
        return None

    assert runnable({"a": fine, "b": refused, "c": fine}, "bf16 d256") == {"a": fine, "c": fine}
    assert "bf16 d256: b does not run: flashgen: the kernel needs 200000 bytes" in capsys.readouterr().err


@pytest.mark.nvcc
def test_ptxas_keeps_the_shipped_backward(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHGEN_CACHE", str(tmp_path))
    default = BackwardConfig.default("bf16", 128)
    assert spill_free([default], (9, 0)) == ([default], {})


EXAMPLE_MODS = Path(__file__).resolve().parents[1] / "examples" / "mods.py"


@pytest.mark.nvcc
@pytest.mark.parametrize("score, mask", [("softcap", None), ("alibi", "causal")])
def test_ptxas_keeps_the_shipped_backward_with_a_score_mod(tmp_path, monkeypatch, score, mask):
    """The shipped d_head 128 backward sits at ptxas's 255-register ceiling: a score_mod's values held across
    the query-block loop (a sign word of the batch index was one) made it spill."""
    from flashgen.check import check_configs

    monkeypatch.setenv("FLASHGEN_CACHE", str(tmp_path))
    mods = (f"{EXAMPLE_MODS}:{score}", f"{EXAMPLE_MODS}:{mask}" if mask else None)
    [result] = check_configs([BackwardConfig.default("bf16", 128)], ["sm_80"], jobs=1, workdir=tmp_path, mods=mods)
    assert result.ok, result.log
    assert result.stats.clean, result.stats


def test_a_backward_that_spills_or_does_not_compile_is_dropped_with_the_reason():
    from types import SimpleNamespace as NS

    clean, spilling, broken = (BackwardConfig("bf16", d_head=128, n_warps=8, d_split=2, stages=s) for s in (1, 2, 1))
    broken = broken.replace(swizzled=False)
    reports = {clean: NS(cfg=clean, ok=True, stats=NS(clean=True, serialized=False)),
               spilling: NS(cfg=spilling, ok=True, stats=NS(clean=False, spill_stores=8, spill_loads=4, stack_frame=16)),
               broken: NS(cfg=broken, ok=False, log="ptxas fatal   : out of resources\n")}
    kept, dropped = spill_free([clean, spilling, broken], (9, 0), check=lambda cfgs, archs: [reports[c] for c in cfgs])
    assert kept == [clean]
    assert dropped[spilling.short_form()] == "spills on sm_90a: 8 B stores, 4 B loads, 16 B stack"
    assert "does not compile for sm_90a" in dropped[broken.short_form()] and "out of resources" in dropped[broken.short_form()]


TIMES = {"a": 3.0, "b": 1.0, "c": 2.0, "d": 5.0, "e": 4.0}


@pytest.mark.parametrize("failing, winner", [((), "b"), (("b",), "c"), (("b", "c"), "a"), (("a", "b", "c"), None)])
def test_the_fastest_finalist_whose_gradients_pass_wins(failing, winner):
    checked = []

    def check(name):
        checked.append(name)
        return "dq error 1 (bound 0.01)" if name in failing else None

    name, medians, failed = choose({n: n for n in TIMES}, check, rounds=2, finalists=3, timer=TIMES.get)
    assert name == winner and set(medians) == {"a", "b", "c"}
    assert failed == {n: "dq error 1 (bound 0.01)" for n in failing}
    assert checked == ["b", "c", "a"][:len(failing) + (winner is not None)]  # fastest first, none after the winner


def _tuned(tmp_path, cfg, seq=4096, causal=False, gpu=H100):
    cache: dict = {}
    store(cache, gpu, cfg, seq, causal, {"config": cfg.short_form(), "tflops": 1.0})
    save_cache(cache, tmp_path / "tune.json")
    return load_cache(tmp_path / "tune.json")


def _sm90_default(dtype, d_head, mask="none"):
    """The backward a compute capability 9.0 GPU gets untuned: the wgmma engine's."""
    return engines.ENGINES["wgmma"].backward.default_config(DType.parse(dtype), d_head, mask)


def test_a_stored_winner_round_trips_and_serves_its_bucket_only(tmp_path):
    cfg = BackwardConfig("bf16", d_head=128, B_r=128, B_c=32, n_warps=8, d_split=4)
    cache = _tuned(tmp_path, cfg)
    assert backward_lookup(DType.BF16, 128, "none", (9, 0), gpu=H100, seq=3000, cache=cache) == cfg
    default = _sm90_default("bf16", 128)
    for other in ({"seq": 1024}, {"gpu": "NVIDIA A100-SXM4-80GB"}, {"seq": 0}, {"gpu": None}):
        kw = {"gpu": H100, "seq": 4096, **other}
        assert backward_lookup(DType.BF16, 128, "none", (9, 0), cache=cache, **kw) == default
    assert backward_lookup(DType.FP16, 128, "none", (9, 0), gpu=H100, seq=4096, cache=cache) == _sm90_default("fp16", 128)
    # an unmasked winner was timed without a mask: masked calls keep the default
    assert backward_lookup(DType.BF16, 128, "causal", (9, 0), gpu=H100, seq=4096, cache=cache) == _sm90_default("bf16", 128, "causal")


def test_a_named_backward_engine_takes_its_own_winner_or_default_and_passes_over_the_others(tmp_path):
    sync = BackwardConfig("bf16", d_head=128, B_r=128, B_c=32, n_warps=8, d_split=4)
    cache = _tuned(tmp_path, sync)
    look = functools.partial(backward_lookup, DType.BF16, 128, "none", (9, 0), gpu=H100, seq=3000, cache=cache)
    assert look() == sync and look(engine="mma_sync") == sync
    assert look(engine="wgmma") == _sm90_default("bf16", 128)  # the mma_sync winner is not the wgmma engine's
    assert look(engine="wgmma", deterministic=True) == _sm90_default("bf16", 128).replace(deterministic=True)
    untuned = backward_lookup(DType.BF16, 128, "causal", (9, 0), engine="mma_sync")
    assert untuned == BackwardConfig.default("bf16", 128, "causal", smem_limit=of_capability((9, 0)).smem_per_block)


@pytest.mark.parametrize("capability, d_head, engine, words", [
    ((8, 0), 128, "wgmma", "the wgmma backward needs compute capability 9.0 (sm_90a), not compute capability 8.0"),
    ((9, 0), 96, "wgmma", "the wgmma backward has no kernel for bf16 d_head=96 on compute capability 9.0"),
])
def test_a_named_backward_engine_that_cannot_differentiate_the_call_says_why(capability, d_head, engine, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        backward_lookup(DType.BF16, d_head, "none", capability, engine=engine)


def test_replacing_a_faster_winner_of_another_config_says_so(capsys):
    """A later tune of other configs for the same bucket replaces its winner; where the replaced one was faster
    (another engine's, say) the tune says which and by how much; a slower one, the same config again or an
    untimed entry pass silently."""
    wgmma, sync = (c.short_form() for c in (_sm90_default("bf16", 128), BackwardConfig.default("bf16", 128)))
    cache: dict = {}
    store(cache, H100, BackwardConfig.default("bf16", 128), 2048, False, {"config": sync, "tflops": 266.0})
    store(cache, H100, _sm90_default("bf16", 128), 2048, False, {"config": wgmma, "tflops": 470.0})
    store(cache, H100, _sm90_default("bf16", 128), 2048, False, {"config": wgmma, "tflops": 460.0})
    assert capsys.readouterr().err == ""
    store(cache, H100, BackwardConfig.default("bf16", 128), 2048, False, {"config": sync, "tflops": 266.0})
    err = capsys.readouterr().err
    assert f"bf16/d128/bwd/2048: replaces {wgmma} (460 TFLOP/s" in err and "this winner's 266" in err
    assert cache[H100]["bf16"]["128"]["bwd/2048"]["config"] == sync  # replaced all the same: the user asked for these
    store(cache, H100, _sm90_default("bf16", 128), 2048, False, {"config": wgmma})
    assert capsys.readouterr().err == ""


def test_a_causal_winner_serves_causal_and_window_calls_with_their_mask(tmp_path):
    cfg = BackwardConfig("fp16", d_head=64, B_r=128, B_c=32, n_warps=2, mask="causal")
    cache = _tuned(tmp_path, cfg, seq=1024, causal=True)
    for mask in ("causal", "window"):
        assert backward_lookup(DType.FP16, 64, mask, (8, 0), gpu=H100, seq=1000, cache=cache) == cfg.replace(mask=mask)
    assert backward_lookup(DType.FP16, 64, "none", (8, 0), gpu=H100, seq=1000, cache=cache) == BackwardConfig.default("fp16", 64)


def test_forward_and_backward_entries_never_stand_in_for_each_other(tmp_path, capsys):
    fwd = lookup(H100, DType.FP16, 128, 4096, cache={}, capability=(8, 0)).replace(B_c=32)
    bwd = BackwardConfig("fp16", d_head=128, B_r=128, B_c=32, n_warps=8, d_split=4)
    both = {H100: {"fp16": {"128": {bucket_key(4096): {"config": fwd.short_form()},
                                    backward_bucket_key(4096): {"config": bwd.short_form()}}}}}
    assert lookup(H100, DType.FP16, 128, 4096, cache=both, capability=(8, 0)) == fwd
    assert backward_lookup(DType.FP16, 128, "none", (8, 0), gpu=H100, seq=4096, cache=both) == bwd
    only_bwd = _tuned(tmp_path, bwd)
    assert lookup(H100, DType.FP16, 128, 4096, cache=only_bwd, capability=(8, 0)) == lookup(H100, DType.FP16, 128, 4096, cache={}, capability=(8, 0))
    only_fwd = {H100: {"fp16": {"128": {bucket_key(4096): {"config": fwd.short_form()}}}}}
    assert backward_lookup(DType.FP16, 128, "none", (8, 0), gpu=H100, seq=4096, cache=only_fwd) == BackwardConfig.default("fp16", 128)
    assert not backward_bucket_key(4096).startswith(bucket_key(4096)) and backward_bucket_key(4096, True) != bucket_key(4096, True)
    # a forward name written under a backward key (a hand-edited cache) is ignored, with a note
    swapped = {H100: {"fp16": {"128": {backward_bucket_key(4096): {"config": fwd.short_form()}}}}}
    assert tuned_backward(H100, DType.FP16, 128, 4096, "none", swapped) is None
    assert "ignoring the tuned backward entry" in capsys.readouterr().err


def test_a_winner_of_another_head_size_is_not_used(capsys):
    bwd = BackwardConfig("fp16", d_head=64)
    cache = {H100: {"fp16": {"128": {backward_bucket_key(512): {"config": bwd.short_form()}}}}}
    assert backward_lookup(DType.FP16, 128, "none", (8, 0), gpu=H100, seq=512, cache=cache) == BackwardConfig.default("fp16", 128)
    assert "stored for fp16 d_head=128" in capsys.readouterr().err


# ---- the command line --------------------------------------------------------------------


def test_help_names_the_backward_options(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["tune", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert exit_.value.code == 0
    for words in ("--passes", "bwd (the backward", "--d-heads", "--allow-spills", "stored under bwd/ keys"):
        assert words in text, words


@pytest.mark.parametrize("argv, words", [
    (["tune", "--d-heads", "64"], "--d-heads applies to the backward pass; add --passes bwd"),
    (["tune", "--allow-spills"], "--allow-spills applies to the backward pass"),
    (["tune", "--passes", "bwd", "--d-heads", "0"], "--d-heads must be positive"),
    (["tune", "bwd(FP16, 128, 64, 64, 8): swizzled+d_split_2"], "is a backward config; add --passes bwd to tune it"),
    (["tune", "defaults", "--passes", "bwd"], "is a forward config; add --passes fwd to tune it"),
])
def test_bad_backward_options_are_refused_before_any_gpu_work(argv, words, capsys):
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("flashgen: error: ") and "Traceback" not in err and words in err, err


def test_tune_has_no_combined_pass(capsys):
    with pytest.raises(SystemExit):
        main(["tune", "--passes", "fwd+bwd"])
    assert "invalid choice: 'fwd+bwd'" in capsys.readouterr().err


@pytest.fixture
def fake_gpu(monkeypatch):
    """A GPU of compute capability 9.0 whose tuners record what they were given."""
    torch = pytest.importorskip("torch")
    import flashgen.tune as tune
    import flashgen.tune_backward as tune_backward

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(tune, "tune", lambda cfgs, seqs, **kw: calls.append(("fwd", cfgs, seqs, kw)) or {})
    monkeypatch.setattr(tune_backward, "tune_backward", lambda cfgs, seqs, **kw: calls.append(("bwd", cfgs, seqs, kw)) or {})
    return calls


def test_passes_bwd_tunes_the_backward_space_of_the_head_sizes_only(fake_gpu):
    assert main(["tune", "--passes", "bwd", "--dtypes", "bf16", "--d-heads", "64", "256", "--seqs", "1024", "4096"]) == 0
    [(pass_, cfgs, seqs, kw)] = fake_gpu
    assert pass_ == "bwd" and seqs == [1024, 4096] and kw["causal"] is False and kw["allow_spills"] is False
    # compute capability 9.0: the wgmma backward's space where it takes the head size, the mma_sync one's elsewhere
    assert cfgs == engines.ENGINES["wgmma"].backward.tuning_space(DType.BF16, 64) + tuning_space("bf16", 256)


def test_given_configs_go_to_their_pass_with_the_timed_mask(fake_gpu):
    given = ["bwd(FP16, 128, 64, 64, 8): swizzled+d_split_2", "bwd(FP16, 128, 64, 64, 8): swizzled+causal+d_split_2"]
    assert main(["tune", *given, "defaults", "--passes", "fwd", "bwd", "--causal", "--seqs", "2048", "--allow-spills"]) == 0
    (fwd, fwd_cfgs, _, _), (bwd, bwd_cfgs, _, kw) = fake_gpu
    assert (fwd, bwd) == ("fwd", "bwd") and fwd_cfgs and all(not isinstance(c, BackwardConfig) for c in fwd_cfgs)
    assert bwd_cfgs == [BackwardConfig("fp16", d_head=128, n_warps=8, d_split=2, mask="causal")] and kw["causal"] and kw["allow_spills"]
