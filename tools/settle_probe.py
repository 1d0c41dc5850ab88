"""How long does the board take to settle at the power cap once a kernel starts? (session 11, H100)

tools/order_probe.py showed a kernel's do_bench timing depends on what ran just before it. This
probe starts each kernel (SDPA cuDNN, our persistent B_c 128) from a cool board (2 s idle) and from a
hot one (3 s of the other kernel), runs it back to back for 3 s, and prints its throughput and the
board's median SM clock in 250 ms windows: the time until both stop moving is the warm-up a
predecessor-independent timing needs.

    PYTHONPATH=$PWD:/tmp/site python tools/settle_probe.py      # env SEQ (default 2048), CAUSAL=1
"""
import os
import time

import torch

import flashgen
from flashgen.bench import attention_flops, sdpa_peer
from flashgen.gpu_monitor import GpuMonitor, nvidia_smi_id

SEQ = int(os.environ.get("SEQ", "2048"))
CAUSAL = bool(os.environ.get("CAUSAL"))
attn = flashgen.compile("(FP16, 128, 128, 128, 12): wgmma+stages_2+pingpong+intra+persistent")
q, k, v = (torch.randn(16, SEQ, 16, 128, device="cuda", dtype=torch.float16) for _ in range(3))
out = torch.empty_like(q)
fns = {"cudnn": sdpa_peer("CUDNN_ATTENTION", q, k, v, CAUSAL), "p128": lambda: attn(q, k, v, out=out, causal=CAUSAL)}
flops = attention_flops(16, 16, SEQ, SEQ, 128, CAUSAL)
monitor = GpuMonitor(nvidia_smi_id(torch.cuda.current_device()), interval_ms=50)
monitor.start()


def run_for(fn, seconds: float) -> list[tuple[float, float, float]]:
    """Back-to-back launches for ``seconds``: (start s, TFLOP/s, median MHz) per 250 ms window."""
    out, t_start = [], time.monotonic()
    while time.monotonic() - t_start < seconds:
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0, n = time.monotonic(), 0
        e0.record()
        while time.monotonic() - t0 < 0.25:
            fn()
            n += 1
            if n % 8 == 0:
                torch.cuda.synchronize()
        e1.record()
        torch.cuda.synchronize()
        clk, _ = monitor.clock_and_power(t0, time.monotonic())
        out.append((t0 - t_start, flops * n / e0.elapsed_time(e1) / 1e9, clk))
    return out


for fn in fns.values():
    fn()
torch.cuda.synchronize()
for name, fn in fns.items():
    other = fns["p128" if name == "cudnn" else "cudnn"]
    for start in ("cool", "hot"):
        if start == "cool":
            time.sleep(2.0)
        else:
            run_for(other, 3.0)
        trace = run_for(fn, 3.0)
        print(f"{name:5s} from {start} (seq {SEQ}{' causal' if CAUSAL else ''}): "
              + " ".join(f"{t:.2f}s {tf:.0f}@{c:.0f}" for t, tf, c in trace), flush=True)
monitor.stop()
