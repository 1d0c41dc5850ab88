"""Clock and power while a kernel runs back to back (is the run power-bound?), and one launch each for ncu.

    python tools/clock_probe.py clocks        # nvidia-smi samples during 3 s loops of each case
    python tools/clock_probe.py once CASE     # one launch of CASE (after a warm-up), for ncu --launch-skip

Cases: fp16 d_head 128, 16 heads; persistent B_c 128 / 160, the grid kernel and SDPA cuDNN at seq 4096
(batch 16) and 16384 (batch 4), non-causal.
"""
import subprocess
import sys
import threading
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashgen

CFG = {"pers128": "(FP16, 128, 128, 128, 12): wgmma+stages_2+pingpong+intra+persistent",
       "pers160": "(FP16, 128, 128, 160, 12): wgmma+stages_2+pingpong+intra+persistent",
       "grid128": "(FP16, 128, 128, 128, 12): wgmma+stages_2+pingpong+intra"}


def case(name: str):
    kind, seq = name.rsplit("_", 1)
    seq = int(seq)
    b = {4096: 16, 16384: 4}[seq]
    q, k, v = (torch.randn(b, seq, 16, 128, device="cuda", dtype=torch.float16) for _ in range(3))
    if kind == "cudnn":
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

        def run():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                torch.nn.functional.scaled_dot_product_attention(qt, kt, vt)
        return run
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
for name, fn in fns.items():
    samples = []
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active",
                                  "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout.strip()
            samples.append(out)
            time.sleep(0.2)
    th = threading.Thread(target=sample)
    t0 = time.time()
    n = 0
    th.start()
    while time.time() - t0 < 3.0:
        for _ in range(5):
            fn()
        n += 5
        torch.cuda.synchronize()
    stop.set()
    th.join()
    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ev0.record()
    for _ in range(10):
        fn()
    ev1.record()
    torch.cuda.synchronize()
    mid = samples[len(samples) // 3:]  # past the ramp
    clocks = [float(s.split(",")[0]) for s in mid]
    power = [float(s.split(",")[1]) for s in mid]
    reasons = sorted({s.split(",")[3].strip() for s in mid})
    print(f"{name:14s} {ev0.elapsed_time(ev1) / 10 * 1000:9.1f} us  sm clock {min(clocks):.0f}-{max(clocks):.0f} MHz "
          f"(median {sorted(clocks)[len(clocks) // 2]:.0f})  power {sorted(power)[len(power) // 2]:.0f} W  reasons {reasons}", flush=True)
