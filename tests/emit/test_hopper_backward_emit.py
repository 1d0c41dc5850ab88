"""The emitted wgmma backward (flashgen.emit.hopper_backward_kernel): its kernels compile for sm_90a
without local memory, the dQ buffer's index function compiled for the host inverts the slots of the plan's
DqStage at every thread and value, and emitting is pure."""
from __future__ import annotations

import functools
import shutil
import subprocess

import pytest

from flashgen.check import check_configs, failure_report
from flashgen.dsl.backward_config import BackwardConfig
from flashgen.dsl.hopper_backward_plan import make_hopper_backward_plan
from flashgen.emit.hopper_backward_kernel import emit_hopper_backward
from flashgen.toolchain import find_nvcc

W = BackwardConfig.wgmma
#: the shipped d_head 128 (the register-heaviest), both masks, one and two ring stages, the ordered dQ adds; d_head 64
#: is the same program with half the columns (`flashgen check backward` compiles every shipped kernel)
CONFIGS = [W("bf16", 128, "causal"), W("fp16", 128, "window", stages=1).replace(deterministic=True)]
GXX = shutil.which("g++")


def background_builds(folder):
    if find_nvcc() is None:
        return {}
    return {cfg.mangle(): functools.partial(check_configs, [cfg], ("sm_80", "sm_90a"), jobs=1, workdir=folder, use_cache=False)
            for cfg in CONFIGS}


@pytest.fixture(scope="module")
def results(background, request, nvcc):
    return {(r.cfg, r.arch): r for cfg in CONFIGS for r in background.result(request.module, cfg.mangle())}


@pytest.mark.nvcc
@pytest.mark.parametrize("cfg", CONFIGS, ids=BackwardConfig.mangle)
def test_compiles_for_sm90a_without_local_memory(cfg, results):
    assert (cfg, "sm_80") not in results, "wgmma kernels exist for sm_90a only"
    r = results[(cfg, "sm_90a")]
    assert r.ok, failure_report(r)
    s = r.stats
    assert (s.spill_stores, s.spill_loads, s.stack_frame) == (0, 0, 0), f"{cfg}: local memory used\n  {r.command}"


@pytest.mark.skipif(GXX is None, reason="g++ not found on PATH")
@pytest.mark.parametrize("d_head", [64, 128])
def test_the_dq_index_inverts_the_slots_the_adds_write(tmp_path, d_head):
    """Value i of consumer thread t (its accumulator map's row and column) goes to DqStage.slot(t, i) of the
    consumer's region, through the kernels' C++ rule (slot_cpp, for the pair i, i + 1); dq_chunk_index must find
    it there for the dQ conversion."""
    plan = make_hopper_backward_plan(W("bf16", d_head))
    st = plan.dq_stage
    src = tmp_path / "index.cpp"
    src.write_text("#include <cstdint>\n#include <cstdio>\n#define __host__\n#define __device__\n#define __forceinline__ inline\n"
                   + st.index_cpp() + f"\nint main() {{ for (uint32_t r = 0; r < {st.rows}u; ++r) for (uint32_t c = 0; c < "
                   f"{st.cols * st.consumers}u; ++c) std::printf(\"%u\\n\", dq_chunk_index(r, c));\n"
                   f"for (uint32_t wtid = 0; wtid < 128u; ++wtid) for (uint32_t i = 0; i < {st.cols // 2}u; i += 2) "
                   f"std::printf(\"%u\\n\", {st.slot_cpp('wtid', 'i')}); return 0; }}\n")
    subprocess.run([GXX, "-O1", "-o", str(tmp_path / "index"), str(src)], check=True)
    got = [int(x) for x in subprocess.run([str(tmp_path / "index")], capture_output=True, text=True, check=True).stdout.split()]
    width = st.cols * st.consumers
    index, slots = got[:st.rows * width], got[st.rows * width:]
    assert slots == [st.slot(t, i) for t in range(128) for i in range(0, st.cols // 2, 2)]
    rows, cols = plan.gemms["dQ"].atom.c_map.tables()
    placed = {}
    for w in range(st.consumers):
        for t in range(128):
            for i in range(st.cols // 2):
                r, c = int(rows[t, i]), w * st.cols + int(cols[t, i])
                placed[(r, c)] = w * st.rows * st.cols + st.slot(t, i)
    assert len(placed) == st.rows * width and sorted(placed.values()) == list(range(st.rows * width))
    assert all(index[r * width + c] == at for (r, c), at in placed.items())


def test_only_ordered_adds_stage_dq_in_shared_memory():
    """Unordered dQ adds go straight from the accumulators: their plan holds no staging region (32 KB less shared
    memory at d_head 128); the deterministic backward's bulk reductions need it, and its completion waits."""
    for d_head in (64, 128):
        free, ordered = (make_hopper_backward_plan(W("bf16", d_head).replace(deterministic=det)) for det in (False, True))
        assert not free.dq_stage.staged and ordered.dq_stage.staged
        region = free.dq_stage.consumers * free.dq_stage.region_bytes
        assert ordered.smem_bytes - free.smem_bytes == region == 4 * 64 * d_head


def test_emitting_is_pure():
    cfg = W("fp16", 64, "causal")
    assert emit_hopper_backward(make_hopper_backward_plan(cfg)).text == emit_hopper_backward(make_hopper_backward_plan(cfg)).text
    other = emit_hopper_backward(make_hopper_backward_plan(cfg.replace(stages=1))).text
    assert other != emit_hopper_backward(make_hopper_backward_plan(cfg)).text
