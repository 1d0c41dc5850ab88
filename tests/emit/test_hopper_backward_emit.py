"""The emitted wgmma backward (flashgen.emit.hopper_backward_kernel): its kernels, and the shipped ones past 64 rows
with exp_first, compile for sm_90a without local memory and without serialized wgmma (any reason ptxas gives), the dQ buffer's index function
compiled for the host inverts the slots of the plan's DqStage at every thread and value (dQ split by columns
or by rows), and emitting is pure."""
from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

from flashgen.check import failure_report
from flashgen.dsl.backward_config import BackwardConfig
from flashgen.dsl.hopper_backward_plan import make_hopper_backward_plan
from flashgen.dsl.sets import backward_configs
from flashgen.emit.hopper_backward_kernel import emit_hopper_backward

from background import check_results, config_checks  # tests/ is on sys.path (the conftest's folder)

W = BackwardConfig.wgmma
#: the shipped d_head 128 (the register-heaviest dK and dV), both masks, one and two ring stages, the ordered dQ adds;
#: the shipped d_head 64 (query blocks of 128 rows: the widest S^T and dP^T), plain and ordered; d_head 128 with 80-row
#: query blocks (dQ made transposed), plain and ordered (`flashgen check backward` compiles every shipped kernel)
CONFIGS = [W("bf16", 128, "causal"), W("fp16", 128, "window", stages=1).replace(deterministic=True),
           W("bf16", 64, "causal"), W("fp16", 64, stages=1).replace(deterministic=True),
           W("bf16", 128).replace(B_r=80), W("fp16", 128, "causal").replace(B_r=80, deterministic=True)]
#: the `backward` set's kernels past 64 rows with the exponentials under dP^T's GEMM (exp_first)
CONFIGS += [c.replace(exp_first=True) for c in backward_configs() if c.engine == "wgmma" and c.B_r > 64]
GXX = shutil.which("g++")


background_builds = config_checks(CONFIGS, ("sm_80", "sm_90a"))


@pytest.fixture(scope="module")
def results(background, request, nvcc):
    return check_results(background, request.module, CONFIGS)


@pytest.mark.nvcc
@pytest.mark.parametrize("cfg", CONFIGS, ids=BackwardConfig.mangle)
def test_compiles_for_sm90a_without_local_memory(cfg, results):
    assert (cfg, "sm_80") not in results, "wgmma kernels exist for sm_90a only"
    r = results[(cfg, "sm_90a")]
    assert r.ok, failure_report(r)
    s = r.stats
    assert (s.spill_stores, s.spill_loads, s.stack_frame) == (0, 0, 0), f"{cfg}: local memory used\n  {r.command}"
    assert not s.serialized, f"{cfg}: ptxas serialized the wgmma\n  {r.command}"
    # a user reads every line it emits: nvcc has nothing to warn about (an index declared and never read, ...)
    assert "warning" not in r.log.lower(), f"{cfg}: nvcc warned\n{r.log}"


@pytest.mark.skipif(GXX is None, reason="g++ not found on PATH")
@pytest.mark.parametrize("cfg", [W("bf16", 128, "causal"), W("bf16", 64), W("bf16", 64).replace(B_r=64, exp_first=False), W("bf16", 128).replace(B_r=80),
                                 W("bf16", 128, "causal").replace(deterministic=True)],
                         ids=BackwardConfig.mangle)
