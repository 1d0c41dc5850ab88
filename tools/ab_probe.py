"""Time code versions of the persistent d_head-128 kernels against each other (session 9's A/B probe).

Each process checks the kernels against float64 attention (NaN-poisoned outputs, odd lengths, causal,
scaled inputs), then prints do_bench medians of 3 timings for seq 2048 / 4096 / 8192 (batch 16 / 16 /
8, 16 heads, fp16), non-causal per B_c and causal at B_c 128. On the GPU machine, alternating variant
folders (each holding a flashgen/ package) in separate processes:

    for r in 1 2; do for v in main other; do
      BCS="128 160" SEED=$r TAG=$v$r PYTHONPATH=$PWD/$v:/tmp/site python tools/ab_probe.py; done; done
"""
import math
import os
import statistics

import torch
from triton.testing import do_bench

import flashgen

tag = os.environ.get("TAG", "?")
torch.manual_seed(int(os.environ.get("SEED", "0")))
BCS = [int(x) for x in os.environ.get("BCS", "128 160").split()]
a = {bc: flashgen.compile(f"(FP16, 128, 128, {bc}, 12): wgmma+stages_2+pingpong+intra+persistent") for bc in BCS}


def ref(q, k, v, causal):
    qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k, v))
    s = qd @ kd.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return (s.softmax(-1) @ vd).transpose(1, 2)


# correctness: float64 reference, poisoned outputs, odd lengths, scaled inputs (max jumps between blocks)
worst = 0.0
for bc, at in a.items():
    # the last case: 1440 causal tiles, more than the SMs, so persistent CTAs loop over unequal tiles
    for (b, sq, h, sk), causal, amp in [((2, 1000, 3, 1000), False, 1), ((1, 700, 2, 2300), False, 4), ((2, 1024, 2, 1024), True, 1),
                                        ((1, 513, 2, 513), True, 3), ((3, 1500, 40, 1500), True, 1)]:
        q, k, v = (torch.randn(b, n, h, 128, device="cuda", dtype=torch.float16) for n in (sq, sk, sk))
        q = q * amp
        k[:, -200:] *= 3  # late keys with larger scores: the running max moves up mid-row
        out = torch.full_like(q, float("nan"))
        at(q, k, v, causal=causal, out=out)
        r = ref(q, k, v, causal)
        err = ((out.double() - r).norm() / r.norm()).item()
        worst = max(worst, err)
        assert torch.isfinite(out).all() and err < 2e-3, (bc, b, sq, h, sk, causal, amp, err)
print(f"{tag}: correct, worst rel err {worst:.2e}")
B, H, D = 16, 16, 128
cases = {}
for sq, bsz in ((2048, 16), (4096, 16), (8192, 8)):
    q, k, v = (torch.randn(bsz, sq, H, D, device="cuda", dtype=torch.float16) for _ in range(3))
    for bc in BCS:
        cases[f"bc{bc} full {sq}"] = (lambda q=q, k=k, v=v, at=a[bc]: at(q, k, v), 4 * bsz * H * sq * sq * D)
    cases[f"bc128 causal {sq}"] = (lambda q=q, k=k, v=v: a[128](q, k, v, causal=True), 2 * bsz * H * sq * sq * D)
res = {}
for r in range(3):
    for name, (fn, _) in cases.items():
        res.setdefault(name, []).append(do_bench(fn, warmup=50, rep=150, return_mode="median"))
for name, ts in res.items():
    t = statistics.median(ts)
    print(f"{tag:6s} {name:18s} {t*1000:8.1f} us {cases[name][1]/t/1e9:6.0f} TFLOP/s")
