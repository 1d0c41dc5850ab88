"""Quick GPU smoke: build a few configs, compare with a float64 reference, time vs SDPA."""
import sys, time, math, json, os
import torch
import flashgen
from flashgen.dsl.config import default_configs, kernel_progression

def ref64(q, k, v, scale):
    qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k, v))
    s = qd @ kd.transpose(-1, -2) * scale
    return (torch.softmax(s, -1) @ vd).transpose(1, 2)

def main():
    cfgs = [flashgen.load_config(s) for s in sys.argv[1:]] or default_configs()
    torch.manual_seed(0)
    from flashgen.build import build_many
    print(build_many(cfgs, torch.cuda.get_device_capability()))
    for cfg in cfgs:
        t0 = time.time()
        attn = flashgen.compile(cfg, verbose=True)
        dt = cfg.dtype.torch
        for (b, s, h) in [(2, 256, 3), (1, 1024, 2)]:
            q, k, v = (torch.randn(b, s, h, cfg.d_head, device="cuda", dtype=dt) for _ in range(3))
            out = torch.full_like(q, float("nan"))
            attn(q, k, v, out=out)
            torch.cuda.synchronize()
            r = ref64(q, k, v, 1 / math.sqrt(cfg.d_head))
            o_t = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
            err = (out.double() - r).abs().max().item()
            err_t = (o_t.double() - r).abs().max().item()
            print(f"{cfg.short_form()} b{b} s{s} h{h}: err {err:.2e} torch {err_t:.2e} {'OK' if err <= 2*err_t + 1e-5 else 'FAIL'} (build {time.time()-t0:.1f}s)", flush=True)
        # timing at 4096
        b, s, h = 16, 4096, 16
        q, k, v = (torch.randn(b, s, h, cfg.d_head, device="cuda", dtype=dt) for _ in range(3))
        from triton.testing import do_bench
        flops = 4 * b * h * s * s * cfg.d_head
        ms = do_bench(lambda: attn(q, k, v), return_mode="median")
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        from torch.nn.attention import sdpa_kernel, SDPBackend
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            ms_fa = do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt), return_mode="median")
        print(f"   seq 4096: {flops/ms/1e9:.0f} TFLOP/s, sdpa flash {flops/ms_fa/1e9:.0f} TFLOP/s, ratio {ms_fa/ms:.3f}", flush=True)


if __name__ == '__main__':
    main()
