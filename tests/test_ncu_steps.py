"""benchmarks/ncu_steps.py: ncu's per-instruction samples attributed to a kernel's schedule steps."""
from __future__ import annotations

import csv
import io
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import ncu_steps  # noqa: E402

KERNEL = "fg_demo::kernel(fg_demo::Params)"

SOURCE = """\
// ---- PTX helpers ----
__device__ __forceinline__ void mma(float* d) {
    asm volatile("...");
}
__global__ void __launch_bounds__(256) kernel(const __grid_constant__ Params p) {
    const uint32_t tid = threadIdx.x;
    for (int w = 0; w < work; ++w) {
        // [gemm S] S = Q K^T
        mma(s);
        // [reduce_gm dQ] dQ added
        red(dq);
    }
    // ---- epilogue ----
    store(o);
}
"""

#: nvdisasm --print-line-info-inline: an inlined helper's line comes with the kernel line that calls it
LISTING = """\
//--------------------- .text._ZN7fg_demo7preprocessENS_6ParamsE --------------------------
.text._ZN7fg_demo7preprocessENS_6ParamsE:
        /*0000*/                   EXIT ;
//--------------------- .text._ZN7fg_demo6kernelENS_6ParamsE --------------------------
.text._ZN7fg_demo6kernelENS_6ParamsE:
	//## File "/tmp/k.cu", line 6
        /*0000*/                   S2R R0, SR_TID.X ;
	//## File "/tmp/k.cu", line 3 inlined at "/tmp/k.cu", line 9
        /*0010*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0020*/              @P0  HMMA.16816.F32.BF16 R4, R8, R14, R4 ;
	//## File "/tmp/k.cu", line 11
        /*0030*/                   REDG.E.ADD.F32x2.FTZ.RN.STRONG.GPU desc[UR4][R2.64], R4 ;
.L_x_1:
	//## File "/tmp/k.cu", line 14
        /*0040*/                   STG.E desc[UR4][R2.64], R4 ;
        /*0050*/                   EXIT ;
//--------------------- .nv.shared --------------------------
"""


def _csv(rows: list[tuple[str, int, dict]], kernel: str = KERNEL, executed: "list[int] | None" = None) -> str:
    """ncu's source page as CSV (`--page source --csv --print-source sass`), the columns the tool reads; ``executed``:
    each instruction's warp instructions executed (no such column without)."""
    reasons = ["stall_barrier", "stall_long_sb", "stall_math", "stall_lg"]
    out = io.StringIO()
    w = csv.writer(out, quoting=csv.QUOTE_ALL)
    w.writerow(["Kernel Name", kernel])
    w.writerow(["Address", "Source", ncu_steps.ALL_SAMPLES, "# Samples", *([ncu_steps.EXECUTED] if executed else []), *reasons,
                *(f"{r} (Not Issued)" for r in reasons)])
    for i, (sass, n, why) in enumerate(rows):
        w.writerow([hex(0x7f0000 + 16 * i), f"      {sass}", n, n, *([executed[i]] if executed else []),
                    *(why.get(r[6:], 0) for r in reasons), *([0] * 4)])
    return out.getvalue()


PROFILE = [("S2R R0, SR_TID.X", 1, {}),
           ("HMMA.16816.F32.BF16 R4, R8, R12, R4", 10, {"math": 7, "barrier": 3}),
           ("@P0   HMMA.16816.F32.BF16 R4, R8, R14, R4", 20, {"math": 20}),
           ("REDG.E.ADD.F32x2.FTZ.RN.STRONG.GPU desc[UR4][R2.64], R4", 30, {"lg": 30}),
           ("STG.E desc[UR4][R2.64], R4", 39, {"long_sb": 39}),
           ("EXIT", 0, {})]


def test_samples_go_to_the_step_of_the_kernel_line_that_issued_them():
    name, samples = ncu_steps.read_samples(_csv(PROFILE))
    lines = ncu_steps.line_table(LISTING, ncu_steps.section_of(name))
    assert [line for _, line in lines] == [6, 9, 9, 11, 14, 14]  # the inlined HMMAs at their call site
    shares = {s.step: s for s in ncu_steps.attribute(samples, lines, ncu_steps.steps_by_line(SOURCE))}
    assert {k: v.samples for k, v in shares.items()} == {"kernel: setup": 1, "gemm S": 30, "reduce_gm dQ": 30,
                                                          "epilogue": 39}
    assert shares["gemm S"].stalls["math"] == 27 and shares["gemm S"].stalls["barrier"] == 3
    text = ncu_steps.report(list(shares.values()), samples, top=1)
    assert "39.0%  epilogue" in text and text.splitlines()[-1].split()[:2] == ["39.00%", "long_sb"]


