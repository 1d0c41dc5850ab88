"""Does the wave-tail split engage (one workspace allocation per call), and what does it do to
tail-heavy shapes (SMs + 1 or + 4 tiles) and to the benchmark's? GPU machine, from a variant folder:

    (cd ab_main && PYTHONPATH=$PWD:/tmp/site python ../tools/tail_split_probe.py ab_main [causal | d256])

With `causal`: the causal persistent kernel (B_c 128) aligned bottom-right (a query chunk at the
end of a long context), where masked kernels split launches of fewer tiles than SMs. With `d256`:
the d_head-256 kernel of one CTA per tile (no persistent variant fits), which splits such
launches too.
"""
import sys

import torch
import triton

import flashgen
from flashgen.dsl.config import KernelConfig

mode = sys.argv[2] if len(sys.argv) > 2 else ""
causal = mode == "causal"
if mode == "d256":
    cfg = KernelConfig.wgmma("fp16", d_head=256, B_c=64)
else:
    cfg = KernelConfig.wgmma("fp16", B_c=128 if causal else 160, persistent=True)
compiled = flashgen.compile(cfg)
attn = (lambda q, k, v, out: compiled(q, k, v, out=out, causal=True, align="bottom_right")) if causal else compiled
sms = torch.cuda.get_device_properties(0).multi_processor_count
shapes = {"": [(sms + 1, 128, 1, 16384), (sms + 4, 128, 1, 8192)], "causal": [(1, 512, 16, 16384)], "d256": [(2, 512, 4, 8192)]}[mode]
shapes += [(1, 128, 8, 32768)] + ([] if mode == "d256" else [(2, 1024, 4, 8192), (16, 2048, 16, 2048), (16, 4096, 16, 4096)])
d = cfg.d_head
for b, s, h, sk in shapes:
    q = torch.randn(b, s, h, d, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(b, sk, h, d, device="cuda", dtype=torch.float16) for _ in range(2))
    out = torch.empty_like(q)
    attn(q, k, v, out=out); torch.cuda.synchronize()
    a0 = torch.cuda.memory_stats()["allocation.all.allocated"]
    attn(q, k, v, out=out); torch.cuda.synchronize()
    allocs = torch.cuda.memory_stats()["allocation.all.allocated"] - a0
    ms = [triton.testing.do_bench(lambda: attn(q, k, v, out=out), warmup=50, rep=300, return_mode="median") for _ in range(3)]
    kept = s * sk - (s * (s - 1) // 2 if causal else 0)  # scores per head (bottom-right: all but a triangle)
    tf = 4 * b * h * kept * d / (min(ms) * 1e-3) / 1e12
    print(f"{sys.argv[1]:8s} {mode + ' ' if mode else ''}shape {(b, s, h, sk)} allocs/call {allocs} ms {' '.join(f'{m:.4f}' for m in ms)} TFLOP/s {tf:.0f}", flush=True)
