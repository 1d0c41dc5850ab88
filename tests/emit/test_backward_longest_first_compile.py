"""The shipped backward set's causal bf16 kernels with ``longest_first`` on (flashgen.attention.backward_grid's other
order) compile without local memory and without wgmma serialized: mma.sync for sm_80, wgmma for sm_90a
(CPU only; marked ``nvcc``; device code alone, ``nvcc -cubin -Xptxas -v``, in the background builds). Off, the
knob changes no kernel's text (tests/attention/test_backward_grid.py)."""
from __future__ import annotations

import pytest

from background import cubin_build  # tests/ is on sys.path (the conftest's folder)

from flashgen.dsl.sets import backward_configs
from flashgen.engines import emit
from flashgen.ptxas import parse_ptxas
from flashgen.toolchain import find_nvcc

pytestmark = pytest.mark.nvcc

#: the set's bf16 causal kernels (the mma.sync ones nearest the register cap: d_head 64 at 254): the knob changes only
#: the block decode and the launch, the same lines in every kernel of an engine
SHIPPED = [cfg.replace(longest_first=True) for cfg in backward_configs() if cfg.dtype.value == "bf16" and cfg.mask == "causal"]
JOBS = [(cfg, "sm_90a" if cfg.engine == "wgmma" else "sm_80") for cfg in SHIPPED]


def _key(job) -> str:
    return f"{job[0].mangle()}-{job[1]}"


def background_builds(folder) -> dict:
    nvcc = find_nvcc()
    if nvcc is None:
        return {}
    return {_key(job): cubin_build(folder, _key(job), emit(job[0]).text, job[1], nvcc) for job in JOBS}


@pytest.fixture(scope="module")
def compiled(background, request, nvcc) -> dict:
    return {_key(job): background.result(request.module, _key(job)) for job in JOBS}


@pytest.mark.parametrize("job", JOBS, ids=_key)
def test_the_shipped_kernels_compile_clean_with_longest_first(job, compiled):
    res = compiled[_key(job)]
    assert res.returncode == 0, f"{' '.join(res.args)}\n{res.stderr[-3000:]}"
    stats = parse_ptxas(res.stdout + res.stderr)
    assert len(stats) == 3 and any(job[0].mangle() in s.function and "kernelENS_6Params" in s.function for s in stats), stats
    for s in stats:
        assert s.clean, f"{s.function}: {s.spill_stores} B spill stores, {s.spill_loads} B spill loads, {s.stack_frame} B stack frame"
        assert not s.serialized, f"{s.function}: ptxas serialized its wgmma (too few registers)"
