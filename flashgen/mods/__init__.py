"""Programmable attention: FlexAttention-style ``score_mod`` / ``mask_mod`` traced into DSL expressions.

``score_mod(score, b, h, q_idx, kv_idx) -> score`` and ``mask_mod(b, h, q_idx, kv_idx) -> keep``,
written in Python with torch operations, are traced once (trace.py) into a DAG of frozen expression
objects (expr.py) whose canonical form (traced.py) keys the kernel and which renders a
``__host__ __device__`` C++ function (cpp.py) and evaluates itself in numpy (evaluate.py), the two
following one semantic table (ops.py). Captured numbers and tensors become kernel arguments
(capture.py), read again on every call, so new values reuse the kernel. A mask_mod's diagonal conjuncts
(``q_idx >= kv_idx``, ``q_idx - kv_idx <= 128``) run as the kernels' built-in causal / window rule
(diagonal.py, :attr:`TracedMod.diagonal`).

    from flashgen.mods import prepare
    mod, args = prepare(softcap, "score")   # cached per function
    mod.key, mod.to_cpp(), mod.evaluate(score, b, h, q_idx, kv_idx, args=args)
"""
from .cache import CacheInfo, cache_info, clear_cache, prepare, traced
from .errors import ModError
from .kernel_mods import KernelMods, prepare_mods
from .trace import trace
from .traced import ModArgs, TracedMod

__all__ = ["CacheInfo", "KernelMods", "ModArgs", "ModError", "TracedMod", "prepare_mods", "cache_info", "clear_cache", "prepare", "trace", "traced"]
