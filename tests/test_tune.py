"""`flashgen tune` / `flashgen bench` on the CPU: which configs they time by default, how tuned
winners are looked up (masked calls apart), and their refusals of bad options."""
from __future__ import annotations

import pytest

from flashgen.bench import SHAPES, default_bench_configs
from flashgen.cli import main
from flashgen.dsl.config import DType, default_configs, hopper_configs, tuning_space
from flashgen.tune import BUCKETS, bucket_key, default_space, hopper_default, lookup, seq_bucket

H100 = "NVIDIA H100 80GB HBM3"


def cache_with(key: str, config: str) -> dict:
    return {H100: {"fp16": {"128": {key: {"config": config, "tflops": 1.0}}}}}


def test_tuning_on_sm90_times_the_wgmma_engine():
    # a default `flashgen tune` on an H100 must not hand compile("auto") an mma.sync winner
    assert default_space(["fp16"], (9, 0)) == hopper_configs(["fp16"])
    assert all(c.is_wgmma for c in default_space(["fp16", "bf16"], (9, 0)))
    assert default_space(["bf16"], (8, 0)) == tuning_space(["bf16"])
    assert not any(c.is_wgmma for c in default_space(["bf16"], (8, 6)))


def test_masked_calls_use_only_masked_winners():
    tuned = hopper_configs(["fp16"])[0]
    cache = cache_with(bucket_key(4096), tuned.short_form())
    assert lookup(H100, DType.FP16, 128, 4096, cache=cache, capability=(9, 0)) == tuned
    # an unmasked winner was timed without a mask: a masked call falls back to the shipped default
    assert lookup(H100, DType.FP16, 128, 4096, cache=cache, capability=(9, 0), masked=True) == hopper_default(DType.FP16, 128)
    cache = cache_with(bucket_key(4096, masked=True), tuned.short_form())
    assert lookup(H100, DType.FP16, 128, 4000, cache=cache, capability=(9, 0), masked=True) == tuned
    assert lookup(H100, DType.FP16, 128, 4000, cache=cache, capability=(9, 0)) == hopper_default(DType.FP16, 128)
    assert bucket_key(3000) == "4096" and bucket_key(3000, masked=True) == "4096/masked"


def test_bench_times_what_auto_would_pick():
    seqs = [s for s, _ in SHAPES]
    picked = default_bench_configs((9, 0))
    for dtype in DType:
        for seq in seqs:
            for masked in (False, True):
                assert lookup(H100, dtype, 128, seq, cache={}, capability=(9, 0), masked=masked) in picked
    assert set(default_configs()) <= set(picked)
    assert default_bench_configs((8, 0)) == default_configs()


@pytest.mark.parametrize("argv, words", [
    (["tune", "--seqs", "3000", "4096"], ["--seqs 3000 and 4096 fall into the same bucket (4096)"]),
    (["tune", "--seqs", "0"], ["--seqs must be positive"]),
    (["tune", "--rounds", "0"], ["--rounds must be at least 1"]),
    (["bench", "--seqs", "3000"], ["--seqs 3000", "512 1024 2048 4096 8192 16384"]),
    (["bench", "--rounds", "0"], ["--rounds must be at least 1"]),
])
def test_bad_options_are_refused_before_any_gpu_work(argv, words, capsys):
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 1 and err.startswith("flashgen: error: ") and "Traceback" not in err
    for w in words:
        assert w in err, err


def test_every_bucket_is_its_own_representative():
    assert [seq_bucket(b) for b in BUCKETS] == list(BUCKETS)
