"""wgmma-engine kernels: emitted from the HopperPlan, compiled for sm_90a with nvcc (CPU only).

nvcc tests are marked ``nvcc`` (skipped without nvcc). The defaults and a spread of
head sizes / masks must compile with no local memory, and the PTX must hold the
instructions the plan asks for (wgmma, TMA, mbarrier, setmaxnreg, named barriers).
"""
from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest

from flashgen.check import failure_report, ptx_command
from flashgen.dsl.config import KernelConfig, default_configs
from flashgen.dsl.dtypes import DType
from flashgen.dsl.hopper_plan import make_hopper_plan
from flashgen.engines import emit
from flashgen.tune import HOPPER_B_C, hopper_default, lookup

from background import check_results, config_checks  # tests/ is on sys.path (the conftest's folder)

CONFIGS = [
    KernelConfig.wgmma("fp16"),
    KernelConfig.wgmma("bf16"),
    KernelConfig.wgmma("fp16", mask="causal"),
    KernelConfig.wgmma("bf16", d_head=64, pingpong=False),
    KernelConfig.wgmma("fp16", d_head=256, B_c=64, intra_overlap=False, mask="window"),
    KernelConfig.wgmma("bf16", persistent=True),
    KernelConfig.wgmma("fp16", B_c=160, persistent=True),  # the long-sequence default: shared memory nearly full
    KernelConfig.wgmma("bf16", B_r=192, B_c=64, persistent=True),  # three consumers passing turns in a ring
]


# sm_80 is asked for too: wgmma kernels must be skipped there, not fail
background_builds = config_checks(CONFIGS, ("sm_80", "sm_90a"))


@pytest.fixture(scope="module")
def results(background, request, nvcc):
    return check_results(background, request.module, CONFIGS)


