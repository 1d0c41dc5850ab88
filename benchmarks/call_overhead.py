"""What reaching a kernel costs: host time per call, eager calls against CUDA-graph replay, warm start, cold build.

    python benchmarks/call_overhead.py -o results/        # on a CUDA GPU; writes call_overhead.json
    python benchmarks/call_overhead.py --parts host       # the host-time table only

* **host time per call** on a tiny input (1 x 128 x 1 x 128, bf16): ``compile("auto")`` (and a causal
  call, and calls with a score_mod / mask_mod: a softcap, a document mask over two documents, both; the
  same function objects every call, so after the first call no tracing), a fixed config's ``Attention``,
  SDPA under the cuDNN and flash backends (each backend chosen once per timing, outside the loop). Each timing issues
  ``--calls`` calls back to back and reads the clock before synchronizing (the GPU work of a tiny
  call is shorter than its host work, so the queue never fills); rounds rotate the order.
* **eager against graph replay**: ``compile("auto")`` at seq 512 and 1024 (16k tokens, 16 heads,
  d_head 128, fp16/bf16, causal and not), timed with CUDA events over back-to-back eager calls and
  over replays of a CUDA graph holding the same number of calls of the same kernel; the ratio is
  the share of the kernel's speed a user calling eagerly gets.
* **warm start**: a fresh process with a warm cache, ``compile(cfg)`` plus the first call, after
  ``import torch`` and a CUDA context (median of ``--starts`` processes); ``compile("auto")`` too.
* **cold build**: one kernel not in the cache (a fresh ``FLASHGEN_CACHE`` holding only the launcher).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashgen


def host_us(fn, calls: int, context=contextlib.nullcontext) -> float:
    """Host microseconds per call over ``calls`` back-to-back calls (clock read before the sync), inside
    ``context()`` (entered once, as a program sets an SDPA backend once)."""
    with context():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def rotating_rounds(fns: dict, rounds: int, measure) -> dict:
    """{name: [one value per round]}, each round starting one place later in the list."""
    names = list(fns)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            out[n].append(measure(fns[n]))
    return out


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "rounds": values}


def tiny_host_times(rounds: int, calls: int) -> dict:
    q = torch.randn(1, 128, 1, 128, device="cuda", dtype=torch.bfloat16)
    qt = q.transpose(1, 2)
    auto = flashgen.compile("auto")
    fixed = flashgen.compile(flashgen.KernelConfig.wgmma("bf16") if torch.cuda.get_device_capability() == (9, 0)
                             else flashgen.dsl.config.default_configs()[1])

    sdpa = lambda: F.scaled_dot_product_attention(qt, qt, qt)  # noqa: E731
    softcap, document = tiny_mods(q.shape[1], q.device)
    fns = {"sdpa_cudnn": (sdpa, lambda: sdpa_kernel(SDPBackend.CUDNN_ATTENTION)),
           "sdpa_flash": (sdpa, lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION)),
           "flashgen_fixed": (lambda: fixed(q, q, q), contextlib.nullcontext),
           "flashgen_auto": (lambda: auto(q, q, q), contextlib.nullcontext),
           "flashgen_auto_causal": (lambda: auto(q, q, q, causal=True), contextlib.nullcontext)}
    mods = {"flashgen_auto_score_mod_softcap": lambda: auto(q, q, q, score_mod=softcap),
            "flashgen_auto_mask_mod_document": lambda: auto(q, q, q, mask_mod=document),
            "flashgen_auto_softcap_and_document_mods": lambda: auto(q, q, q, score_mod=softcap, mask_mod=document)}
    fns.update({n: (fn, contextlib.nullcontext) for n, fn in mods.items()})
    for fn, context in fns.values():  # builds, first launches, warm-up
        host_us(fn, 50, context)
    per_round = rotating_rounds(fns, rounds, lambda f: host_us(f[0], calls, f[1]))
    result = {n: summary(v) for n, v in per_round.items()}
    result["auto_over_cudnn"] = result["flashgen_auto"]["median"] / result["sdpa_cudnn"]["median"]
    result["mods_over_auto"] = {n: result[n]["median"] / result["flashgen_auto"]["median"] for n in mods}
    return result


def tiny_mods(seq: int, device: torch.device) -> tuple:
    """A softcap score_mod and a document mask_mod (two documents over ``seq`` tokens), their captures kept as
    a program keeps them: a number, and int32 document ids on the device."""
    cap = 30.0
    doc = torch.tensor([0] * (seq // 2) + [1] * (seq - seq // 2), device=device, dtype=torch.int32)

    def softcap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    def same_document(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    return softcap, same_document


def events_us(fn, calls: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn(calls)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def eager_vs_graph(rounds: int, calls: int) -> list[dict]:
    auto = flashgen.compile("auto")
    rows = []
    for seq in (512, 1024):
        for dtype in (torch.float16, torch.bfloat16):
            for causal in (False, True):
                batch, heads, d = 16384 // seq, 16, 128
                q, k, v = (torch.randn(batch, seq, heads, d, device="cuda", dtype=dtype) for _ in range(3))
                out = torch.empty_like(q)
                call = lambda: auto(q, k, v, out=out, causal=causal)  # noqa: E731
                for _ in range(10):
                    call()
                graph = torch.cuda.CUDAGraph()
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    call()
                torch.cuda.current_stream().wait_stream(side)
                with torch.cuda.graph(graph):
                    for _ in range(calls):
                        call()

                def eager(n):
                    for _ in range(n):
                        call()

                def replay(n):
                    for _ in range(n // calls):
                        graph.replay()

                per_round = rotating_rounds({"eager": eager, "graph": replay}, rounds, lambda fn: events_us(fn, calls * 4))
                flops = 4 * batch * heads * seq * seq * d / (2 if causal else 1)
                e, g = summary(per_round["eager"]), summary(per_round["graph"])
                ratios = [gg / ee for ee, gg in zip(per_round["eager"], per_round["graph"])]
                rows.append({"seq": seq, "dtype": str(dtype).split(".")[-1], "causal": causal,
                             "config": auto.pick(q.device, q.dtype, d, seq, "causal" if causal else "none").cfg.short_form(),
                             "eager_us": e, "graph_us": g, "eager_tflops": flops / e["median"] / 1e6,
                             "graph_tflops": flops / g["median"] / 1e6, "eager_over_graph": summary(ratios)})
                print(f"seq {seq} {rows[-1]['dtype']}{' causal' if causal else ''}: eager {rows[-1]['eager_tflops']:.0f} "
                      f"graph {rows[-1]['graph_tflops']:.0f} TFLOP/s ({statistics.median(ratios):.3f})", file=sys.stderr)
    return rows


_START = """
import sys, time, torch
q = torch.randn(2, 512, 16, 128, device="cuda", dtype=torch.bfloat16); torch.cuda.synchronize()
t0 = time.perf_counter()
import flashgen
attn = flashgen.compile(sys.argv[1]) if sys.argv[1] == "auto" else flashgen.compile(flashgen.load_config(sys.argv[1]))
o = attn(q, q, q); torch.cuda.synchronize()
print(time.perf_counter() - t0)
"""


def warm_start(starts: int) -> dict:
    short = flashgen.KernelConfig.wgmma("bf16").short_form() if torch.cuda.get_device_capability() == (9, 0) \
        else flashgen.dsl.config.default_configs()[1].short_form()
    result = {}
    for what in (short, "auto"):
        subprocess.run([sys.executable, "-c", _START, what], check=True, capture_output=True)  # warms the cache
        times = [float(subprocess.run([sys.executable, "-c", _START, what], check=True, capture_output=True,
                                      text=True).stdout.split()[-1]) for _ in range(starts)]
        result["auto" if what == "auto" else "fixed"] = summary(times)
    return result


def cold_build() -> dict:
    from flashgen import launcher

    launcher_dir = launcher.library().parent
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(launcher_dir, Path(tmp) / launcher_dir.name)
        env = {**os.environ, "FLASHGEN_CACHE": tmp}
        code = ("import time, torch, flashgen; torch.cuda.init(); t0 = time.perf_counter(); "
                "a = flashgen.compile(flashgen.KernelConfig.wgmma('fp16', d_head=64)); print(time.perf_counter() - t0)")
        seconds = float(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                                       env=env).stdout.split()[-1])
    return {"config": flashgen.KernelConfig.wgmma("fp16", d_head=64).short_form(), "seconds": seconds}


def prebuild() -> None:
    """Build every kernel the timings use at once, in parallel (build time is not what is timed here)."""
    from flashgen.build import build_jobs

    auto, cap = flashgen.compile("auto"), torch.cuda.get_device_capability()
    cfgs = {flashgen.KernelConfig.wgmma("bf16") if cap == (9, 0) else flashgen.dsl.config.default_configs()[1]}
    for seq in (128, 512, 1024):
        for dtype in (torch.float16, torch.bfloat16):
            q = torch.empty(1, seq, 1, 128, device="cuda", dtype=dtype)
            cfgs |= {auto.select(q), auto.select(q, masked=True).replace(mask="causal")}
    failures = build_jobs([(c, cap) for c in cfgs], progress=False)
    if failures:
        raise SystemExit("\n".join(f"{cfg.short_form()}: {err}" for (cfg, _), err in failures.items()))


PARTS = ("host", "graph", "start", "cold")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-o", "--out", type=Path, default=Path("."), help="folder for call_overhead.json (default: .)")
    p.add_argument("--rounds", type=int, default=5, help="rotating rounds per measurement (default: 5)")
    p.add_argument("--calls", type=int, default=200, help="calls per timing (default: 200)")
    p.add_argument("--starts", type=int, default=3, help="fresh processes per warm-start timing (default: 3)")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS),
                   help="what to measure: host (host time per call), graph (eager against graph replay), start "
                        "(warm start), cold (cold build) (default: all)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    if args.rounds < 1 or args.calls < 1 or args.starts < 1:
        p.error("--rounds, --calls and --starts must be >= 1")
    prebuild()
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda}
    if "host" in args.parts:
        result["host_us"] = tiny_host_times(args.rounds, args.calls)
        print(json.dumps({n: v["median"] if isinstance(v, dict) and "median" in v else v
                          for n, v in result["host_us"].items()}, indent=1, default=float), file=sys.stderr)
    if "graph" in args.parts:
        result["eager_vs_graph"] = eager_vs_graph(args.rounds, 20)
    if "start" in args.parts:
        result["warm_start_s"] = warm_start(args.starts)
        print("warm start", result["warm_start_s"], file=sys.stderr)
    if "cold" in args.parts:
        result["cold_build"] = cold_build()
        print("cold build", result["cold_build"], file=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "call_overhead.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
