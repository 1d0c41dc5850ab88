"""Run one config once on a small input (for compute-sanitizer and ncu); exit 1 on a wrong result.

usage: python tests/gpu/run_one.py "<short form>" [seq] [batch] [heads] [seq_k] [kv_heads] [align] [--backward]

The config's mask (causal/window) is applied aligned `align` (top_left, the default, or
bottom_right); with window the sizes are (17, 5). ``--backward``: the call is differentiated
too (its backward kernels run once) and dq, dk, dv are checked as well.
"""
import sys

import torch

import flashgen


def _backward_error(o, q, k, v, **mask) -> float:
    do = torch.randn_like(o)
    got = torch.autograd.grad(o, (q, k, v), do)
    torch.cuda.synchronize()
    want = flashgen.reference.gradients(q, k, v, do, **mask)
    return max((g.double() - w).abs().max().item() / max(1.0, w.abs().max().item()) for g, w in zip(got, want))


def main() -> int:
    backward = "--backward" in sys.argv
    sys.argv = [a for a in sys.argv if a != "--backward"]
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
    window = (17, 5) if cfg.mask == "window" else None
    mask = {"causal": cfg.mask == "causal", "window": window, "align": align}
    if backward:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = attn(q, k, v, **mask)
    else:
        out = torch.full_like(q, float("nan"))
        attn(q, k, v, out=out, **mask)
    torch.cuda.synchronize()
    ref = flashgen.reference.attention(q.detach(), k.detach(), v.detach(), **mask)
    err = (out.detach().double() - ref).abs().max().item()
    print(f"{cfg.short_form()}: max error {err:.3e}")
    if backward:
        grad_err = _backward_error(out, q, k, v, **mask)
        print(f"backward: max relative error {grad_err:.3e}")
        err = max(err, grad_err / 5)
    return 0 if err < 1e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
