"""Kernels built with score_mod / mask_mod compile for their arch (mma_sync: sm_80, wgmma: sm_90a)
with no local memory: zero spill stores and loads, zero stack frame, for the forward (or backward) kernels and
the block mask's two kernels (CPU only; marked ``nvcc``; device code alone, ``nvcc -cubin -Xptxas -v``, in the
background builds).

The shipped wgmma config (d_head 128, B_c 128, pingpong + intra overlap, persistent) is among them with a
score_mod: its plan reads Q from shared memory when a score_mod is compiled in (with Q's fragments in
registers ptxas spilled 224 bytes for ALiBi and 360 for softcap there).
"""
from __future__ import annotations

import importlib.util
import pathlib

import pytest

from background import cubin_build  # tests/ is on sys.path (the conftest's folder)

from flashgen.ptxas import parse_ptxas
from flashgen.dsl.configs import load as load_config
from flashgen.engines import emit
from flashgen.mods.kernel_mods import prepare_mods
from flashgen.toolchain import find_nvcc

pytestmark = pytest.mark.nvcc

_spec = importlib.util.spec_from_file_location("flashgen_example_mods", pathlib.Path(__file__).resolve().parents[2] / "examples" / "mods.py")
EX = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(EX)

MMA = "(BF16, 128, 128, 64, 4): async+eager+swizzled+load_2_2_2_tiles+buffer+opt_softmax"
#: (config, arch, score_mod example, mask_mod example)
CASES = [
    (MMA, "sm_80", "softcap", "document_mask"),
    (MMA.replace("opt_softmax", "opt_softmax+causal"), "sm_80", "alibi", "prefix_lm"),
    ("(BF16, 128, 128, 128, 12): wgmma+stages_2+pingpong+intra+persistent", "sm_90a", "softcap", None),
    ("(BF16, 128, 128, 128, 12): wgmma+stages_2+pingpong+intra+persistent", "sm_90a", "alibi", "document_mask"),
    ("(FP16, 128, 128, 64, 12): wgmma+stages_2+pingpong+intra+persistent", "sm_90a", "alibi", "document_mask"),
    ("(BF16, 128, 128, 128, 12): wgmma+stages_2+pingpong+intra+persistent+causal", "sm_90a", None, "prefix_lm"),
    ("(BF16, 128, 128, 128, 12): wgmma+stages_2+pingpong+intra+persistent", "sm_90a", None, "sliding_window_sinks"),
    # the backward kernels: the shipped mma_sync shapes (sm_80), the former d_head 64 shape the runtime falls back
    # to where the shipped one spills (softcap with a document mask there: 264 bytes), the wgmma d_head 128 default
    ("bwd(BF16, 128, 64, 128, 8): swizzled+d_split_2+dq_split_4+split_scores+stages_2", "sm_80", "softcap", "document_mask"),
    ("bwd(BF16, 64, 128, 128, 8): swizzled+d_split_2+split_scores+stages_2", "sm_80", "alibi", "prefix_lm"),
    ("bwd(BF16, 64, 64, 64, 4): swizzled+stages_2", "sm_80", "softcap", "document_mask"),
    ("bwd(BF16, 128, 64, 128, 12): wgmma+swizzled+stages_2", "sm_90a", "alibi", None),
    ("bwd(BF16, 128, 64, 128, 12): wgmma+swizzled+stages_2", "sm_90a", "softcap", "document_mask"),
    ("bwd(BF16, 128, 64, 128, 12): wgmma+swizzled+stages_2", "sm_90a", "softcap", None),
    ("bwd(BF16, 128, 64, 128, 12): wgmma+swizzled+stages_2", "sm_90a", None, "document_mask"),
]


def _id(case) -> str:
    cfg, arch, score, mask = case
    return f"{load_config(cfg).mangle()}-{score or '-'}-{mask or '-'}"


def _source(case):
    cfg, arch, score, mask = case
    mods, _ = prepare_mods(EX.EXAMPLES[score][1]() if score else None, EX.EXAMPLES[mask][1]() if mask else None)
    return emit(load_config(cfg), mods)


def background_builds(folder) -> dict:
    """nvcc's run (device code only) for every case; the sources are emitted here."""
    nvcc = find_nvcc()
    if nvcc is None:
        return {}
    return {_id(case): cubin_build(folder, _id(case), _source(case).text, case[1], nvcc) for case in CASES}


@pytest.fixture(scope="module")
def compiled(background, request, nvcc) -> dict:
    return {_id(c): background.result(request.module, _id(c)) for c in CASES}


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_mod_kernels_compile_without_local_memory(case, compiled):
    src, res = _source(case), compiled[_id(case)]
    command = " ".join(res.args)
    assert res.returncode == 0, f"{command}\n{res.stderr[-3000:]}"
    stats = {s.function: s for s in parse_ptxas(res.stdout + res.stderr)}
    kernels = [f for f in stats if "kernelENS_6Params" in f]
    assert kernels and all(src.name in f for f in kernels), sorted(stats)  # a backward has its preprocess and dQ kernels too
    assert any("mask_blocks_kernel" in f for f in stats) == (case[3] is not None)
    for f, s in stats.items():
        assert s.clean, f"{f}: {s.spill_stores} B spill stores, {s.spill_loads} B spill loads, {s.stack_frame} B stack frame\n  {command}"
