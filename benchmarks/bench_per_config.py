"""Every config's TFLOP/s and its ratios to the SDPA backends, from a ``flashgen bench`` JSON.

    python benchmarks/bench_per_config.py bench_out/bench.json

``flashgen bench`` prints the best config per row; this prints all of them side by side, with the
board's power and SM clock while the row was timed where the JSON has them. CPU only.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def row_line(row: dict) -> str:
    """One benchmark row (its pass: fwd, bwd or fwd+bwd): its peers, then each config as ``TFLOP/s (x flash, x cuDNN)``."""
    flash, cudnn = row["peers"].get("FLASH_ATTENTION"), row["peers"].get("CUDNN_ATTENTION")
    head = (f"{row.get('pass', 'fwd'):7} {row['dtype']} d{row['d_head']} {'causal' if row['causal'] else 'full  '} "
            f"seq {row['seq']:>5}")
    cells = [f"flash {flash or 0:.0f} cudnn {cudnn or 0:.0f}"]
    for name, r in row["flashgen"].items():
        if "tflops" not in r:  # failed its first call: not timed
            cells.append(f"{name} FAILED")
            continue
        wrong = "" if r["correct"] else " WRONG"
        cells.append(f"{name} {r['tflops']:.0f} ({r['tflops'] / (flash or 1):.3f}, {r['tflops'] / (cudnn or 1):.3f}){wrong}")
    board = row.get("gpu_state")  # nvidia-smi's record while the row was timed
    if board and board.get("power_w") is not None and board.get("clock_mhz") is not None:
        capped = f" capped {board['power_capped']:.0%}" if board.get("power_capped") is not None else ""
        cells.append(f"board {board['power_w']:.0f} W {board['clock_mhz']:.0f} MHz{capped}")
    return head + " | " + " | ".join(cells)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("bench_json", type=Path, help="bench.json written by `flashgen bench -o FOLDER`")
    args = p.parse_args()
    res = json.loads(args.bench_json.read_text())
    print(f"{res['gpu']}, torch {res['torch']}: TFLOP/s (x SDPA flash, x SDPA cuDNN)")
    for row in res["rows"]:
        print(row_line(row))
    print("dense matmul:", {k: round(v) for k, v in res["matmul_tflops"].items()})


if __name__ == "__main__":
    main()
