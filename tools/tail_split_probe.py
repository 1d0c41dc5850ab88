"""Does the wave-tail split engage (one workspace allocation per call), and what does it do to
tail-heavy shapes (SMs + 1 or + 4 tiles) and to the benchmark's? GPU machine, from a variant folder:

    (cd ab_main && PYTHONPATH=$PWD:/tmp/site python ../tools/tail_split_probe.py ab_main)
"""
import sys

import torch
import triton

import flashgen
from flashgen.dsl.config import KernelConfig

cfg = KernelConfig.wgmma("fp16", B_c=160, persistent=True)
attn = flashgen.compile(cfg)
sms = torch.cuda.get_device_properties(0).multi_processor_count
for b, s, h, sk in [(sms + 1, 128, 1, 16384), (sms + 4, 128, 1, 8192), (1, 128, 8, 32768), (2, 1024, 4, 8192), (16, 2048, 16, 2048), (16, 4096, 16, 4096)]:
    q = torch.randn(b, s, h, 128, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(b, sk, h, 128, device="cuda", dtype=torch.float16) for _ in range(2))
    out = torch.empty_like(q)
    attn(q, k, v, out=out); torch.cuda.synchronize()
    a0 = torch.cuda.memory_stats()["allocation.all.allocated"]
    attn(q, k, v, out=out); torch.cuda.synchronize()
    allocs = torch.cuda.memory_stats()["allocation.all.allocated"] - a0
    ms = [triton.testing.do_bench(lambda: attn(q, k, v, out=out), warmup=50, rep=300, return_mode="median") for _ in range(3)]
    tf = 4 * b * h * s * sk * 128 / (min(ms) * 1e-3) / 1e12
    print(f"{sys.argv[1]:8s} shape {(b, s, h, sk)} allocs/call {allocs} ms {' '.join(f'{m:.4f}' for m in ms)} TFLOP/s {tf:.0f}", flush=True)
