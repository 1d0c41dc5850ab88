"""Time kernels the benchmark's way (do_bench, L2 flushed) and back to back at the power cap.

Run once per code version (a folder holding a flashgen/ package, first on PYTHONPATH), e.g. main
against a diagnostic build whose producer skips the K/V loads after the ring is full (session 10,
docs/results/kv_traffic_h100.txt):

    for r in 1 2; do for v in main noload; do TAG=$v$r PYTHONPATH=$PWD/.probe/$v:/tmp/site python tools/energy_probe.py; done; done

Cases: fp16, d_head 128, 16 heads; persistent B_c 128 / 160 at seq 4096 (batch 16) non-causal,
B_c 128 at seq 2048 causal. Prints do_bench medians and, after a 2 s warm loop, the mean of 20
back-to-back launches with the median SM clock and power sampled meanwhile.
"""
import os
import subprocess
import threading
import time

import torch
from triton.testing import do_bench

import flashgen

tag = os.environ.get("TAG", "?")
torch.manual_seed(0)
CASES = [("bc128 full 4096", 128, 4096, 16, False), ("bc160 full 4096", 160, 4096, 16, False), ("bc128 full 2048", 128, 2048, 16, False),
         ("bc160 full 2048", 160, 2048, 16, False), ("bc128 causal 2048", 128, 2048, 16, True)]
built = {bc: flashgen.compile(f"(FP16, 128, 128, {bc}, 12): wgmma+stages_2+pingpong+intra+persistent") for bc in (128, 160)}


def smi() -> tuple[float, float]:
    out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout.split(",")
    return float(out[0]), float(out[1])




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
worst = max(check(bc, *shape) for bc in (128, 160) for shape in ((2, 2048, 12, 2048, False), (1, 4096, 8, 3000, False), (2, 1024, 20, 1024, True)))
print(f"{tag}: correct, worst rel err {worst:.2e}", flush=True)

for name, bc, seq, batch, causal in CASES:
    q, k, v = (torch.randn(batch, seq, 16, 128, device="cuda", dtype=torch.float16) for _ in range(3))
    fn = lambda: built[bc](q, k, v, causal=causal)  # noqa: E731
    flops = 4 * batch * 16 * seq * seq * 128 / (2 if causal else 1)
    bench_ms = do_bench(fn, warmup=50, rep=200, return_mode="median")
    t0 = time.time()
    while time.time() - t0 < 2.0:
        fn()
        torch.cuda.synchronize()
    samples, stop = [], threading.Event()

    def sample():
        while not stop.is_set():
            samples.append(smi())
            time.sleep(0.1)
    th = threading.Thread(target=sample)
    th.start()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(20):
        fn()
    e1.record()
    torch.cuda.synchronize()
    stop.set()
    th.join()
    b2b_ms = e0.elapsed_time(e1) / 20
    clk = sorted(s[0] for s in samples)[len(samples) // 2] if samples else float("nan")
    pw = sorted(s[1] for s in samples)[len(samples) // 2] if samples else float("nan")
    print(f"{tag:8s} {name:18s} do_bench {bench_ms * 1000:8.1f} us {flops / bench_ms / 1e9:5.0f} TFLOP/s | "
          f"back to back {b2b_ms * 1000:8.1f} us {flops / b2b_ms / 1e9:5.0f} TFLOP/s at {clk:.0f} MHz {pw:.0f} W", flush=True)
