"""Backward kernels built with score_mod / mask_mod compile for their arch: the shipped mma.sync backward
(sm_80) at d_head 128 and 64, the shipped wgmma backward (sm_90a) at d_head 128, each with a bias (ALiBi,
a relative-bias table), a score_mod whose derivative reads the score (softcap: dS made in the recompute's
pass), a mask_mod that loads (document ids) or computes (prefix LM), and a score and mask mod together
(CPU only; marked ``nvcc``; device code alone, ``nvcc -cubin -Xptxas -v``, in the background builds).

No main kernel of these uses local memory today (spill stores, spill loads and stack frame all 0; the
preprocess and the dQ conversion never use any), every mods pair below on every config. The mma.sync d128
default holds up to 255 registers with a mod (249 without): it stays free of local memory because the
per-thread indices a step derives from its lane and warp are recomputed in the step (``fresh_tid``), not
held in registers across the query-block loop (held, it spilled 4-28 bytes with these mods). The wgmma
consumer has 168 (its setmaxnreg share); a forward with mods is differentiated in 64-row query blocks
(``with_mods``), where nothing spills. Where a user's mods spill the shipped shape, a call runs the engine's
fallback shape (``BackwardKernels.fallback``; the mma.sync d_head-64 default with softcap and a document mask
does). Kernels free of local memory must stay so; a pair put in
:data:`SPILLS` must still compile and spill no more than :data:`SPILL_CAP` bytes.
"""
from __future__ import annotations

import importlib.util
import pathlib

import pytest

from background import cubin_build  # tests/ is on sys.path (the conftest's folder)

from flashgen.ptxas import parse_ptxas
from flashgen.dsl.backward_config import BackwardConfig
from flashgen.engines import backward_of, emit
from flashgen.engines.mma_sync import MmaSyncBackward
from flashgen.mods.kernel_mods import prepare_mods
from flashgen.toolchain import find_nvcc

pytestmark = pytest.mark.nvcc

_spec = importlib.util.spec_from_file_location("flashgen_example_mods", pathlib.Path(__file__).resolve().parents[2] / "examples" / "mods.py")
EX = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(EX)

#: config name -> (shipped backward config as built for a forward with mods, arch)
CONFIGS = {
    "mma_d128": (BackwardConfig.default("bf16", 128), "sm_80"),
    "mma_d64": (BackwardConfig.default("fp16", 64), "sm_80"),
    # what a call runs where the shipped shape's kernel with its mods spilled (d_head 64 with softcap and a document mask)
    "mma_d64_fallback": (MmaSyncBackward().fallback(BackwardConfig.default("fp16", 64)), "sm_80"),
    # split_scores: the mods' query index from the warp's own query columns
    "mma_split_d128": (BackwardConfig("bf16", n_warps=8, d_split=2, stages=2, split_scores=True), "sm_90a"),
    "wgmma_d128": (backward_of(BackwardConfig.wgmma("bf16", 128)).with_mods(BackwardConfig.wgmma("bf16", 128)), "sm_90a"),
    "wgmma_d64_mask": (BackwardConfig.wgmma("bf16", 64), "sm_90a"),  # 128-row blocks: a mask_mod alone keeps them
}
#: (score_mod example, mask_mod example, built-in mask)
MODS = {
    "softcap": ("softcap", None, "none"),
    "alibi+causal": ("alibi", None, "causal"),
    "relative_bias+doc": ("relative_bias", "document_mask", "none"),
    "prefix_lm": (None, "prefix_lm", "none"),
    "softcap+doc": ("softcap", "document_mask", "none"),
    "doc": (None, "document_mask", "none"),
    "softcap+prefix_lm": ("softcap", "prefix_lm", "none"),
}
#: the (config, mods) pairs whose main kernel may spill (up to SPILL_CAP bytes): none today; every other pair must not
SPILLS: set = set()
SPILL_CAP = 128
#: compiled here (the suite's time: one nvcc run each): each engine with the fused dS (softcap) and with both
#: mods, the mma.sync default with a computed mask_mod, with a bias under the built-in causal mask and with a table
#: bias beside a loading mask_mod (the pairs that spilled most before their indices were recomputed per step);
#: d_head 64 with both mods (the shipped shape with a table bias; softcap with a document mask spills 264 B there on
#: sm_80, so such a call runs the engine's fallback, compiled here with it), and the wgmma d_head 64 backward's 128-row blocks with a mask_mod alone (loading, computed)
CASES = [("mma_d128", "softcap"), ("mma_d128", "prefix_lm"), ("mma_d128", "alibi+causal"), ("mma_d128", "relative_bias+doc"),
         ("mma_d128", "softcap+doc"), ("wgmma_d128", "softcap"), ("wgmma_d128", "softcap+doc"), ("mma_d64", "relative_bias+doc"), ("mma_d64_fallback", "softcap+doc"),
         ("wgmma_d64_mask", "doc"), ("wgmma_d64_mask", "prefix_lm"), ("wgmma_d128", "relative_bias+doc"),
         ("wgmma_d128", "softcap+prefix_lm"), ("mma_split_d128", "softcap+doc"), ("mma_split_d128", "alibi+causal")]


def _id(case) -> str:
    return "-".join(case)


def _source(case):
    cfg, _ = CONFIGS[case[0]]
    score, mask, kind = MODS[case[1]]
    mods, _ = prepare_mods(EX.EXAMPLES[score][1]() if score else None, EX.EXAMPLES[mask][1]() if mask else None)
    return emit(cfg.replace(mask=kind), mods)


def background_builds(folder) -> dict:
    """nvcc's run (device code only) for every case; the sources are emitted here."""
    nvcc = find_nvcc()
    if nvcc is None:
        return {}
    return {_id(case): cubin_build(folder, _id(case), _source(case).text, CONFIGS[case[0]][1], nvcc) for case in CASES}


@pytest.fixture(scope="module")
def compiled(background, request, nvcc) -> dict:
    return {_id(c): background.result(request.module, _id(c)) for c in CASES}


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_backward_kernels_with_mods_compile(case, compiled):
    res = compiled[_id(case)]
    assert res.returncode == 0, f"{' '.join(res.args)}\n{res.stderr[-3000:]}"
    stats = {s.function: s for s in parse_ptxas(res.stdout + res.stderr)}
    main = [f for f in stats if "kernelENS_6Params" in f]
    name = _source(case).name
    assert len(main) == 1 and name in main[0] and name != CONFIGS[case[0]][0].mangle(), sorted(stats)
    masks = [f for f in stats if "mask_blocks_kernel" in f or "mask_ranges_kernel" in f]  # the block mask's, transposed
    assert len(masks) == (2 if MODS[case[1]][1] else 0), sorted(stats)
    for f, s in stats.items():
        spill = f"{f}: {s.spill_stores} B spill stores, {s.spill_loads} B spill loads, {s.stack_frame} B stack frame"
        if f in main and case in SPILLS:
            assert max(s.spill_stores, s.spill_loads, s.stack_frame) <= SPILL_CAP, spill
        else:
            assert s.clean, spill
        assert not s.serialized, f"{f}: ptxas serialized its wgmma (too few registers)"
