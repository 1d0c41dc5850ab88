"""Clock and power while a kernel runs back to back (is the run power-bound?), and one launch each for ncu.

    python tools/clock_probe.py clocks        # nvidia-smi samples during 3 s loops of each case
    python tools/clock_probe.py once CASE     # one launch of CASE (after a warm-up), for ncu --launch-skip

Cases: fp16 d_head 128, 16 heads; persistent B_c 128 / 160, the grid kernel and SDPA cuDNN at seq 4096
(batch 16) and 16384 (batch 4), non-causal.
"""
import sys
import time

import torch

import flashgen
from flashgen.bench import sdpa_peer
from flashgen.gpu_monitor import GpuMonitor, nvidia_smi_id

CFG = {"pers128": "(FP16, 128, 128, 128, 12): wgmma+stages_2+pingpong+intra+persistent",
       "pers160": "(FP16, 128, 128, 160, 12): wgmma+stages_2+pingpong+intra+persistent",
       "grid128": "(FP16, 128, 128, 128, 12): wgmma+stages_2+pingpong+intra"}


def case(name: str):
    kind, seq = name.rsplit("_", 1)
    seq = int(seq)
    b = {4096: 16, 16384: 4}[seq]
    q, k, v = (torch.randn(b, seq, 16, 128, device="cuda", dtype=torch.float16) for _ in range(3))
    if kind == "cudnn":
        return sdpa_peer("CUDNN_ATTENTION", q, k, v, causal=False)
    attn = flashgen.compile(CFG[kind])
    return lambda: attn(q, k, v)


NAMES = [f"{k}_{s}" for s in (4096, 16384) for k in ("pers128", "pers160", "grid128", "cudnn")]

if sys.argv[1] == "once":
    fn = case(sys.argv[2])
    fn()
    torch.cuda.synchronize()
    fn()
    torch.cuda.synchronize()
    sys.exit(0)

fns = {n: case(n) for n in NAMES}
for fn in fns.values():
    fn()
torch.cuda.synchronize()
with GpuMonitor(nvidia_smi_id(torch.cuda.current_device())) as mon:
    for name, fn in fns.items():
        t0 = time.monotonic()
        while time.monotonic() - t0 < 3.0:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
        ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ev0.record()
        for _ in range(10):
            fn()
        ev1.record()
        torch.cuda.synchronize()
        t1 = time.monotonic()
        mid = [x for t, x in mon.samples if t0 + 1.0 <= t <= t1]  # past the ramp
        clk, pw = mon.clock_and_power(t0 + 1.0, t1)
        clocks = [x.clock_mhz for x in mid if x.clock_mhz is not None]
        reasons = sorted({f"0x{x.reasons:016x}" for x in mid if x.reasons is not None})
        rng = f"{min(clocks):.0f}-{max(clocks):.0f} MHz" if clocks else "? MHz"
        print(f"{name:14s} {ev0.elapsed_time(ev1) / 10 * 1000:9.1f} us  sm clock {rng} "
              f"(median {clk:.0f})  power {pw:.0f} W  reasons {reasons}", flush=True)
