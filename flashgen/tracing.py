"""What a ``torch.compile`` trace of ``compile("auto")`` uses: the kernel pick as a constant of the graph.

Imported only while tracing (torch._dynamo is loaded by then): marking a function
costs an import of torch._dynamo, which a plain eager start should not pay.
"""
from __future__ import annotations

import torch


@torch.compiler.assume_constant_result
def traced_pick(auto_id: int, device: torch.device, dtype: torch.dtype, d_head: int, seq_bucket: int, mask: str) -> int:
    """The launcher handle the AutoAttention numbered ``auto_id`` uses for a traced call's shape
    (run once, at trace time, with the call's constants; the graph keeps the result)."""
    from .runtime import _AUTOS

    return _AUTOS[auto_id].pick(device, dtype, d_head, seq_bucket, mask)._handle
