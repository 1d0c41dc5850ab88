#!/usr/bin/env bash
# Final check: every GPU test (no sanitizer), the d_head 128 benchmark, ncu bank conflicts vs the simulator.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
echo "== gpu tests"
python -m pytest tests/gpu -q -p no:cacheprovider -k "not sanitizer and not memcheck" 2>&1 | tail -4
echo "== bench"
python -m flashgen.cli bench defaults --d-heads 128 --causal both --seqs 1024 4096 16384 -o "$OUT" 2>"$OUT/bench.err" | tee "$OUT/bench_table.txt"
echo "== ncu bank conflicts"
timeout 120 python tools/ncu_banks.py "$OUT/ncu_banks.json" "(FP16, 128, 64, 64, 4): async+load_0_0_0_tiles" "(FP16, 128, 64, 64, 4): async+swizzled+load_0_0_0_tiles" 2>&1 | grep -v "^==PROF==" | tail -20
