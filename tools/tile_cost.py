"""Split a kernel's time into a per-key-block cost and a fixed per-tile cost (GPU).

usage: python tools/tile_cost.py [--seq-q 2048] [--batch 16] [--seq-k 1024 2048 4096 8192] "<short form>" ...

The query shape (so the tiles and the CTAs' rounds) stays fixed while seq_k grows; every
tile then walks seq_k / B_c key blocks, and the time fits t = a * blocks + b. b / a is
what one tile costs on top of its key blocks (start, end, epilogue, launch), in key-block
times: the part of the kernel that short sequences pay for most.
"""
import argparse
import math
from statistics import linear_regression, median

import torch

import flashgen
from flashgen.bench import interleaved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("configs", nargs="+")
    ap.add_argument("--seq-q", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq-k", type=int, nargs="+", default=[1024, 2048, 4096, 8192], help="at least two lengths")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if len(set(args.seq_k)) < 2:
        ap.error("--seq-k needs at least two different lengths to fit a line")
    kernels = {}
    for text in args.configs:
        cfg = flashgen.load_config(text)
        kernels[text] = (cfg, flashgen.compile(cfg))
    for text, (cfg, attn) in kernels.items():
        dt = cfg.dtype.torch
        q = torch.randn(args.batch, args.seq_q, args.heads, cfg.d_head, device="cuda", dtype=dt)
        fns, blocks = {}, {}
        for sk in args.seq_k:
            k = torch.randn(args.batch, sk, args.heads, cfg.d_head, device="cuda", dtype=dt)
            v = torch.randn_like(k)
            out = torch.empty_like(q)
            fns[sk] = (lambda q=q, k=k, v=v, out=out: attn(q, k, v, out=out))
            blocks[sk] = math.ceil(sk / cfg.B_c)
        times = {sk: median(t) for sk, t in interleaved(fns, args.rounds).items()}
        a, b = linear_regression([blocks[s] for s in args.seq_k], [times[s] for s in args.seq_k])
        flops = {s: 4 * args.batch * args.heads * args.seq_q * s * cfg.d_head / times[s] / 1e9 for s in args.seq_k}
        print(f"{text}\n  seq_q {args.seq_q} batch {args.batch}: " +
              "  ".join(f"seq_k {s}: {times[s] * 1e3:.1f} us {flops[s]:.0f} TF/s" for s in args.seq_k))
        print(f"  fit: {a * 1e3:.2f} us per key block, {b * 1e3:.1f} us fixed = {b / a:.2f} key blocks per tile round")


if __name__ == "__main__":
    main()
