#!/usr/bin/env bash
# Focused re-measurement: d_head 128 benchmark (causal and not) and ncu bank conflicts vs the simulator.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
echo "== ncu bank conflicts"
python tools/ncu_banks.py "$OUT/ncu_banks.json" "(FP16, 128, 64, 64, 4): async+load_0_0_0_tiles" "(FP16, 128, 64, 64, 4): async+swizzled+load_0_0_0_tiles" "(FP16, 128, 128, 64, 4): async+eager+swizzled+load_2_2_2_tiles+buffer+opt_softmax" 2>&1 | grep -v "^==PROF=="
echo "== bench"
python -m flashgen.cli bench defaults --d-heads 128 --causal both -o "$OUT" 2>"$OUT/bench.err" | tee "$OUT/bench_table.txt"
tail -3 "$OUT/bench.err"
