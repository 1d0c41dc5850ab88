#!/usr/bin/env bash
# Nsight Compute profile of one wgmma-engine kernel launch (16 heads; and, for comparison, SDPA cuDNN's),
# plus the kernel's SASS. Run on the GPU machine from the repository root; results under $OUT.
#
# usage: OUT=out [CFG="short form"] [SEQ=2048] [BATCH=16] [DTYPE=fp16] bash tools/profile_hopper.sh
#   $OUT/details.txt      ncu --set full, flashgen kernel (pipe utilization, stall reasons, ...)
#   $OUT/source.csv       per-SASS-instruction counters (stall samples, executed instructions)
#   $OUT/sass.txt         cuobjdump -sass of the built kernel
#   $OUT/cudnn.txt        ncu --set full of SDPA cuDNN on the same shape
#   $OUT/raw.csv, $OUT/cudnn_raw.csv   every metric of the two reports (pipe utilization etc.)
set -uo pipefail
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site FLASHGEN_CACHE=${FLASHGEN_CACHE:-/tmp/fgcache} PYTHONUNBUFFERED=1
OUT=$(realpath -m "${OUT:-prof_out}"); mkdir -p "$OUT"
export CFG="${CFG:-(FP16, 128, 128, 128, 12): wgmma+stages_2+pingpong+intra+persistent}"
export SEQ=${SEQ:-2048} BATCH=${BATCH:-16} DTYPE=${DTYPE:-fp16}

cat > /tmp/profile_run.py <<'PY'
import os, sys
import torch
import flashgen
which = sys.argv[1]
seq, batch = int(os.environ["SEQ"]), int(os.environ["BATCH"])
dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[os.environ["DTYPE"]]
cfg = flashgen.load_config(os.environ["CFG"])
q, k, v = (torch.randn(batch, seq, 16, cfg.d_head, device="cuda", dtype=dt) for _ in range(3))
if which == "flashgen":
    attn = flashgen.compile(cfg)
    if len(sys.argv) > 2:  # where the operator library is, for cuobjdump
        open(sys.argv[2], "w").write(str(attn.built.library))
    run = lambda: attn(q, k, v)
else:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    def run():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt)
for _ in range(3):
    run()
torch.cuda.synchronize()
PY

python /tmp/profile_run.py flashgen /tmp/profile_lib.txt || exit 1  # build outside the profiler
so=$(cat /tmp/profile_lib.txt)
cuobjdump -sass "$so" > "$OUT/sass.txt" 2>&1; echo "sass: $(wc -l < "$OUT/sass.txt") lines from $so"
ncu --set full --import-source no --kernel-name-base demangled -k regex:flash_fwd_ --launch-skip 2 --launch-count 1 -f -o /tmp/fg \
  python /tmp/profile_run.py flashgen > "$OUT/ncu_log.txt" 2>&1
ncu -i /tmp/fg.ncu-rep --page details > "$OUT/details.txt" 2>&1
ncu -i /tmp/fg.ncu-rep --page raw --csv > "$OUT/raw.csv" 2>&1
ncu -i /tmp/fg.ncu-rep --page source --csv --print-source sass > "$OUT/source.csv" 2>&1
ncu --set full -k 'regex:(?i)(cudnn|sdpa|fmha|attn|flash)' --launch-skip 2 --launch-count 1 -f -o /tmp/cudnn \
  python /tmp/profile_run.py cudnn >> "$OUT/ncu_log.txt" 2>&1
ncu -i /tmp/cudnn.ncu-rep --page details > "$OUT/cudnn.txt" 2>&1
ncu -i /tmp/cudnn.ncu-rep --page raw --csv > "$OUT/cudnn_raw.csv" 2>&1
tail -5 "$OUT/ncu_log.txt"; wc -l "$OUT"/*
