"""The default-config policy: which kernel ``compile("auto")`` runs for a call's shape.

A call's (GPU, dtype, d_head, sequence length, masked?) maps to the winner that
``flashgen tune`` stored for its sequence bucket (``$FLASHGEN_CACHE/tune.json``), else to
the shipped default: the wgmma engine on compute capability 9.0 where it takes the head
size, the mma.sync default elsewhere. The choice depends on the length only through its
bucket. This module sits below the runtime and the tuner: it times nothing.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from . import cache
from .dsl.config import ConfigError, DType, KernelConfig, default_configs

BUCKETS = (512, 1024, 2048, 4096, 8192, 16384)


def tune_cache_path() -> Path:
    return Path(os.environ.get("FLASHGEN_TUNE_CACHE", cache.root() / "tune.json"))


def seq_bucket(seq: int) -> int:
    """The tuned bucket a sequence length falls into: the nearest power of two on a log scale, clamped.

    Comparisons only (seq < b * sqrt(2), in integers), so a traced call with a symbolic length picks
    its bucket under guards instead of breaking the graph."""
    for b in BUCKETS[:-1]:
        if seq * seq < 2 * b * b:
            return b
    return BUCKETS[-1]


def bucket_key(seq: int, masked: bool = False) -> str:
    """The cache key of a sequence length's bucket; masked calls have buckets of their own (a mask
    changes which config wins: tiles of unequal length, no larger key block)."""
    return f"{seq_bucket(seq)}/masked" if masked else str(seq_bucket(seq))


def load_cache(path: Path | None = None) -> dict:
    path = path or tune_cache_path()
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        print(f"[flashgen] ignoring unreadable tune cache {path}: {exc}", file=sys.stderr, flush=True)
        return {}


#: Key block size of the default wgmma-engine kernel per d_head (registers: O + S + P per consumer;
#: shared memory: Q + 2 stages of K and V).
HOPPER_B_C = {64: 128, 128: 128, 192: 96, 256: 64}
#: Unmasked sequences in the buckets ``lo`` to ``hi`` take the larger key block ``B_c`` (d_head -> (lo, hi, B_c)):
#: the per-block fixed cost (row max, barrier turns, O rescale) spreads over more keys. d_head 128
#: persistent B_c 160 (the most that fits beside the output tile) measured +4 to +9% at seq 2048-4096
#: on an H100 and +1 to +5% on an H200, about even at 8192, 0-5% slower at 16384 on the H200; shorter
#: and masked sequences run faster with B_c 128, and for d_head 64 every larger block was slower
#: (docs/results/block_size.txt). ``seq`` 0 (unknown) keeps the base block.
HOPPER_LONG_B_C = {128: (2048, 8192, 160)}


def hopper_default(dtype: DType, d_head: int, seq: int = 0, masked: bool = False) -> KernelConfig | None:
    """The default Hopper (wgmma) config for a head size (and, where it matters, the sequence length
    and whether a mask is applied), or None where that engine does not take the head size."""
    if d_head not in HOPPER_B_C:
        return None
    B_c = HOPPER_B_C[d_head]
    lo, hi, long_b_c = HOPPER_LONG_B_C.get(d_head, (0, 0, B_c))
    if seq and lo <= seq_bucket(seq) <= hi and not masked:
        B_c = long_b_c
    cfg = KernelConfig.wgmma(dtype, d_head=d_head, B_c=B_c)
    try:  # persistent where the separate output tile fits in shared memory (d_head 64 and 128)
        return cfg.replace(persistent=True)
    except ConfigError:
        return cfg


def lookup(gpu: str, dtype: DType, d_head: int, seq: int, cache: dict | None = None,
           capability: tuple[int, int] | None = None, masked: bool = False) -> KernelConfig:
    """The tuned config for a shape, else the shipped default: the wgmma engine on compute capability 9.0
    where it takes the head size (:func:`hopper_default`), else the mma.sync default for the dtype (and
    d_head). ``masked``: a causal or window mask will be applied (only ``--causal`` tuning serves it)."""
    from .dsl.notation import parse_config

    cache = load_cache() if cache is None else cache
    entry = cache.get(gpu, {}).get(dtype.value, {}).get(str(d_head), {}).get(bucket_key(seq, masked))
    if entry:
        return parse_config(entry["config"])
    if capability is not None and tuple(capability) == (9, 0):
        hopper = hopper_default(dtype, d_head, seq, masked)
        if hopper is not None:
            return hopper
    base = next(c for c in default_configs() if c.dtype == dtype)
    return base if base.d_head == d_head else base.replace(d_head=d_head)