def test_executed_instructions_are_summed_per_step_where_the_report_counted_them():
    """The loop's instructions ran 8 times, the setup and epilogue's once: the step's share of the work issued."""
    executed = [1, 8, 8, 8, 1, 1]
    name, samples = ncu_steps.read_samples(_csv(PROFILE, executed=executed))
    lines = ncu_steps.line_table(LISTING, ncu_steps.section_of(name))
    shares = {s.step: s for s in ncu_steps.attribute(samples, lines, ncu_steps.steps_by_line(SOURCE))}
    assert {k: v.executed for k, v in shares.items()} == {"kernel: setup": 1, "gemm S": 16, "reduce_gm dQ": 8, "epilogue": 2}
    row = next(line for line in ncu_steps.report(list(shares.values()), samples, top=0).splitlines() if "gemm S" in line)
    assert row.split()[:3] == ["30.0%", "59.3%", "gemm"]  # 30 of 100 samples, 16 of 27 instructions
    plain = ncu_steps.report(list(shares.values()), ncu_steps.read_samples(_csv(PROFILE))[1], top=0)
    assert "insts" not in plain


def test_a_different_kernel_is_refused():
    name, samples = ncu_steps.read_samples(_csv(PROFILE))
    lines = ncu_steps.line_table(LISTING, ncu_steps.section_of(name))
    steps = ncu_steps.steps_by_line(SOURCE)
    with pytest.raises(SystemExit, match="6 instructions, the compiled .cu 5"):
        ncu_steps.attribute(samples, lines[:-1], steps)
    other = PROFILE[:3] + [("RED.E.ADD.F32 [R2.64], R4", 30, {})] + PROFILE[4:]
    with pytest.raises(SystemExit, match="instruction 3 differs"):
        ncu_steps.attribute(ncu_steps.read_samples(_csv(other))[1], lines, steps)
    with pytest.raises(SystemExit, match="no section"):
        ncu_steps.line_table(LISTING, ncu_steps.section_of("fg_other::kernel(fg_other::Params)"))
    with pytest.raises(SystemExit, match="not a flashgen kernel"):
        ncu_steps.section_of("void cutlass::device_kernel<Op>(Op::Params)")


def test_a_csv_without_samples_is_explained():
    with pytest.raises(SystemExit, match="--page source --csv --print-source sass"):
        ncu_steps.read_samples('"ID","Kernel Name","Metric Name"\n"0","k","dram__bytes"\n')


def _nvdisasm() -> str | None:
    return os.environ.get("NVDISASM") or shutil.which("nvdisasm")


@pytest.mark.skipif(shutil.which("nvcc") is None or _nvdisasm() is None, reason="needs nvcc and nvdisasm")
def test_an_emitted_kernel_maps_onto_its_schedule_steps(tmp_path):
    """The real chain: an emitted backward kernel compiled as flashgen builds it; every instruction's line
    lies in the kernel, and its dQ adds are found at the reduce_gm step."""
    from flashgen.cli import main as cli

    assert cli(["emit", "bwd(BF16, 64, 64, 64, 4): swizzled", "-o", str(tmp_path)]) == 0
    cu = next(tmp_path.glob("flash_bwd_*.cu"))
    listing = ncu_steps.disassemble(cu, "sm_80")
    name = f"{cu.stem}::kernel({cu.stem}::Params)"
    lines = ncu_steps.line_table(listing, ncu_steps.section_of(name))
    steps = ncu_steps.steps_by_line(cu.read_text())
    profile = [(sass, 1 if sass.startswith("RED") else 0, {}) for sass, _ in lines]
    shares = ncu_steps.attribute(ncu_steps.read_samples(_csv(profile, name))[1], lines, steps)
    assert {s.step for s in shares if s.samples} == {"reduce_gm dQ"}
    assert {s.step for s in shares} >= {"gemm S", "gemm dV", "gemm dK", "gemm dQ", "epilogue"}


