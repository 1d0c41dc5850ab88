"""Time kernels the benchmark's way (do_bench, L2 flushed) and back to back at the power cap.

Run once per code version (a folder holding a flashgen/ package, first on PYTHONPATH), e.g. main
against a diagnostic build whose producer skips the K/V loads after the ring is full (session 10,
docs/results/kv_traffic_h100.txt):

    for r in 1 2; do for v in main noload; do TAG=$v$r PYTHONPATH=$PWD/.probe/$v:/tmp/site python tools/energy_probe.py; done; done

Cases: fp16, d_head 128; persistent kernels (env BLOCKS, default "128:2 160:2" = B_c:stages) on the
non-causal shapes of env SHAPES (default "4096:16:16 2048:16:16" = seq:batch:heads), the first
kernel also at seq 2048 causal (batch 16, 16 heads). Prints do_bench medians and, after a 2 s warm loop, the mean of
>= 0.5 s of back-to-back launches (at least 20) with the median SM clock and power sampled meanwhile.
"""
import os
import time

import torch
from triton.testing import do_bench

import flashgen
from flashgen.gpu_monitor import GpuMonitor, nvidia_smi_id

tag = os.environ.get("TAG", "?")
torch.manual_seed(0)
# BLOCKS: "B_c:stages ..." of the persistent configs to time (default: B_c 128 and 160, two stages)
BLOCKS = [tuple(int(x) for x in b.split(":")) for b in os.environ.get("BLOCKS", "128:2 160:2").split()]
# SHAPES: "seq:batch:heads ..." of the non-causal cases (default: the benchmark's 4096 and 2048, 16 heads)
SHAPES = [tuple(int(x) for x in sh.split(":")) for sh in os.environ.get("SHAPES", "4096:16:16 2048:16:16").split()]
CASES = ([(f"bc{bc} full {seq}x{batch}x{heads}", bc, seq, batch, heads, False) for seq, batch, heads in SHAPES for bc, _ in BLOCKS]
         + [(f"bc{BLOCKS[0][0]} causal 2048", BLOCKS[0][0], 2048, 16, 16, True)])
built = {bc: flashgen.compile(f"(FP16, 128, 128, {bc}, 12): wgmma+stages_{st}+pingpong+intra+persistent") for bc, st in BLOCKS}


def check(bc: int, b: int, sq: int, h: int, sk: int, causal: bool) -> float:
    """Relative error against float64 attention, output poisoned with NaN first."""
    q = torch.randn(b, sq, h, 128, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(b, sk, h, 128, device="cuda", dtype=torch.float16) for _ in range(2))
    out = torch.full_like(q, float("nan"))
    built[bc](q, k, v, causal=causal, out=out)
    qd, kd, vd = (x.double().transpose(1, 2) for x in (q, k, v))
    s = qd @ kd.transpose(-1, -2) / 128 ** 0.5
    if causal:
        s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
    ref = (s.softmax(-1) @ vd).transpose(1, 2)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert torch.isfinite(out).all() and err < 2e-3, (bc, b, sq, h, sk, causal, err)
    return err


# more tiles than SMs (CTAs loop), key tails, causal: every version must pass before it is timed
# (NOCHECK=1: diagnostic builds whose output is wrong by design skip it)
if not os.environ.get("NOCHECK"):
    worst = max(check(bc, *shape) for bc in built for shape in ((2, 2048, 12, 2048, False), (1, 4096, 8, 3000, False), (2, 1024, 20, 1024, True)))
    print(f"{tag}: correct, worst rel err {worst:.2e}", flush=True)

monitor = GpuMonitor(nvidia_smi_id(torch.cuda.current_device()), interval_ms=100)
monitor.start()
for name, bc, seq, batch, heads, causal in CASES:
    q, k, v = (torch.randn(batch, seq, heads, 128, device="cuda", dtype=torch.float16) for _ in range(3))
    fn = lambda: built[bc](q, k, v, causal=causal)  # noqa: E731
    flops = 4 * batch * heads * seq * seq * 128 / (2 if causal else 1)
    bench_ms = do_bench(fn, warmup=50, rep=200, return_mode="median")
    t0 = time.time()
    while time.time() - t0 < 2.0:
        fn()
        torch.cuda.synchronize()
    # enough launches for >= 0.5 s, so the 100 ms sampler lands several samples in the window (20
    # launches of a 0.5 ms kernel fall between two samples)
    n = max(20, int(0.5e3 / bench_ms))
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t1 = time.monotonic()
    e0.record()
    for _ in range(n):
        fn()
    e1.record()
    torch.cuda.synchronize()
    clk, pw = monitor.clock_and_power(t1, time.monotonic())
    b2b_ms = e0.elapsed_time(e1) / n
    print(f"{tag:8s} {name:18s} do_bench {bench_ms * 1000:8.1f} us {flops / bench_ms / 1e9:5.0f} TFLOP/s | "
          f"back to back {b2b_ms * 1000:8.1f} us {flops / b2b_ms / 1e9:5.0f} TFLOP/s at {clk:.0f} MHz {pw:.0f} W", flush=True)
monitor.stop()
