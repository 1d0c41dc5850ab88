"""Random attention inputs for the GPU tests: q, k, v and an output gradient do, reproducible per seed."""
from __future__ import annotations

import torch


def random_qkv_do(shape: tuple, seed: int, dtype: torch.dtype = torch.bfloat16, d_head: int = 128,
                  device: str = "cuda") -> tuple[torch.Tensor, ...]:
    """(q, k, v, do) of ``shape`` = (batch, seq_q, seq_k, heads, kv_heads): standard normal, drawn in fp32 from one
    generator seeded with ``seed`` (q and do first, then k and v), then rounded to ``dtype``."""
    b, sq, sk, hq, hk = shape
    g = torch.Generator(device=device).manual_seed(seed)
    q, do = (torch.randn(b, sq, hq, d_head, device=device, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(b, sk, hk, d_head, device=device, generator=g).to(dtype) for _ in range(2))
    return q, k, v, do
