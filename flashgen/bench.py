"""``flashgen bench``: emitted kernels next to PyTorch's SDPA backends, one process, one run.

Protocol (../shared/BENCHMARK.md): d_head 128, 16 heads, (seq, batch) from
:data:`SHAPES`, (batch, seq, heads, d) contiguous inputs, random normal data; the
median of ``triton.testing.do_bench`` (CUDA-event fallback) after warm-up; SDPA
backends get ``.transpose(1, 2)`` views of the same tensors. The timed flashgen
config's output is checked against a float64 reference in the same run. Results go
to JSON and a PNG; a ratio table is printed last.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable

SHAPES = ((512, 16), (1024, 16), (2048, 16), (4096, 16), (8192, 8), (16384, 4))  # (seq, batch)
PEERS = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION")


def log(msg: str) -> None:
    print(f"[flashgen bench] {msg}", file=sys.stderr, flush=True)


def time_ms(fn: Callable[[], Any]) -> float:
    """Median milliseconds of ``fn`` after warm-up (triton's do_bench when available)."""
    try:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=50, rep=200, return_mode="median"))
    except ImportError:
        import torch

        for _ in range(10):
            fn()
        times = []
        for _ in range(50):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        return sorted(times)[len(times) // 2]


def attention_flops(batch: int, heads: int, seq_q: int, seq_k: int, d: int, causal: bool = False) -> float:
    f = 4.0 * batch * heads * seq_q * seq_k * d
    return f / 2 if causal else f


def reference_error(o, q, k, v, scale: float, rows: int = 512) -> tuple[float, float]:
    """(max |o - ref64|, max |o_torch - ref64|) on batch 0, the first ``rows`` query rows."""
    import torch

    qs, ks, vs, os_ = q[:1, :rows], k[:1], v[:1], o[:1, :rows]
    qd, kd, vd = (t.double().transpose(1, 2) for t in (qs, ks, vs))
    ref = (torch.softmax(qd @ kd.transpose(-1, -2) * scale, -1) @ vd).transpose(1, 2)
    o_t = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (qs, ks, vs)), scale=scale)
    err = (os_.double() - ref).abs().max().item()
    err_t = (o_t.transpose(1, 2).double() - ref).abs().max().item()
    return err, err_t


def matmul_ceiling(dtype) -> float:
    """TFLOP/s of a dense 8192^3 matrix product in ``dtype`` (the tensor cores' practical ceiling)."""
    import torch

    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    ms = time_ms(lambda: a @ b)
    return 2 * n**3 / ms / 1e9


def run_bench(cfgs, dtypes, shapes=SHAPES, heads: int = 16, d_head: int = 128, peers=PEERS) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from .build import build_many
    from .runtime import compile as fg_compile

    cap = torch.cuda.get_device_capability()
    todo = [c for c in cfgs if c.dtype.value in dtypes and c.d_head == d_head]
    if not todo:
        raise SystemExit(f"flashgen: error: no config matches dtypes {dtypes} and d_head {d_head}")
    log(f"building {len(todo)} config(s) in parallel")
    t0 = time.perf_counter()
    failures = build_many(todo, cap)
    for name, err in failures.items():
        log(f"build failed: {name}\n{err}")
    attns = {}
    for c in todo:
        if c.short_form() not in failures:
            attns[c] = fg_compile(c)
    log(f"builds ready in {time.perf_counter() - t0:.0f} s")
    results: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "heads": heads,
        "d_head": d_head,
        "rows": [],
        "matmul_tflops": {},
    }
    for dt_name in dtypes:
        dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[dt_name]
        results["matmul_tflops"][dt_name] = matmul_ceiling(dt)
        log(f"dense {dt_name} 8192^3 matmul: {results['matmul_tflops'][dt_name]:.0f} TFLOP/s")
        for seq, batch in shapes:
            torch.manual_seed(seq)
            q, k, v = (torch.randn(batch, seq, heads, d_head, device="cuda", dtype=dt) for _ in range(3))
            scale = 1 / math.sqrt(d_head)
            flops = attention_flops(batch, heads, seq, seq, d_head)
            row: dict[str, Any] = {"dtype": dt_name, "seq": seq, "batch": batch, "flashgen": {}, "peers": {}}
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
            for peer in peers:
                try:
                    with sdpa_kernel(getattr(SDPBackend, peer)):
                        ms = time_ms(lambda: F.scaled_dot_product_attention(qt, kt, vt))
                    row["peers"][peer] = flops / ms / 1e9
                except RuntimeError as exc:  # backend not available for this input
                    row["peers"][peer] = None
                    log(f"{peer} unavailable at seq {seq}: {str(exc).splitlines()[0]}")
            for cfg, attn in attns.items():
                if cfg.dtype.value != dt_name or seq % cfg.B_r or seq % cfg.B_c:
                    continue
                out = torch.empty_like(q)
                ms = time_ms(lambda: attn(q, k, v, out=out))
                out.fill_(float("nan"))
                attn(q, k, v, out=out)
                err, err_t = reference_error(out, q, k, v, scale)
                ok = bool(err <= 2 * err_t + 1e-5) and not bool(torch.isnan(out).any())
                row["flashgen"][cfg.short_form()] = {"tflops": flops / ms / 1e9, "max_err": err, "torch_err": err_t, "correct": ok}
            best = max(row["flashgen"].items(), key=lambda kv: kv[1]["tflops"], default=None)
            row["best"] = best[0] if best else None
            results["rows"].append(row)
            fa = row["peers"].get("FLASH_ATTENTION")
            if best:
                log(f"{dt_name} seq {seq}: best {best[1]['tflops']:.0f} TFLOP/s ({best[0]}), sdpa flash {fa or float('nan'):.0f}")
    return results