def test_record_profiles_one_launch_of_the_passes_main_kernel(tmp_path):
    """The profiling run filters the pass's main kernel, one launch, every section, into the output folder; the
    profiled process writes the kernel's .cu there; the export reads that report's SASS source page."""
    row = {"pass": "bwd", "dtype": "bfloat16", "d_head": 128, "seq": 2048, "causal": True}
    run, export = ncu_steps.record_commands(row, tmp_path, "ncu")
    flags = dict(zip(run, run[1:]))
    assert flags["--kernel-name"] == "regex:flash_bwd.*::kernel" and flags["--launch-count"] == "1"
    assert flags["--set"] == "full" and flags["-o"] == str(tmp_path / "profile")
    assert json.loads(run[-1]) == {**row, "cu": str(tmp_path / "kernel.cu")} and run[-4:-2] == [sys.executable, "-c"]
    compile(run[-2], "<run>", "exec")  # the profiled script parses
    assert export[:3] == ["ncu", "-i", str(tmp_path / "profile.ncu-rep")] and export[-3:] == ["--csv", "--print-source", "sass"]
    fwd, _ = ncu_steps.record_commands({**row, "pass": "fwd"}, tmp_path)
    assert "regex:flash_fwd.*::kernel" in fwd


def test_record_without_ncu_says_what_it_needs(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("NCU", raising=False)
    with pytest.raises(SystemExit, match="needs Nsight Compute's ncu"):
        ncu_steps.main(["record", "-o", str(tmp_path / "out")])


def test_record_of_fa4_filters_its_main_kernel_and_runs_it_as_the_bench_does(tmp_path):
    """FlashAttention-4's main backward kernel (not its preprocess or postprocess), through flashgen.bench_peers."""
    row = {"pass": "bwd", "dtype": "bfloat16", "d_head": 64, "seq": 8192, "causal": False}
    run, _ = ncu_steps.record_commands(row, tmp_path, "ncu", peer="fa4")
    flags = dict(zip(run, run[1:]))
    assert flags["--kernel-name"] == "regex:FlashAttentionBackwardSm" and flags["--launch-count"] == "1"
    assert "fa4_peer" in run[-2] and "flashgen.compile" not in run[-2]
    compile(run[-2], "<run>", "exec")
    fwd, _ = ncu_steps.record_commands({**row, "pass": "fwd"}, tmp_path, peer="fa4")
    assert "regex:FlashAttentionForwardSm" in fwd


def test_record_of_fa4_where_it_is_missing_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
    with pytest.raises(SystemExit, match="pip install flash-attn-4"):
        ncu_steps.main(["record", "--peer", "fa4", "-o", str(tmp_path / "out")])


MINE = [("HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24", 50, {"math": 50}), ("FFMA R1, R2, R3, R4", 10, {"math": 10}),
        ("@P0 MUFU.EX2 R5, R5", 20, {"barrier": 20}), ("IMAD.SHL.U32 R6, R7, 0x2, RZ", 20, {"long_sb": 20})]
PEER = [("HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24", 50, {"math": 50}), ("FFMA R1, R2, R3, R4", 10, {"math": 10}),
        ("MUFU.EX2 R5, R5", 20, {"math": 20})]


def test_mix_sets_kernels_opcodes_side_by_side_largest_difference_first(tmp_path):
    """Executed instructions per opcode (modifiers and predicates dropped): the base's in millions, each other
    kernel's difference; IMAD, which only the base issues, leads; then each kernel's stall reasons."""
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    a.write_text(_csv(MINE, executed=[4_000_000, 8_000_000, 2_000_000, 3_000_000]))
    b.write_text(_csv(PEER, "kernel_cutlass_fa4", executed=[4_000_000, 7_000_000, 2_000_000]))
    kernels = [ncu_steps.read_samples(p.read_text()) for p in (a, b)]
    assert ncu_steps.opcode_mix(kernels[0][1]) == {"HGMMA": 4_000_000, "FFMA": 8_000_000, "MUFU": 2_000_000, "IMAD": 3_000_000}
    lines = ncu_steps.mix_report(kernels).splitlines()
    assert lines[0] == f"K0: {KERNEL} (17.0 M warp instructions executed)" and lines[1].startswith("K1: kernel_cutlass_fa4 (13.0 M")
    table = {line.split()[0]: line.split()[1:] for line in lines[3:7]}
    assert [line.split()[0] for line in lines[3:7]] == ["IMAD", "FFMA", "HGMMA", "MUFU"]
    assert table["IMAD"] == ["3.00", "-3.00"] and table["FFMA"] == ["8.00", "-1.00"] and table["MUFU"] == ["2.00", "+0.00"]
    assert lines[-2].startswith("K0 stalls: math 60%, barrier 20%, long_sb 20%") and lines[-1] == "K1 stalls: math 100%"


def test_mix_needs_instruction_counts(tmp_path):
    a = tmp_path / "a.csv"
    a.write_text(_csv(MINE))
    with pytest.raises(SystemExit, match="SourceCounters"):
        ncu_steps.main(["mix", str(a)])