def test_the_dq_index_inverts_the_slots_the_adds_write(tmp_path, cfg):
    """Value i of consumer thread t (its accumulator map's row and column, placed at the consumer's row0 and col0)
    goes to DqStage.slot(t, i) of the consumer's region, through the kernels' C++ rule (slot_cpp, for the values i
    to i + vec - 1 of one access); dq_chunk_index must find it there for the dQ conversion, at every element of
    the B_r x d_head block. Each warp's add of a value group covers one aligned run of 32 x vec floats."""
    plan = make_hopper_backward_plan(cfg)
    st, height, width = plan.dq_stage, cfg.B_r, cfg.d_head
    src = tmp_path / "index.cpp"
    src.write_text("#include <cstdint>\n#include <cstdio>\n#define __host__\n#define __device__\n#define __forceinline__ inline\n"
                   + st.index_cpp() + f"\nint main() {{ for (uint32_t r = 0; r < {height}u; ++r) for (uint32_t c = 0; c < "
                   f"{width}u; ++c) std::printf(\"%u\\n\", dq_chunk_index(r, c));\n"
                   f"for (uint32_t wtid = 0; wtid < 128u; ++wtid) for (uint32_t i = 0; i < {st.cols // 2}u; i += {st.vec}u) "
                   f"std::printf(\"%u\\n\", {st.slot_cpp('wtid', 'i')}); return 0; }}\n")
    subprocess.run([GXX, "-O1", "-o", str(tmp_path / "index"), str(src)], check=True)
    got = [int(x) for x in subprocess.run([str(tmp_path / "index")], capture_output=True, text=True, check=True).stdout.split()]
    index, slots = got[:height * width], got[height * width:]
    assert slots == [st.slot(t, i) for t in range(128) for i in range(0, st.cols // 2, st.vec)]
    vec, groups = st.vec, np.array(slots).reshape(4, 32, -1)  # [warp][lane][value group]
    for w in range(4):
        for g in range(groups.shape[2]):
            run = groups[w, :, g]
            assert run[0] % (32 * vec) == 0 and list(run) == list(range(run[0], run[0] + 32 * vec, vec))
            assert all(st.slot(32 * w + lane, vec * g + e) == run[lane] + e for lane in range(32) for e in range(vec))
    rows, cols = plan.gemms["dQ"].atom.c_map.tables()
    placed = {}
    for w in range(st.consumers):
        for t in range(128):
            for i in range(st.cols // 2):
                r, c = st.element(w, int(rows[t, i]), int(cols[t, i]))
                placed[(r, c)] = w * st.rows * st.cols + st.slot(t, i)
    assert len(placed) == height * width and sorted(placed.values()) == list(range(height * width))
    assert all(index[r * width + c] == at for (r, c), at in placed.items())


@pytest.mark.skipif(GXX is None, reason="g++ not found on PATH")
def test_the_transposed_ds_store_addresses_the_rows_the_simulator_stores(tmp_path):
    """The emitted stmatrix .trans row address of every (instruction, lane, warp, consumer) (DsStore.lane_row_cpp,
    compiled for the host) is the (query, key) that DsStore.lane_row gives the simulator and the proofs."""
    plan = make_hopper_backward_plan(W("bf16", 128).replace(B_r=80))
    st = plan.ds_store
    query, key = st.lane_row_cpp()
    src = tmp_path / "rows.cpp"
    src.write_text("#include <cstdint>\n#include <cstdio>\nint main() { for (uint32_t cw = 0; cw < 2u; ++cw) "
                   f"for (uint32_t wtid = 0; wtid < 128u; ++wtid) for (uint32_t t = 0; t < {st.instructions}u; ++t) {{ "
                   f"const uint32_t lane = wtid % 32u; std::printf(\"%u %u\\n\", {query}, {key}); }} return 0; }}\n")
    subprocess.run([GXX, "-O1", "-o", str(tmp_path / "rows"), str(src)], check=True)
    got = [tuple(int(x) for x in line.split()) for line in
           subprocess.run([str(tmp_path / "rows")], capture_output=True, text=True, check=True).stdout.splitlines()]
    assert got == [st.lane_row(t, wtid % 32, wtid // 32, cw) for cw in range(2) for wtid in range(128) for t in range(st.instructions)]


def test_only_the_transposed_ds_store_brings_its_stmatrix_helper():
    """The 80-row kernel stores dS with its DsStore's stmatrix atom, whose helper it defines once; the 64-row kernel
    stores 32-bit pairs and carries no stmatrix helper."""
    t80, t64 = (emit_hopper_backward(make_hopper_backward_plan(W("bf16", 128).replace(B_r=b))).text for b in (80, 64))
    assert make_hopper_backward_plan(W("bf16", 128).replace(B_r=80)).ds_store.atom.family == "stmatrix"
    assert t80.count("void stmatrix_x4_trans(") == 1 and t80.count("stmatrix_x4_trans(sdS + buf * DS_BYTES") == 1
    assert "st_shared_b32(sdS" not in t80  # (its dK and dV staging stores 32-bit pairs)
    assert "stmatrix" not in t64.replace("st.shared or stmatrix wrote", "") and "st_shared_b32(sdS + buf * DS_BYTES" in t64


def test_d_head_64_splits_dq_by_rows_and_128_by_columns():
    """A 128-row query block gives each consumer 64 query rows of every column (its A operand starts at its query
    columns of dS^T, one 64-column swizzle box on); a 64-row block gives each consumer half of the columns (its B
    operand starts half of K's columns on)."""
    rows, cols = make_hopper_backward_plan(W("bf16", 64)), make_hopper_backward_plan(W("bf16", 128, "causal"))
    assert rows.dq_stage.by_rows and [(rows.dq_stage.row0(w), rows.dq_stage.col0(w)) for w in (0, 1)] == [(0, 0), (64, 0)]
    assert not cols.dq_stage.by_rows and [(cols.dq_stage.row0(w), cols.dq_stage.col0(w)) for w in (0, 1)] == [(0, 0), (0, 64)]
    assert rows.gemms["dQ"].a.row_block_offset == 128 * 128 and rows.gemms["dQ"].b.row_block_offset == 0
    assert cols.gemms["dQ"].a.row_block_offset == 0 and cols.gemms["dQ"].b.row_block_offset == 128 * 128


def test_only_ordered_adds_and_the_producers_stage_dq_in_shared_memory():
    """Unordered dQ adds of 64-row tiles go straight from the accumulators: their plan holds no staging region (32 KB
    less shared memory at d_head 128); the deterministic backward's bulk reductions need it, and so do the producer's
    of the transposed tile (d_head 128 unmasked), which also keeps a chunk index per ring stage and its dq_empty barrier."""
    for d_head, mask in ((64, "none"), (128, "causal")):
        free, ordered = (make_hopper_backward_plan(W("bf16", d_head, mask).replace(deterministic=det)) for det in (False, True))
        assert not free.dq_stage.in_smem and ordered.dq_stage.staged
        region = free.dq_stage.consumers * free.dq_stage.region_bytes
        assert ordered.smem_bytes - free.smem_bytes == region == 4 * free.cfg.B_r * d_head
    by_producer, ordered = (make_hopper_backward_plan(W("bf16", 128).replace(deterministic=det)) for det in (False, True))
    assert by_producer.dq_stage.by_producer and by_producer.dq_stage.transposed and not by_producer.dq_stage.staged
    assert by_producer.smem_bytes - ordered.smem_bytes == 16 + 8  # the chunk slots (whole 16 bytes), dq_empty


def test_emitting_is_pure():
    cfg = W("fp16", 64, "causal")
    assert emit_hopper_backward(make_hopper_backward_plan(cfg)).text == emit_hopper_backward(make_hopper_backward_plan(cfg)).text
    other = emit_hopper_backward(make_hopper_backward_plan(cfg.replace(stages=1))).text
    assert other != emit_hopper_backward(make_hopper_backward_plan(cfg)).text
