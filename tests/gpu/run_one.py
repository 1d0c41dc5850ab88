"""Run one config once on a small input (for compute-sanitizer and ncu); exit 1 on a wrong result.

usage: python tests/gpu/run_one.py "<short form>" [seq] [batch] [heads] [seq_k] [kv_heads] [align]

The config's mask (causal/window) is applied aligned `align` (top_left, the default, or
bottom_right); with window the sizes are (17, 5).
"""
import sys

import torch

import flashgen


def main() -> int:
    cfg = flashgen.load_config(sys.argv[1])
    seq = int(sys.argv[2]) if len(sys.argv) > 2 else 256
    batch = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    heads = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    seq_k = int(sys.argv[5]) if len(sys.argv) > 5 else seq
    kv_heads = int(sys.argv[6]) if len(sys.argv) > 6 else heads
    align = sys.argv[7] if len(sys.argv) > 7 else "top_left"
    attn = flashgen.compile(cfg)
    torch.manual_seed(0)
    q = torch.randn(batch, seq, heads, cfg.d_head, device="cuda", dtype=cfg.dtype.torch)
    k, v = (torch.randn(batch, seq_k, kv_heads, cfg.d_head, device="cuda", dtype=cfg.dtype.torch) for _ in range(2))
    out = torch.full_like(q, float("nan"))
    window = (17, 5) if cfg.mask == "window" else None
    attn(q, k, v, out=out, causal=cfg.mask == "causal", window=window, align=align)
    torch.cuda.synchronize()
    ref = flashgen.reference.attention(q, k, v, causal=cfg.mask == "causal", window=window, align=align)
    err = (out.double() - ref).abs().max().item()
    print(f"{cfg.short_form()}: max error {err:.3e}")
    return 0 if err < 1e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
