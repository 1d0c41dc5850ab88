"""Compare `flashgen simulate`'s shared-memory bank-conflict prediction with Nsight Compute.

    python benchmarks/ncu_banks.py bank_conflicts.json "<short form>" ["<short form>" ...]   # GPU + ncu
    python benchmarks/ncu_banks.py --predict-only - "<short form>"                          # CPU: the prediction

For each mma.sync config: run tests/gpu/run_one.py under ncu (one launch: batch 1, 2 heads, seq 512),
read l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_{ld,st}.sum and the matching wavefront
counters, and set them next to the simulator's prediction for the same launch:
sum over copies of (wavefronts - ideal wavefronts) per warp x warps x (1 or KV blocks) x CTAs.
Loads are ldmatrix (s2r) and the epilogue's 16-byte shared loads (s2g); stores are the
epilogue's 32-bit stores (r2s) and synchronous g2s stores (cp.async writes are not LSU stores).
"""
import argparse
import csv
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

from flashgen.dsl.notation import parse_config
from flashgen.engines import simulate_config

SEQ, BATCH, HEADS = 512, 1, 2
METRICS = [
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum",
]


def predict(cfg) -> dict:
    rep = simulate_config(cfg, cta=False)
    n_blocks = SEQ // cfg.B_c
    ctas = (SEQ // cfg.B_r) * BATCH * HEADS
    out = {"ld_conflicts": 0, "st_conflicts": 0, "ld_wavefronts": 0, "st_wavefronts": 0}
    for c in rep["copies"]:
        reps = n_blocks if c["per"] == "kv_block" else 1
        total = c["wavefronts_per_warp"] * cfg.n_warps * reps * ctas
        extra = (c["wavefronts_per_warp"] - c["ideal_wavefronts_per_warp"]) * cfg.n_warps * reps * ctas
        if c["kind"] in ("s2r", "s2g"):
            side = "ld"
        elif c["kind"] == "r2s" or (c["kind"] == "g2s" and not cfg.async_copy):
            side = "st"
        else:
            continue
        out[f"{side}_conflicts"] += extra
        out[f"{side}_wavefronts"] += total
    return out


def measure(cfg) -> dict:
    ncu = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    cmd = [ncu, "--metrics", ",".join(METRICS), "--csv", "--kernel-name", "kernel", "--launch-count", "1",
           sys.executable, "tests/gpu/run_one.py", cfg.short_form(), str(SEQ), str(BATCH), str(HEADS)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    text = res.stdout[res.stdout.find('"ID"'):]
    vals = {}
    for row in csv.DictReader(io.StringIO(text)):
        vals[row["Metric Name"]] = float(row["Metric Value"].replace(",", ""))
    if len(vals) < len(METRICS):
        raise RuntimeError(f"ncu gave {vals}\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
    return {
        "ld_conflicts": vals[METRICS[0]], "st_conflicts": vals[METRICS[1]],
        "ld_wavefronts": vals[METRICS[2]], "st_wavefronts": vals[METRICS[3]],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="JSON file for the rows (config, predicted, measured); '-' writes none")
    p.add_argument("configs", nargs="+", help="mma.sync configs as short forms")
    p.add_argument("--predict-only", action="store_true", help="print the simulator's prediction; no GPU, no ncu")
    args = p.parse_args()
    rows = []
    for text in args.configs:
        cfg = parse_config(text)
        pred = predict(cfg)
        meas = None if args.predict_only else measure(cfg)
        rows.append({"config": text, "predicted": pred, "measured": meas})
        print(text)
        for key in pred:
            seen = "" if meas is None else f"   ncu {meas[key]:>12,.0f}"
            print(f"  {key:14} predicted {pred[key]:>12,.0f}{seen}")
    if args.out != "-":
        Path(args.out).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
