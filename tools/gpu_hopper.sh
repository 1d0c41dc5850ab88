#!/usr/bin/env bash
# Hopper engine on the GPU: smoke (diagnostic inputs), then the GPU tests, then the benchmark.
# usage: OUT=dir [BENCH="configs..."] bash tools/gpu_hopper.sh [smoke|tests|bench|all]
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
what=${1:-all}
if [[ $what == smoke || $what == all ]]; then
  echo "== smoke"
  timeout 300 python tools/hopper_smoke.py 2>&1 | tail -40
  timeout 120 python tools/hopper_smoke.py "(BF16, 128, 128, 128, 12): wgmma+stages_2" 2>&1 | tail -20
fi
if [[ $what == tests || $what == all ]]; then
  echo "== gpu tests (hopper)"
  timeout 900 python -m pytest tests/gpu/test_hopper.py -q -x -p no:cacheprovider 2>&1 | tail -15
fi
if [[ $what == bench || $what == all ]]; then
  echo "== bench"
  # shellcheck disable=SC2086  # BENCH is a list of configs / named sets
  eval "python -m flashgen.cli bench ${BENCH:-hopper defaults} --d-heads 128 --causal both --seqs 512 1024 2048 4096 8192 16384 -o \"\$OUT\"" \
    2>"$OUT/bench.err" | tee "$OUT/bench_table.txt"
  python tools/bench_per_config.py "$OUT/bench.json" | tee "$OUT/bench_per_config.txt"
fi