def format_table(results: dict) -> str:
    lines = [
        f"flashgen vs SDPA on {results['gpu']} (torch {results['torch']}, CUDA {results['cuda']}), "
        f"d_head {results['d_head']}, {results['heads']} heads, TFLOP/s (ratio = flashgen / peer)",
        f"{'dtype':5} {'seq':>6} {'flashgen':>9} {'flash':>7} {'cudnn':>7} {'mem-eff':>7} {'x flash':>8} {'x cudnn':>8} {'x mem-eff':>9}  ok  best config",
    ]
    for row in results["rows"]:
        if not row["best"]:
            continue
        fg = row["flashgen"][row["best"]]
        p = row["peers"]

        def num(x):
            return f"{x:7.0f}" if x else "      -"

        def ratio(x, w):
            return f"{fg['tflops'] / x:{w}.3f}" if x else " " * (w - 1) + "-"

        lines.append(
            f"{row['dtype']:5} {row['seq']:>6} {fg['tflops']:9.0f} {num(p.get('FLASH_ATTENTION'))} {num(p.get('CUDNN_ATTENTION'))} "
            f"{num(p.get('EFFICIENT_ATTENTION'))} {ratio(p.get('FLASH_ATTENTION'), 8)} {ratio(p.get('CUDNN_ATTENTION'), 8)} "
            f"{ratio(p.get('EFFICIENT_ATTENTION'), 9)}  {'yes' if fg['correct'] else 'NO '} {row['best']}"
        )
    for dt, tf in results.get("matmul_tflops", {}).items():
        lines.append(f"dense {dt} 8192^3 matmul (practical ceiling): {tf:.0f} TFLOP/s")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no PNG written (pip install matplotlib)")
        return False
    dtypes = sorted({r["dtype"] for r in results["rows"]})
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6 * len(dtypes), 4.5), squeeze=False)
    for ax, dt in zip(axes[0], dtypes):
        rows = [r for r in results["rows"] if r["dtype"] == dt]
        seqs = [r["seq"] for r in rows]
        series = {"flashgen (best)": [r["flashgen"][r["best"]]["tflops"] if r["best"] else None for r in rows]}
        for peer in PEERS:
            series[f"SDPA {peer.lower()}"] = [r["peers"].get(peer) for r in rows]
        for label, ys in series.items():
            pts = [(s, y) for s, y in zip(seqs, ys) if y]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length")
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"{dt}, d_head {results['d_head']}, {results['gpu']}")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("configs", nargs="*", help="configs: YAML files, short forms or a named set (default: defaults)")
    p.add_argument("--dtypes", nargs="+", default=["fp16", "bf16"], choices=["fp16", "bf16"])
    p.add_argument("--seqs", nargs="+", type=int, help="sequence lengths (default: all of BENCHMARK.md's)")
    p.add_argument("-o", "--out", default="bench_out", help="folder for bench.json and bench.png (default: bench_out)")


def main(args: argparse.Namespace) -> int:
    import torch

    from .dsl.config import default_configs
    from .dsl.sets import resolve_configs

    if not torch.cuda.is_available():
        print("flashgen: error: bench needs a CUDA GPU", file=sys.stderr)
        return 2
    cfgs = resolve_configs(args.configs) if args.configs else default_configs()
    shapes = [s for s in SHAPES if not args.seqs or s[0] in args.seqs]
    results = run_bench(cfgs, args.dtypes, shapes)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(results, indent=2, sort_keys=True))
    plot(results, out / "bench.png")
    log(f"wrote {out / 'bench.json'} and {out / 'bench.png'}")
    print(format_table(results))
    return 0 if all(fg["correct"] for r in results["rows"] for fg in r["flashgen"].values()) else 1
