"""Where each benchmark row's ratio to SDPA cuDNN sits across runs, per config (CPU, reads bench JSONs).

    python tools/ratio_stats.py docs/results/hopper_bench_session*_h100.json

For every row at seq >= 2048 (d_head 128): each run's median-based ratio of each persistent/grid
wgmma config to the run's SDPA cuDNN, the median over runs, and how many runs reached 1.05x. One run
is noisy (see `x cudnn by round` in newer tables); the median over runs says where a row really sits.
"""
import json
import statistics
import sys
from pathlib import Path

from flashgen.dsl.notation import parse_config

BAR = 1.05


def kind(short_form: str) -> str:
    """A short name for the config families the benchmarks time."""
    cfg = parse_config(short_form)
    if not cfg.is_wgmma:
        return "mma.sync"
    return f"{'persistent' if cfg.persistent else 'grid'} B_c {cfg.B_c}"


def main(paths: list[str]) -> None:
    runs = {Path(p).stem: json.loads(Path(p).read_text()) for p in paths}
    table: dict = {}  # (dtype, causal, seq) -> config kind -> [ratio per run]
    for name, res in runs.items():
        for row in res["rows"]:
            cudnn = row["peers"].get("CUDNN_ATTENTION")
            if row["d_head"] != 128 or row["seq"] < 2048 or not cudnn:
                continue
            key = (row["dtype"], row["causal"], row["seq"])
            best = max(v["tflops"] for v in row["flashgen"].values())
            table.setdefault(key, {}).setdefault("best of run", []).append(best / cudnn)
            for cfg, v in row["flashgen"].items():
                table[key].setdefault(kind(cfg), []).append(v["tflops"] / cudnn)
    print(f"ratio to SDPA cuDNN of the same run, d_head 128, {len(runs)} runs: {', '.join(runs)}")
    print("row                      config               runs  median   min    max   runs >= 1.05")
    for (dt, causal, seq), per in sorted(table.items()):
        for k, ratios in sorted(per.items()):
            if k == "mma.sync":
                continue
            hit = sum(r >= BAR for r in ratios)
            print(f"{dt} {'causal' if causal else 'full  '} {seq:6d}       {k:20s} {len(ratios):4d}  {statistics.median(ratios):.3f}  "
                  f"{min(ratios):.3f}  {max(ratios):.3f}  {hit:3d}")


if __name__ == "__main__":
    main(sys.argv[1:])
