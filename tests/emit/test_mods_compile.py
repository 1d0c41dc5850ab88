"""Kernels built with score_mod / mask_mod compile for their arch (mma_sync: sm_80, wgmma: sm_90a)
with no local memory: zero spill stores and loads, zero stack frame, for the forward kernel and the
block mask's two kernels (CPU only; marked ``nvcc``; device code alone, ``nvcc -cubin -Xptxas -v``).

Not every (config, mod) pair is spill-free: on the wgmma configs with d_head 128 and B_c 128
(pingpong + intra overlap, persistent or not) a score_mod spills a few hundred bytes (softcap, ALiBi),
a mask_mod alone does not. The pairs here are ones that fit; the wgmma ones use B_c 64, or B_c 128
with a mask_mod only.
"""
from __future__ import annotations

import concurrent.futures
import importlib.util
import os
import pathlib
import subprocess

import pytest

from flashgen.check import compile_command, parse_ptxas
from flashgen.dsl.notation import parse_config
from flashgen.engines import emit
from flashgen.mods.kernel_mods import prepare_mods

pytestmark = pytest.mark.nvcc

_spec = importlib.util.spec_from_file_location("flashgen_example_mods", pathlib.Path(__file__).resolve().parents[2] / "examples" / "mods.py")
EX = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(EX)

MMA = "(BF16, 128, 128, 64, 4): async+eager+swizzled+load_2_2_2_tiles+buffer+opt_softmax"
#: (config, arch, score_mod example, mask_mod example)
CASES = [
    (MMA, "sm_80", "softcap", "document_mask"),
    (MMA.replace("opt_softmax", "opt_softmax+causal"), "sm_80", "alibi", "prefix_lm"),
    ("(BF16, 128, 128, 64, 12): wgmma+stages_2+pingpong+intra+persistent", "sm_90a", "softcap", None),
    ("(FP16, 128, 128, 64, 12): wgmma+stages_2+pingpong+intra+persistent", "sm_90a", "alibi", "document_mask"),
    ("(BF16, 128, 128, 128, 12): wgmma+stages_2+pingpong+intra+persistent+causal", "sm_90a", None, "prefix_lm"),
    ("(BF16, 128, 128, 128, 12): wgmma+stages_2+pingpong+intra+persistent", "sm_90a", None, "sliding_window_sinks"),
]


def _id(case) -> str:
    cfg, arch, score, mask = case
    return f"{parse_config(cfg).mangle()}-{score or '-'}-{mask or '-'}"


def _compile(case, nvcc: str, workdir: pathlib.Path):
    cfg, arch, score, mask = case
    mods, _ = prepare_mods(EX.EXAMPLES[score][1]() if score else None, EX.EXAMPLES[mask][1]() if mask else None)
    src = emit(parse_config(cfg), mods)
    d = workdir / _id(case)
    d.mkdir()
    (d / "k.cu").write_text(src.text)
    argv = compile_command(nvcc, d / "k.cu", arch, d / "k.cubin", device_only=True)
    res = subprocess.run(argv, capture_output=True, text=True)
    return src, res, " ".join(argv)


@pytest.fixture(scope="module")
def compiled(nvcc, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("mods_compile")
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        results = list(pool.map(lambda c: _compile(c, nvcc, workdir), CASES))
    return dict(zip(map(_id, CASES), results))


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_mod_kernels_compile_without_local_memory(case, compiled):
    src, res, command = compiled[_id(case)]
    assert res.returncode == 0, f"{command}\n{res.stderr[-3000:]}"
    stats = {s.function: s for s in parse_ptxas(res.stdout + res.stderr)}
    kernels = [f for f in stats if "kernelENS_6Params" in f]
    assert len(kernels) == 1 and src.name in kernels[0], sorted(stats)
    assert any("mask_blocks_kernel" in f for f in stats) == (case[3] is not None)
    for f, s in stats.items():
        assert s.clean, f"{f}: {s.spill_stores} B spill stores, {s.spill_loads} B spill loads, {s.stack_frame} B stack frame\n  {command}"
