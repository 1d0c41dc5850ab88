"""Run one config once with a score_mod and a mask_mod on a small input (for compute-sanitizer); exit 1
on a wrong result.

usage: python tests/gpu/run_mods.py "<short form>" [seq_q] [seq_k]

softcap with a document mask over packed sequences (their block mask made on the GPU), GQA 4 -> 2
heads, batch 2, against the float64 reference.
"""
import importlib.util
import sys
from pathlib import Path

import torch

import flashgen

_spec = importlib.util.spec_from_file_location("mods_examples", Path(__file__).parents[2] / "examples" / "mods.py")
examples = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(examples)


def main() -> int:
    cfg = flashgen.load_config(sys.argv[1])
    seq_q = int(sys.argv[2]) if len(sys.argv) > 2 else 37
    seq_k = int(sys.argv[3]) if len(sys.argv) > 3 else 91
    n = max(seq_q, seq_k)
    lengths = [n // 3, n - 2 * (n // 3), n // 3]
    score, mask = examples.softcap(20.0), examples.document_mask(lengths, device="cuda")
    attn = flashgen.compile(cfg)
    torch.manual_seed(0)
    q = torch.randn(2, seq_q, 4, cfg.d_head, device="cuda", dtype=cfg.dtype.torch)
    k, v = (torch.randn(2, seq_k, 2, cfg.d_head, device="cuda", dtype=cfg.dtype.torch) for _ in range(2))
    o = attn(q, k, v, score_mod=score, mask_mod=mask)
    torch.cuda.synchronize()
    flashgen.reference.check_attention(o, q, k, v, "softcap + documents", score_mod=score, mask_mod=mask)
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
