"""benchmarks/backward_split.py on the CPU: the FLOPs it credits, its report's totals, and its refusal without a GPU."""
import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("backward_split", REPO / "benchmarks" / "backward_split.py")
backward_split = importlib.util.module_from_spec(spec)
spec.loader.exec_module(backward_split)


def test_flops_are_two_and_a_half_forwards_and_causal_half():
    # 16k tokens at seq 2048: batch 8, 16 heads of 128
    forward = 4 * 8 * 16 * 2048 * 2048 * 128
    assert backward_split.backward_flops(128, 2048, 16384, False) == 2.5 * forward
    assert backward_split.backward_flops(128, 2048, 16384, True) == 1.25 * forward


def test_report_totals_each_side_and_leaves_out_kernels_under_a_microsecond():
    row = {"d_head": 64, "seq": 1024, "causal": True, "flops": 3e9,
           "flashgen": {"kernel": 2.0, "convert_dq": 0.5}, "cudnn": {"main": 1.5, "dot": 1.5}, "flash": {"bwd": 6.0}}
    lines = backward_split.report(row)
    totals = {line.split(":")[0].strip(): line for line in lines if line.startswith("  ") and not line.startswith("    ")}
    assert "2.5 us" in totals["flashgen"] and "1200 TFLOP/s" in totals["flashgen"]  # 3e9 FLOPs in 2.5 us
    assert "3.0 us" in totals["cudnn"] and "500 TFLOP/s" in totals["flash"]
    assert not any("convert_dq" in line for line in lines)


def test_without_a_gpu_it_says_so(capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert backward_split.main(["--seqs", "2048"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
