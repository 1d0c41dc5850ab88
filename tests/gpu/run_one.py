"""Run one config once on a small input (for compute-sanitizer and ncu); exit 1 on a wrong result.

usage: python tests/gpu/run_one.py "<short form>" [seq] [batch] [heads]
"""
import math
import sys

import torch

import flashgen


def main() -> int:
    cfg = flashgen.load_config(sys.argv[1])
    seq = int(sys.argv[2]) if len(sys.argv) > 2 else 256
    batch = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    heads = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    attn = flashgen.compile(cfg)
    torch.manual_seed(0)
    q, k, v = (torch.randn(batch, seq, heads, cfg.d_head, device="cuda", dtype=cfg.dtype.torch) for _ in range(3))
    out = torch.full_like(q, float("nan"))
    attn(q, k, v, out=out)
    torch.cuda.synchronize()
    qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k, v))
    ref = (torch.softmax(qd @ kd.transpose(-1, -2) / math.sqrt(cfg.d_head), -1) @ vd).transpose(1, 2)
    err = (out.double() - ref).abs().max().item()
    print(f"{cfg.short_form()}: max error {err:.3e}")
    return 0 if err < 1e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
