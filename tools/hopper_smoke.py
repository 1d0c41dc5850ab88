"""First light of a wgmma-engine kernel: build, run small diagnostic inputs, print errors (no pytest).

usage: python tools/hopper_smoke.py ["<short form>"]

Cases isolate the two GEMMs: ``k = 0`` makes P uniform (checks O += P V alone); ``v`` one-hot
per key (seq_k = d_head) makes O equal P (checks S = Q K^T and the softmax); then random inputs.
"""
import math
import sys
import time

import torch

import flashgen
from flashgen.dsl.config import KernelConfig


def ref(q, k, v, scale):
    qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k, v))
    return (torch.softmax(qd @ kd.transpose(-1, -2) * scale, -1) @ vd).transpose(1, 2)


def main() -> int:
    cfg = flashgen.load_config(sys.argv[1]) if len(sys.argv) > 1 else KernelConfig.wgmma("fp16")
    t0 = time.time()
    attn = flashgen.compile(cfg)
    print(f"{cfg}: built in {time.time() - t0:.1f} s", flush=True)
    d, dt = cfg.d_head, cfg.dtype.torch
    torch.manual_seed(0)
    bad = 0
    for name, (b, s, h, sk) in (("k=0", (1, 128, 1, 128)), ("v=onehot", (1, 128, 1, d)), ("random", (2, 512, 3, 512)), ("tail", (1, 200, 2, 77))):
        q = torch.randn(b, s, h, d, device="cuda", dtype=dt)
        k = torch.randn(b, sk, h, d, device="cuda", dtype=dt)
        v = torch.randn(b, sk, h, d, device="cuda", dtype=dt)
        if name == "k=0":
            k.zero_()
        if name == "v=onehot":
            v = torch.eye(sk, d, device="cuda", dtype=dt)[None, :, None, :].expand(b, sk, h, d).contiguous()
        out = torch.full_like(q, float("nan"))
        o = attn(q, k, v, out=out)
        torch.cuda.synchronize()
        r = ref(q, k, v, 1 / math.sqrt(d))
        err = (o.double() - r).abs()
        e = err.nan_to_num(float("inf")).max().item()
        print(f"  {name:9s} {(b, s, h, sk)}: max err {e:.3e}, NaN {o.isnan().sum().item()}", flush=True)
        if not e < 2e-2:
            bad += 1
            rows = err.nan_to_num(1e9).amax(dim=(0, 2, 3))
            cols = err.nan_to_num(1e9).amax(dim=(0, 1, 2))
            print("    bad rows:", (rows > 2e-2).nonzero().flatten()[:40].tolist())
            print("    bad cols:", (cols > 2e-2).nonzero().flatten()[:40].tolist())
            print("    o[0, :4, 0, :8]  ", o[0, :4, 0, :8].float().cpu().numpy())
            print("    ref[0, :4, 0, :8]", r[0, :4, 0, :8].float().cpu().numpy())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
