"""benchmarks/ab.py without a GPU: where the old version comes from, and how a row is judged."""
from __future__ import annotations

import importlib.util
import math
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("ab", REPO / "benchmarks" / "ab.py")
ab = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ab)

ROW = {"seq": 1024, "batch": 16, "d_head": 128, "heads": 16, "dtype": "float16", "causal": False, "pass": "fwd"}
KERNELS = {s: {"config": f"cfg-{s}"} for s in ("before", "after")}


def judged(before, after, row=ROW):
    return ab.summarize(row, KERNELS, {"before": before, "after": after},
                        {"before": {"o": (1e-4, 1e-4)}, "after": {"o": (3e-4, 1e-4)}})


def test_a_slowdown_counts_only_beyond_the_rows_own_spread():
    noisy = judged([1.0, 1.1, 0.9], [1.05, 1.04, 1.06])  # 5% slower, rounds spread 20%
    steady = judged([1.0, 1.0, 1.0], [1.05, 1.05, 1.05])  # 5% slower, no spread
    assert noisy["after_over_before"] == pytest.approx(1 / 1.05) and not noisy["slower"]
    assert steady["slower"] and steady["spread"] == 0
    assert steady["ok"] == {"before": True, "after": False}  # 3e-4 > 2 * 1e-4 + 1e-5
    assert steady["error"]["after"]["o"] == {"max_err": 3e-4, "lowp_err": 1e-4, "ok": False}


def test_a_backward_row_counts_two_and_a_half_forwards_and_judges_every_gradient():
    bwd = ab.summarize({**ROW, "pass": "bwd"}, KERNELS, {"before": [1.0] * 3, "after": [1.0] * 3},
                       {s: {"dq": (1e-4, 1e-4), "dk": (1e-4, 1e-4), "dv": (e, 1e-4)} for s, e in (("before", 1e-4), ("after", math.nan))})
    fwd = judged([1.0] * 3, [1.0] * 3)
    assert math.isclose(bwd["tflops"]["before"], 2.5 * fwd["tflops"]["before"])
    assert bwd["ok"] == {"before": True, "after": False}  # a NaN gradient never passes
    assert set(bwd["error"]["after"]) == {"dq", "dk", "dv"} and not bwd["error"]["after"]["dv"]["ok"]
    assert "NO" in ab.report([bwd]) and "bwd" in ab.report([bwd])


def test_the_report_gives_the_geometric_mean_of_the_ratios():
    rows = [judged([1.0] * 3, [0.5] * 3), judged([1.0] * 3, [2.0] * 3)]
    text = ab.report(rows)
    assert "geometric mean after/before: 1.0000" in text and "1 of 2" in text
    assert math.isclose(rows[0]["tflops"]["after"], 2 * rows[0]["tflops"]["before"])


def test_the_old_version_is_a_folder_or_a_git_revision(tmp_path):
    assert ab.checkout(str(REPO), tmp_path / "unused") == REPO
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    into = tmp_path / "head"  # created by the export
    assert (ab.checkout("HEAD", into) / "flashgen" / "__init__.py").exists()
    with pytest.raises(SystemExit, match="neither a folder"):
        ab.checkout("no-such-revision", tmp_path)


def test_rows_cover_both_dtypes_and_masks_of_the_chosen_lengths():
    rows = ab.shape_rows([1024, 8192], ["float16", "bfloat16"])
    assert {(r["seq"], r["batch"], r["dtype"], r["causal"]) for r in rows} == {
        (s, b, d, c) for s, b in ((1024, 16), (8192, 8)) for d in ("float16", "bfloat16") for c in (False, True)}


def test_rows_of_each_head_size_and_the_chosen_pass():
    rows = ab.shape_rows([2048], ["bfloat16"], ["none"], d_heads=(128, 64), pass_="bwd")
    assert [(r["d_head"], r["seq"], r["pass"]) for r in rows] == [(128, 2048, "bwd"), (64, 2048, "bwd")]


def test_rows_of_one_mask_only():
    rows = ab.shape_rows([2048], ["bfloat16"], ["causal"])
    assert [(r["seq"], r["dtype"], r["causal"]) for r in rows] == [(2048, "bfloat16", True)]
