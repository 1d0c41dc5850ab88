"""Float64 check of the persistent d_head-128 B_c-128 kernels on shapes that walk tile transitions.

Run plain (main's kernels) or under tools/transition_patch.py (the transition probe). Shapes: the
benchmark's seq 2048 (4096 tiles on 132 SMs: loops, then a split last round), odd query/key
lengths, one key block per tile (with and without a key tail), and the log-sum-exp output.
"""
import math
import sys

import torch

import flashgen

tag = sys.argv[1] if len(sys.argv) > 1 else "?"
torch.manual_seed(1)
worst = 0.0
for dt in (torch.float16, torch.bfloat16):
    name = "FP16" if dt == torch.float16 else "BF16"
    attn = flashgen.compile(f"({name}, 128, 128, 128, 12): wgmma+stages_2+pingpong+intra+persistent")
    for b, sq, h, sk in ((16, 2048, 16, 2048), (3, 1000, 29, 1500), (8, 1024, 16, 100), (6, 640, 40, 128), (2, 4096, 33, 777)):
        q = torch.randn(b, sq, h, 128, device="cuda", dtype=dt)
        k, v = (torch.randn(b, sk, h, 128, device="cuda", dtype=dt) for _ in range(2))
        k[:, -50:] *= 3  # late keys with larger scores: the running max moves mid-row
        out = torch.full_like(q, float("nan"))
        o, lse = attn(q, k, v, out=out, return_lse=True)
        assert torch.isfinite(out).all(), (name, b, sq, h, sk, "unwritten or non-finite output")
        num = den = lnum = lden = 0.0
        for i in range(b):  # one batch at a time: the float64 scores of seq 2048 x 16 heads are 0.5 GB each
            qd, kd, vd = (x[i].double().transpose(0, 1) for x in (q, k, v))
            s = qd @ kd.transpose(-1, -2) / math.sqrt(128)
            ref = (s.softmax(-1) @ vd).transpose(0, 1)
            num += (out[i].double() - ref).norm().item() ** 2
            den += ref.norm().item() ** 2
            lref = torch.logsumexp(s, -1)
            lnum += (lse[i].double() - lref).norm().item() ** 2
            lden += lref.norm().item() ** 2
        err, lerr = math.sqrt(num / den), math.sqrt(lnum / lden)
        worst = max(worst, err)
        print(f"{tag} {name} b{b} sq{sq} h{h} sk{sk}: rel err {err:.2e}, lse {lerr:.2e}", flush=True)
        assert err < (4e-3 if dt == torch.bfloat16 else 2e-3) and lerr < 1e-4, (name, b, sq, h, sk, err, lerr)
print(f"{tag}: correct, worst rel err {worst:.2e}")
