"""Does a kernel's benchmark timing depend on what ran just before it? (session 11, H100)

The benchmark times every kernel of a row once per round with do_bench; the boards run at the power
cap. This probe times each target (our persistent B_c 128 and 160, SDPA cuDNN) right after each
predecessor (nothing: 0.5 s idle; the SDPA backends; our three configs), ``REPS`` times with the
predecessors' order rotated, and prints the target's do_bench median TFLOP/s per predecessor with
the board's median SM clock while the target ran. Also prints our host time per call (a do_bench
timing includes any host gap after its L2 flush).

    PYTHONPATH=$PWD:/tmp/site python tools/order_probe.py      # env REPS (default 4), SEQS (default "2048")
"""
import os
import statistics
import time

import torch

import flashgen
from flashgen.bench import PEERS, attention_flops, sdpa_peer, time_ms
from flashgen.gpu_monitor import GpuMonitor, nvidia_smi_id

REPS = int(os.environ.get("REPS", "4"))
SEQS = [int(s) for s in os.environ.get("SEQS", "2048").split()]
OURS = {"p128": "(FP16, 128, 128, 128, 12): wgmma+stages_2+pingpong+intra+persistent",
        "p160": "(FP16, 128, 128, 160, 12): wgmma+stages_2+pingpong+intra+persistent",
        "grid": "(FP16, 128, 128, 128, 12): wgmma+stages_2+pingpong+intra"}
built = {name: flashgen.compile(cfg) for name, cfg in OURS.items()}
monitor = GpuMonitor(nvidia_smi_id(torch.cuda.current_device()), interval_ms=50)
monitor.start()

for seq in SEQS:
    for causal in (False, True):
        torch.manual_seed(seq)
        q, k, v = (torch.randn(16, seq, 16, 128, device="cuda", dtype=torch.float16) for _ in range(3))
        out = torch.empty_like(q)
        fns = {peer.split("_")[0].lower(): sdpa_peer(peer, q, k, v, causal) for peer in PEERS}
        for name, attn in built.items():
            fns[name] = lambda attn=attn: attn(q, k, v, out=out, causal=causal)
        for fn in fns.values():
            fn()
        torch.cuda.synchronize()
        flops = attention_flops(16, 16, seq, seq, 128, causal)
        # host time of one of our calls (enqueue only)
        t0 = time.perf_counter()
        for _ in range(200):
            fns["p128"]()
        host_us = (time.perf_counter() - t0) / 200 * 1e6
        torch.cuda.synchronize()
        print(f"seq {seq} {'causal' if causal else 'full'}: host time per p128 call {host_us:.0f} us", flush=True)
        preds = ["idle"] + list(fns)
        for target in ("p128", "p160", "cudnn"):
            got: dict[str, list[tuple[float, float]]] = {p: [] for p in preds}
            for rep in range(REPS):
                for pred in preds[rep % len(preds):] + preds[:rep % len(preds)]:
                    if pred == "idle":
                        torch.cuda.synchronize()
                        time.sleep(0.5)
                    else:
                        time_ms(fns[pred])
                    t1 = time.monotonic()
                    ms = time_ms(fns[target])
                    clk, _ = monitor.clock_and_power(t1, time.monotonic())
                    got[pred].append((flops / ms / 1e9, clk))
            line = " | ".join(f"{p} {statistics.median(t for t, _ in v):.0f} ({statistics.median(c for _, c in v):.0f} MHz)"
                              for p, v in got.items())
            print(f"  {target:5s} after: {line}", flush=True)
            print(f"        rounds: " + " | ".join(f"{p} " + ",".join(f"{t:.0f}" for t, _ in v) for p, v in got.items()), flush=True)
monitor.stop()
