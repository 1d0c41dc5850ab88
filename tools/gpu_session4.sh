#!/usr/bin/env bash
# Block-size exploration beyond the seed's tuning space (8 warps, B_c 128), correctness-checked by bench,
# then `flashgen tune` on a few configs and `flashgen.compile("auto")` picking the tuned winner.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
C=(
"(FP16, 128, 128, 64, 4): async+eager+swizzled+load_2_2_2_tiles+buffer+opt_softmax"
"(FP16, 128, 128, 64, 8): async+eager+swizzled+load_2_2_2_tiles+buffer+opt_softmax"
"(FP16, 128, 128, 128, 8): async+eager+swizzled+load_2_2_2_tiles+buffer+opt_softmax"
"(FP16, 128, 128, 64, 8): async+eager+swizzled+load_0_2_2_tiles+opt_softmax"
"(FP16, 128, 128, 128, 8): async+eager+swizzled+load_0_2_2_tiles+opt_softmax"
"(FP16, 128, 128, 128, 8): async+eager+swizzled+load_0_2_2_tiles+buffer+opt_softmax"
"(FP16, 128, 128, 32, 4): async+eager+swizzled+load_2_2_2_tiles+buffer+opt_softmax"
"(FP16, 128, 64, 64, 4): async+eager+swizzled+load_0_2_2_tiles+opt_softmax"
)
python -m flashgen.cli bench "${C[@]}" --dtypes fp16 --d-heads 128 --seqs 4096 16384 -o "$OUT" 2>"$OUT/bench.err" | tee "$OUT/explore.txt"
python - <<'PY' | tee "$OUT/explore_all.txt"
import json; r = json.load(open("out/bench.json" if False else __import__("os").environ.get("OUT", "out") + "/bench.json"))
for row in r["rows"]:
    for k, v in sorted(row["flashgen"].items(), key=lambda kv: -kv[1]["tflops"]):
        print(row["dtype"], row["seq"], f"{v['tflops']:.0f}", "ok" if v["correct"] else "WRONG", k)
PY
echo "== tune"
python -m flashgen.cli tune "${C[0]}" "${C[1]}" "${C[3]}" --dtypes fp16 --seqs 4096 2>&1 | tail -4
python -c "
import flashgen, torch
a = flashgen.compile('auto')
q = torch.randn(2, 4096, 16, 128, device='cuda', dtype=torch.float16)
print('auto picks:', a.select(q).short_form())
o = a(q, q, q); print('auto ran:', tuple(o.shape), bool(torch.isfinite(o).all()))
"
