"""Print every config's TFLOP/s and its ratios to the SDPA peers from a ``flashgen bench`` JSON.

usage: python tools/bench_per_config.py OUT/bench.json
(``flashgen bench`` prints only the best config per row; this shows the side-by-side of all.)
"""
import json
import sys


def main(path: str) -> None:
    res = json.load(open(path))
    print(f"{res['gpu']}, torch {res['torch']}: TFLOP/s (x SDPA flash, x SDPA cuDNN)")
    for row in res["rows"]:
        fa, cu = row["peers"].get("FLASH_ATTENTION"), row["peers"].get("CUDNN_ATTENTION")
        head = f"{row['dtype']} d{row['d_head']} {'causal' if row['causal'] else 'full  '} seq {row['seq']:>5}"
        cells = [f"flash {fa or 0:.0f} cudnn {cu or 0:.0f}"]
        for name, r in row["flashgen"].items():
            tag = "" if r["correct"] else " WRONG"
            cells.append(f"{name} {r['tflops']:.0f} ({r['tflops'] / (fa or 1):.3f}, {r['tflops'] / (cu or 1):.3f}){tag}")
        g = row.get("gpu_state")  # nvidia-smi's record while the row was timed (benches since session 10)
        if g and g.get("power_w") is not None and g.get("clock_mhz") is not None:
            capped = f" capped {g['power_capped']:.0%}" if g.get("power_capped") is not None else ""
            cells.append(f"board {g['power_w']:.0f} W {g['clock_mhz']:.0f} MHz{capped}")
        print(head + " | " + " | ".join(cells))
    print("dense matmul:", {k: round(v) for k, v in res["matmul_tflops"].items()})


if __name__ == "__main__":
    main(sys.argv[1])
