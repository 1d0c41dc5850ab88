#!/usr/bin/env bash
# One GPU session's measurements (run on the device machine from the repo root; results under $OUT):
# the full benchmark (fp16/bf16, d_head 64/128, causal and not), ncu bank conflicts vs the simulator,
# compute-sanitizer on odd lengths, cold/warm compile times and the cache hit in a second process.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
CFG="(FP16, 128, 128, 64, 4): async+eager+swizzled+load_2_2_2_tiles+buffer+opt_softmax"
echo "== compile times"
FLASHGEN_CACHE=/tmp/cold_cache python -c "import flashgen; a = flashgen.compile('$CFG', verbose=True); print('cold compile s', round(a.compile_seconds, 1), 'hit', a.built.cache_hit)"
FLASHGEN_CACHE=/tmp/cold_cache python -c "import flashgen; a = flashgen.compile('$CFG', verbose=True); print('second process s', round(a.compile_seconds, 2), 'hit', a.built.cache_hit)"
echo "== ncu bank conflicts"
python tools/ncu_banks.py "$OUT/ncu_banks.json" "(FP16, 128, 64, 64, 4): async+load_0_0_0_tiles" "(FP16, 128, 64, 64, 4): async+swizzled+load_0_0_0_tiles" "$CFG" 2>&1 | grep -v "^==PROF=="
echo "== memcheck on odd lengths"
python -m pytest -q -p no:cacheprovider tests/gpu/test_attention.py -k odd_lengths 2>&1 | tail -3
echo "== bench"
python -m flashgen.cli bench defaults --d-heads 64 128 --causal both -o "$OUT" 2>"$OUT/bench.err" | tee "$OUT/bench_table.txt"
tail -5 "$OUT/bench.err"
