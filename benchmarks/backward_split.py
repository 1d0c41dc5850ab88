"""Where a backward's time goes, kernel by kernel: flashgen's ``compile("auto")`` next to SDPA's cuDNN and flash
and, where it is installed, FlashAttention-4.

    python benchmarks/backward_split.py -o results/backward_split.json      # on a CUDA GPU
    python benchmarks/backward_split.py --d-heads 128 --seqs 2048 --causal yes

For each shape (bf16, 16k tokens, 2048 / d_head heads: the benchmark's) one forward is recorded and its
backward (dq, dk, dv of a random dO) run ``--reps`` times under the torch profiler, for flashgen and for
each peer, called as ``flashgen bench`` calls it (:mod:`flashgen.bench_peers`). Each kernel's
device time per backward is listed (the main kernel, the preprocess, the dQ conversion, any fill), with
the total and TFLOP/s (2.5x the forward's FLOPs, causal half). A profile, not a benchmark: the figures
to quote are ``flashgen bench auto --passes bwd``'s, which times whole calls in interleaved rounds.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashgen import bench_peers  # noqa: E402


def split(fn, reps: int) -> dict[str, float]:
    """Device microseconds per call of ``fn`` by kernel name (after three untimed calls)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    times: dict[str, float] = collections.defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            times[e.name] += e.device_time / reps
    return dict(sorted(times.items(), key=lambda kv: -kv[1]))


def backward_flops(d_head: int, seq: int, tokens: int, causal: bool) -> float:
    heads, batch = 2048 // d_head, tokens // seq
    return 2.5 * 4 * batch * heads * seq * seq * d_head * (0.5 if causal else 1.0)


def shape_split(attn, d_head: int, seq: int, causal: bool, tokens: int, reps: int, peers) -> dict:
    """One row: flashgen's kernels and each peer's (names of :data:`flashgen.bench_peers.PEERS`) for one shape."""
    import torch

    heads, batch = 2048 // d_head, tokens // seq
    q, k, v = (torch.randn(batch, seq, heads, d_head, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    o = attn(q, k, v, causal=causal)
    sides = {"flashgen": split(lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True), reps)}
    for peer, make in bench_peers.makers(peers).items():
        ot = make(q, k, v, causal)()  # o as (batch, heads, seq, d_head)
        sides[bench_peers.LABELS[peer]] = split(lambda: torch.autograd.grad(ot, (q, k, v), do.transpose(1, 2), retain_graph=True), reps)
    return {"d_head": d_head, "seq": seq, "causal": causal, "flops": backward_flops(d_head, seq, tokens, causal), **sides}


def report(row: dict, width: int = 70) -> list[str]:
    """A row's lines: per side the total and TFLOP/s, then each kernel over 1 us."""
    lines = [f"== d_head {row['d_head']}, seq {row['seq']}{', causal' if row['causal'] else ''}"]
    for side in [name for name in row if isinstance(row[name], dict)]:
        total = sum(row[side].values())
        lines.append(f"  {side}: {total:.1f} us, {row['flops'] / total / 1e6:.0f} TFLOP/s")
        lines += [f"    {t:9.1f} us  {name[:width]}" for name, t in row[side].items() if t >= 1.0]
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-heads", type=int, nargs="+", default=[128, 64], help="head sizes (default 128 64)")
    p.add_argument("--seqs", type=int, nargs="+", default=[2048, 8192], help="sequence lengths (default 2048 8192)")
    p.add_argument("--causal", choices=["no", "yes", "both"], default="both", help="masks (default both)")
    p.add_argument("--tokens", type=int, default=16384, help="batch x seq (default 16384)")
    p.add_argument("--reps", type=int, default=10, help="profiled backwards per side and shape (default 10)")
    p.add_argument("-o", "--out", type=Path, help="write the rows here as JSON")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("backward_split.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import flashgen

    attn = flashgen.compile("auto")
    peers = tuple(p for p in bench_peers.default_peers() if p != "EFFICIENT_ATTENTION")  # mem-eff: not a flash backward
    masks = {"no": [False], "yes": [True], "both": [False, True]}[args.causal]
    rows = []
    for d_head in args.d_heads:
        for seq in args.seqs:
            for causal in masks:
                rows.append(shape_split(attn, d_head, seq, causal, args.tokens, args.reps, peers))
                print("\n".join(report(rows[-1])), flush=True)
    if args.out:
        meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda, "reps": args.reps,
                "fa4_version": bench_peers.fa4_version()}
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
