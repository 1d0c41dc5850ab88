"""Emitted kernels compile with nvcc for sm_80 and sm_90a (CPU only; marked ``nvcc``).

Compiled here: every config of the seed's progression and its defaults, and a
deterministic sample of its tuning space: ``tuning_space()`` sorted by mangled name,
every 10th config starting with the first (both dtypes are then in it; a dtype that
were not would be added). ``FLASHGEN_FULL_COMPILE=1`` compiles the whole tuning
space instead (80 configs + the 11 above x 2 archs: 8 minutes measured on 2 cores).

The defaults must also compile without local memory on sm_90a: zero spill stores,
zero spill loads, zero stack frame. Each config is one background build (``check_configs``
into a fresh work folder, so nothing comes from an earlier run's cache; see tests/background.py).
"""
from __future__ import annotations

import os

import pytest

from flashgen.check import DEFAULT_ARCHS, failure_report
from flashgen.dsl.config import KernelConfig, default_configs, kernel_progression, tuning_space

from background import check_results, config_checks  # tests/ is on sys.path (the conftest's folder)

pytestmark = pytest.mark.nvcc

SAMPLE_EVERY = 10


def tuning_sample() -> list[KernelConfig]:
    space = sorted(tuning_space(), key=KernelConfig.mangle)
    if os.environ.get("FLASHGEN_FULL_COMPILE") == "1":
        return space
    sample = space[::SAMPLE_EVERY]
    for dtype in {c.dtype for c in space} - {c.dtype for c in sample}:
        sample.append(next(c for c in space if c.dtype == dtype))
    return sample


CONFIGS = list(dict.fromkeys(default_configs() + kernel_progression() + tuning_sample()))


# one build per config: its host code with its first arch, device code alone for the others
background_builds = config_checks(CONFIGS, DEFAULT_ARCHS)


@pytest.fixture(scope="module")
def results(background, request, nvcc):
    return check_results(background, request.module, CONFIGS)


@pytest.mark.parametrize("arch", DEFAULT_ARCHS)
@pytest.mark.parametrize("cfg", CONFIGS, ids=KernelConfig.mangle)
def test_compiles(cfg, arch, results):
    r = results[(cfg, arch)]
    assert r.ok, failure_report(r)
    assert r.stats.registers > 0
    assert r.smem_bytes >= cfg.smem_bytes


@pytest.mark.parametrize("cfg", default_configs(), ids=KernelConfig.mangle)
def test_defaults_use_no_local_memory_on_sm90a(cfg, results):
    r = results[(cfg, "sm_90a")]
    assert r.ok, failure_report(r)
    s = r.stats
    assert (s.spill_stores, s.spill_loads, s.stack_frame) == (0, 0, 0), (
        f"{cfg.short_form()} on sm_90a: {s.spill_stores} B spill stores, {s.spill_loads} B spill loads, "
        f"{s.stack_frame} B stack frame ({s.registers} registers)\n  reproduce: {r.command}"
    )


def test_sample_is_deterministic_and_covers_both_dtypes():
    if os.environ.get("FLASHGEN_FULL_COMPILE") == "1":
        pytest.skip("the full tuning space is compiled")
    a, b = tuning_sample(), tuning_sample()
    assert a == b
    assert len(a) == -(-len(tuning_space()) // SAMPLE_EVERY)
    assert {c.dtype.value for c in a} == {"fp16", "bf16"}