@pytest.mark.nvcc
@pytest.mark.parametrize("cfg", CONFIGS, ids=KernelConfig.mangle)
def test_compiles_for_sm90a_without_local_memory(cfg, results):
    assert (cfg, "sm_80") not in results, "wgmma kernels exist for sm_90a only"
    r = results[(cfg, "sm_90a")]
    assert r.ok, failure_report(r)
    s = r.stats
    assert (s.spill_stores, s.spill_loads, s.stack_frame) == (0, 0, 0), f"{cfg}: local memory used\n  {r.command}"
    # setmaxnreg needs a register cap at entry: __launch_bounds__(threads, 1) -> 65536 / threads, rounded down to 8
    assert s.registers == min(255, 65536 // (128 * (1 + cfg.consumers)) // 8 * 8)
    assert "C7508" not in r.log and "C7510" not in r.log, f"ptxas ignored setmaxnreg or serialized wgmma:\n{r.log}"
    assert "instructions are serialized" not in r.log, f"ptxas serialized wgmma (C751x: registers, operands or calls):\n{r.log}"


@pytest.mark.nvcc
def test_ptx_holds_the_planned_instructions(tmp_path, nvcc):
    cfg = KernelConfig.wgmma("fp16", mask="causal")
    plan = make_hopper_plan(cfg)
    cu = tmp_path / "k.cu"
    cu.write_text(emit(cfg).text)
    ptx = tmp_path / "k.ptx"
    subprocess.run(ptx_command(nvcc, cu, "sm_90a", ptx), check=True, capture_output=True)
    text = ptx.read_text()
    s_ops = re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{cfg.B_c}k16\.f32\.f16\.f16", text)
    o_ops = re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{cfg.d_head}k16\.f32\.f16\.f16", text)
    # every code copy (first block / masked and unmasked body / last PV) issues whole GEMMs
    assert s_ops and len(s_ops) % plan.gemm_S.k_steps == 0
    assert o_ops and len(o_ops) % plan.gemm_O.k_steps == 0
    for needle in ("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes", "mbarrier.try_wait.parity",
                   "mbarrier.arrive.expect_tx", "mbarrier.init.shared", "fence.mbarrier_init", "setmaxnreg.inc.sync.aligned.u32 240",
                   "setmaxnreg.dec.sync.aligned.u32 24", "bar.arrive", "wgmma.fence", "wgmma.commit_group", "wgmma.wait_group.sync.aligned 1",
                   "fence.proxy.async.shared::cta", "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group", "cp.async.bulk.commit_group",
                   "cp.async.bulk.wait_group 0"):
        assert needle in text, f"PTX lacks {needle!r}"


def test_emitted_source_renders_the_plan():
    cfg = KernelConfig.wgmma("bf16", B_c=176)
    plan = make_hopper_plan(cfg)
    src = emit(cfg)
    assert src.text == emit(cfg).text, "emission is deterministic"
    text = src.text
    kst, vst = plan.tiles["K"].stage_bytes >> 4, plan.tiles["V"].stage_bytes >> 4
    for t, (qoff, koff) in enumerate(zip(plan.gemm_S.a.step_offsets, plan.gemm_S.b.step_offsets)):
        assert f"(s_acc, desc_q + {qoff >> 4}u, desc_k + uint64_t(st) * {kst}u + {koff >> 4}u, {int(t > 0)});" in text
    for t, voff in enumerate(plan.gemm_O.b.step_offsets):  # intra overlap: PV reads the previous block's stage
        assert f"(o_acc, p_frag[{t}], desc_v + uint64_t(st_prev) * {vst}u + {voff >> 4}u, 1);" in text  # accumulates
    regs = KernelConfig.wgmma("bf16")  # B_c 128: Q's fragments in registers, S starts its accumulator at k step 0
    rplan, rtext = make_hopper_plan(regs), emit(regs).text
    for t, koff in enumerate(rplan.gemm_S.b.step_offsets):
        assert f"(s_acc, q_frag[{t}], desc_k + uint64_t(st) * {rplan.tiles['K'].stage_bytes >> 4}u + {koff >> 4}u, {int(t > 0)});" in rtext
    assert f"smem_desc(sV, {plan.gemm_O.b.lbo}u, {plan.gemm_O.b.sbo}u, 1u)" in text  # V: MN-major, 128B swizzle
    for name, (bar, off, stages) in plan.barriers.items():
        assert f"bar_{name} = smem + {off}u" in text and f"mbar_init(bar_{name} + 8 * s, {bar.arrive_count})" in text
    for (lo, hi) in (pair for regs in plan.p_from_s for pair in regs):
        assert f"pack2(s_acc[{lo}], s_acc[{hi}])" in text
    st = plan.stores["O"]  # each consumer stores its 64 staged rows: the boxes of its row block
    for b in (b for b in st.boxes if b.row0 == 0):
        assert f"tma_store_4d(&p.tm_o, sO + cw * {st.tma.bytes}u + {b.smem_offset}u, {b.col0}, q_row0 + 64 * int(cw), head, batch);" in text
    assert text.count("tma_store_4d(&p.tm_o") == len(st.boxes) // cfg.consumers
    assert f"make_map(&p.tm_o, a->o, a->seq_q, a->heads, a->batch, a->o_stride, {st.tma.box_rows})" in text
    # the staged rows reach the async proxy before the store is issued
    assert text.index("fence_proxy_async();  // the TMA unit") < text.index("this warpgroup's rows are staged") < text.index("tma_store_4d(&p.tm_o")
    assert src.meta["arch"] == "sm_90a" and src.meta["smem_bytes"] == cfg.smem_bytes == plan.smem_bytes


def test_sm90_defaults_to_the_wgmma_engine():
    for dtype in (DType.FP16, DType.BF16):
        hopper = lookup("NVIDIA H200", dtype, 128, 4096, cache={}, capability=(9, 0))
        assert hopper.is_wgmma and hopper.persistent and hopper == hopper_default(dtype, 128)
        # one persistent kernel per head size for every length, masked or not
        for seq, masked in ((512, False), (2048, False), (4096, False), (8192, False), (16384, False), (2048, True), (8192, True)):
            cfg = lookup("NVIDIA H200", dtype, 128, seq, cache={}, capability=(9, 0), masked=masked)
            assert cfg == hopper_default(dtype, 128) and cfg.persistent and cfg.B_c == HOPPER_B_C[128], (seq, masked)
        assert hopper_default(dtype, 64).B_c == HOPPER_B_C[64]
        ampere = lookup("NVIDIA A100", dtype, 128, 4096, cache={}, capability=(8, 0))
        assert not ampere.is_wgmma and ampere in default_configs()
        # a head size the engine does not take falls back to mma.sync
        assert not lookup("NVIDIA H200", dtype, 96, 4096, cache={}, capability=(9, 0)).is_wgmma


def test_building_for_another_gpu_is_refused():
    pytest.importorskip("torch")
    from flashgen.build import BuildError, build

    with pytest.raises(BuildError, match=r"needs compute capability 9\.0 \(sm_90a\), not 8\.0"):
        build(KernelConfig.wgmma("fp16"), capability=(8, 0))


def test_persistent_kernels_loop_over_tiles():
    """Every kernel takes its tiles and grid from the plan's scheduler (its C++: tests/attention/test_scheduler.py);
    persistent kernels (masked or not) wait for Q's release before refilling it and stage O apart from
    Q; plain ones stage O in Q."""
    cfgs = [KernelConfig.wgmma("fp16", persistent=True), KernelConfig.wgmma("fp16", persistent=True, mask="causal"),
            KernelConfig.wgmma("fp16")]
    loop, masked, plain = (emit(c).text for c in cfgs)
    plan = make_hopper_plan(KernelConfig.wgmma("fp16", persistent=True))
    for cfg, text in zip(cfgs, (loop, masked, plain)):  # the SM count is asked of the driver once per device
        assert make_hopper_plan(cfg).scheduler.to_cpp() in text
        assert text.count("cudaDevAttrMultiProcessorCount") == 1 and "static std::atomic<int> known[64];" in text
        assert text.count("sm_count(&sms)") == 1 and text.count("tile_blocks(a, &lo, &hi);") == 1
        assert text.index("tile_blocks(a, &lo, &hi);") < text.index("sched_grid(tiles, sms, lo,")
    for text in (loop, masked):
        assert "mbar_wait(bar_q_empty, (q_it & 1u) ^ 1u);" in text
        assert "if (j + 1 == j_end) {" in text and "mbar_arrive(bar_q_empty);" in text
        assert f"const uint32_t sO = smem + {plan.tiles['O'].offset}u;" in text
        # a tile's staging is rewritten only after the previous tile's TMA stores read it
        assert text.index("bulk_wait_group_read<0>();") < text.index("st_shared_b32(sO")
    assert "bar_q_empty" not in plain and "const uint32_t sO = sQ;" in plain and "bulk_wait_group_read<0>();" not in plain
    # the plan decides the launch shape; the manifest says it
    for c in cfgs:
        assert emit(c).meta["grid"].startswith("(min(SMs") == make_hopper_plan(c).scheduler.persistent


def test_wave_tail_split_is_emitted_for_wgmma_kernels():
    """The split's rule is the plan's TailSplit text; the kernel publishes, counts and merges per warp;
    the workspace function sizes it (the launcher allocates it). Masked kernels split only fewer tiles
    than SMs, bounded by their shortest tile; one-CTA-per-tile kernels widen their grid the same way;
    mma.sync kernels ask for no workspace."""
    cfg = KernelConfig.wgmma("fp16", B_c=160, persistent=True)
    split = emit(cfg)
    text = split.text
    assert make_hopper_plan(cfg).tail_split.to_cpp() in text
    # the kernel splits and indexes by the rule's own helpers (tail_range, tail_*_at), not by a copy
    assert "atomicAdd(p.part_count + tail_count_at(t.tail_tile, warp), 1)" in text
    assert "tail_range(t->j_begin, t->j_end, part, p.tail_parts, &t->j_begin, &t->j_end);" in text
    assert "TAIL_WARPS" not in text.split(make_hopper_plan(cfg).tail_split.to_cpp())[1]
    # publish -> fence -> count; then fence -> read the other parts
    assert text.index("po[32 * i] = o_acc[i];") < text.index("__threadfence();") < text.index("atomicAdd(p.part_count")
    assert text.index("atomicAdd(p.part_count") < text.rindex("__threadfence();") < text.index("__ldcg(p.part_ml")
    # the grid (sched_grid, which asks tail_parts) is bounded by the shortest tile: every tile's blocks unmasked
    assert "*lo = *hi = (a->seq_k + int(B_c) - 1) / int(B_c);" in text
    assert "constexpr bool TAIL_FULL_ROUNDS = true;" in text and "kv_block_range(qb" not in text
    assert "${" not in text and "$tail" not in text
    assert f"extern \"C\" int {cfg.mangle()}_workspace(" in text
    masked = KernelConfig.wgmma("fp16", persistent=True, mask="causal")
    t = emit(masked).text
    assert make_hopper_plan(masked).tail_split.to_cpp() in t and "constexpr bool TAIL_FULL_ROUNDS = false;" in t
    # the parts are bounded by the shortest tile's key blocks: one loop over the query blocks finds it
    assert t.count("kv_block_range(qb * int(B_r)") == 1 and "*lo = je - jb < *lo ? je - jb : *lo;" in t
    assert "atomicAdd(p.part_count" in t and "fewer tiles than SMs" in emit(masked).meta["grid"]
    grid = KernelConfig.wgmma("fp16", mask="causal")
    t = emit(grid).text
    assert "constexpr bool TAIL_FULL_ROUNDS = false;" in t and make_hopper_plan(grid).scheduler.to_cpp() in t
    assert emit(grid).meta["grid"] == "(ceil(seq_q / 128) * heads * batch; fewer tiles than SMs: tiles x the wave-tail split's parts)"
    other = default_configs()[0]
    t = emit(other).text
    assert "part_count" not in t and "tail_parts" not in t and f"{other.mangle()}_workspace(" in t


def test_gemm_calls_follow_the_plans_operand_sources():
    """The wgmma helpers come from the plan's GEMMs (A source, B major-ness), not from the emitter:
    flipping the plan's trans_b changes the emitted call and helper; an A source the emitter does not
    stage is refused."""
    import attrs

    from flashgen.emit import hopper_kernel

    in_smem = KernelConfig.wgmma("fp16", B_c=160)  # Q's fragments do not fit beside S: A of S from shared memory
    assert make_hopper_plan(in_smem).gemm_S.a_from == "smem"
    text = emit(in_smem).text
    assert "wgmma_m64n160k16_f16_ss(s_acc, desc_q + 0u," in text and "q_frag" not in text and "ldsm_x4" not in text
    cfg = KernelConfig.wgmma("fp16")
    real = make_hopper_plan(cfg)
    assert (real.gemm_S.a_from, real.gemm_S.trans_b, real.gemm_O.a_from, real.gemm_O.trans_b) == ("regs", False, "regs", True)
    text = emit(cfg).text
    assert "wgmma_m64n128k16_f16_rs_tb(o_acc, p_frag[0]," in text and "wgmma_m64n128k16_f16_rs(s_acc, q_frag[0], desc_k" in text
    assert "desc_q" not in text and text.count("ldsm_x4(q_frag[kk]") == 1  # Q's fragments loaded once per tile
    flipped = attrs.evolve(real, gemm_O=attrs.evolve(real.gemm_O, trans_b=False))
    text = hopper_kernel.emit_hopper(flipped).text
    assert "_rs_tb" not in text and "wgmma_m64n128k16_f16_rs(o_acc, p_frag[0]," in text
    assert "void wgmma_m64n128k16_f16_rs(float (&d)[64]" in text  # its helper, emitted once
    p_in_smem = attrs.evolve(real, gemm_O=attrs.evolve(real.gemm_O, a_from="smem"))
    with pytest.raises(NotImplementedError, match="GEMM O with A from smem"):
        hopper_kernel.emit_hopper(p_in_smem)


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found on PATH")
@pytest.mark.parametrize("cfg", [KernelConfig.wgmma("fp16"), KernelConfig.wgmma("bf16", d_head=64, persistent=True)], ids=KernelConfig.mangle)
def test_q_fragment_addresses_equal_the_plans_evaluation(cfg, tmp_path):
    """The emitted Q fragment load's lane addresses, compiled for the host, against the plan's own
    objects evaluated in Python: the partition's coordinates and the Q tile layout's offsets (Numba)."""
    from flashgen.emit.hopper_kernel import q_load_cpp
    from flashgen.sim.layout_eval import offsets

    plan = make_hopper_plan(cfg)
    row, col, off = q_load_cpp(plan)
    (kk,) = plan.q_load.partition.loops
    prog = tmp_path / "q.cpp"
    prog.write_text(f"""#include <cstdint>
#include <cstdio>
int main() {{
    for (uint32_t cw = 0; cw < {cfg.consumers}; ++cw)
        for (uint32_t wtid = 0; wtid < 128; ++wtid)
            for (uint32_t {kk.name} = 0; {kk.name} < {kk.extent}; ++{kk.name}) {{
                const uint32_t lane = wtid % 32;
                const uint32_t row = {row}, col = {col};
                std::printf("%u %u %u\\n", row, col, (uint32_t)({off}));
            }}
}}
""")
    exe = tmp_path / "q"
    subprocess.run(["g++", "-std=c++17", "-O0", str(prog), "-o", str(exe)], check=True)
    got = np.loadtxt(subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.splitlines(), dtype=np.int64)
    tile = plan.tiles["Q"]
    table = offsets(tile.layout).reshape(tile.cols, tile.rows).T
    want = []
    for cw in range(cfg.consumers):
        for wtid in range(128):
            for k in range(kk.extent):
                r, c = plan.q_load.partition.coord(wtid % 32, 0, warp=wtid // 32, **{kk.name: k})
                want.append((64 * cw + r, c, table[64 * cw + r, c]))
    np.testing.assert_array_equal(got, np.array(want))


@pytest.mark.parametrize("cfg", [KernelConfig.wgmma("bf16", d_head=64, B_c=64, persistent=True),
                                 KernelConfig.wgmma("fp16", d_head=64, pingpong=False, intra_overlap=False)],
                         ids=lambda c: c.short_form())
def test_producer_and_consumers_walk_the_same_blocks_with_a_mask_mod(cfg):
    """With a mask_mod both sides of the K/V ring step over the block mask's empty blocks with
    ``block_mask_next`` and count the blocks walked (``kv_u``) for the ring's slots and phases, and a split
    tile's part is clipped again; without one the loops step ``++j`` and no walk code is emitted."""
    from flashgen.mods.kernel_mods import prepare_mods

    def sinks(b, h, q_idx, kv_idx):
        return ((kv_idx <= q_idx) & (q_idx - kv_idx <= 40)) | (kv_idx < 3)

    text = emit(cfg, prepare_mods(mask_mod=sinks)[0]).text
    producer = text[text.index("// ---- producer:"): text.index("// ---- consumers:")]
    consumers = text[text.index("// ---- consumers:"): text.index("// ---- epilogue:")]
    for side in (producer, consumers):
        assert "j = block_mask_next(bm, j, j_end), ++kv_u) {" in side
        assert "it = kv_it + uint32_t(kv_u)," in side and "kv_it += uint32_t(kv_u);" in side
        assert "j - j_begin" not in side and "++j)" not in side and "j + 1" not in side
    assert "tail_range(" in text and "block_mask_clip(block_mask_row(p.block_mask, t->batch, t->head" in text
    assert "block_mask_next" not in emit(cfg, prepare_mods(score_mod=lambda s, b, h, q, k: s * 2)[0]).text
