#!/usr/bin/env bash
# A/B timing of code versions on the GPU machine, in one process per version and round.
#
# usage (repository root on the GPU machine, results under $OUT):
#   mkdir ab_main && git archive main flashgen tools | tar -x -C ab_main    # (here, before the run)
#   OUT=out VARIANTS=". ab_main" ROUNDS="1 2" [CFGS="'short form' ..."] [SEQS="2048 4096"] \
#     [CAUSAL=both] [DTYPES="fp16 bf16"] [TESTS="pytest -k expression"] bash tools/ab_bench.sh
# Each variant directory holds a flashgen/ package (and tools/); "." is the working tree. Variants
# alternate within a round; each prints `flashgen bench` and a per-config table (tools/bench_per_config.py).
# The lark wheel must be in .whl/ (see README: GPU machines cannot download).
set -uo pipefail
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site FLASHGEN_CACHE=${FLASHGEN_CACHE:-/tmp/fgcache} PYTHONUNBUFFERED=1
OUT=$(realpath -m "${OUT:-ab_out}"); mkdir -p "$OUT"
CFGS="${CFGS:-'(FP16, 128, 128, 128, 12): wgmma+stages_2+pingpong+intra+persistent'}"
SEQS="${SEQS:-1024 2048 4096 8192}"
if [[ -n "${TESTS:-}" ]]; then
  echo "== tests"; timeout 500 python -m pytest tests/gpu/test_hopper.py -q -x -p no:cacheprovider -k "$TESTS" 2>&1 | tail -8
fi

for round in ${ROUNDS:-1 2}; do
  for dir in ${VARIANTS:-.}; do
    tag=$(basename "$(realpath "$dir")")$round
    echo "== bench $dir round $round"
    # shellcheck disable=SC2086  # CFGS is a list of quoted short forms
    (cd "$dir" && eval "python -m flashgen.cli bench $CFGS --d-heads 128 --causal ${CAUSAL:-both} --dtypes ${DTYPES:-fp16} --seqs $SEQS -o \"$OUT/$tag\"" \
      2>"$OUT/$tag.err" | tail -1)
    python tools/bench_per_config.py "$OUT/$tag/bench.json" > "$OUT/${tag}_per_config.txt"
  done
done
for f in "$OUT"/*_per_config.txt; do echo "== $f"; cut -c1-330 "$f" | grep -v "^NVIDIA\|dense"; done
