"""``flashgen tune``: time a config space on this GPU and remember the best per shape bucket.

The cache (``$FLASHGEN_CACHE/tune.json``) maps ``gpu name -> dtype -> d_head -> seq
bucket`` to the winning short form and its TFLOP/s; buckets tuned with ``--causal`` are
kept apart (``"4096/masked"``) and serve calls with a causal or window mask.
``flashgen.compile("auto")`` looks configs up here (falling back to the shipped defaults
when a bucket is missing).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from .build import cache_root
from .dsl.config import ConfigError, DType, KernelConfig, default_configs, hopper_configs, tuning_space

BUCKETS = (512, 1024, 2048, 4096, 8192, 16384)


def log(msg: str) -> None:
    print(f"[flashgen tune] {msg}", file=sys.stderr, flush=True)


def tune_cache_path() -> Path:
    return Path(os.environ.get("FLASHGEN_TUNE_CACHE", cache_root() / "tune.json"))


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


def default_space(dtypes, capability: tuple[int, int]) -> list[KernelConfig]:
    """What ``flashgen tune`` times when given no configs: the wgmma engine's set on compute
    capability 9.0 (where ``compile("auto")`` would otherwise pick it), the seed's mma.sync space
    elsewhere."""
    return hopper_configs(dtypes) if tuple(capability) == (9, 0) else tuning_space(dtypes)


def load_cache(path: Path | None = None) -> dict:
    path = path or tune_cache_path()
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        log(f"ignoring unreadable tune cache {path}: {exc}")
        return {}


def save_cache(data: dict, path: Path | None = None) -> None:
    path = path or tune_cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
    os.replace(tmp, path)


#: Key block size of the default wgmma-engine kernel per d_head (registers: O + S + P per consumer;
#: shared memory: Q + 2 stages of K and V).
HOPPER_B_C = {64: 128, 128: 128, 192: 96, 256: 64}
#: Unmasked sequences in the buckets ``lo`` to ``hi`` take the larger key block ``B_c`` (d_head -> (lo, hi, B_c)):
#: the per-block fixed cost (row max, barrier turns, O rescale) spreads over more keys. d_head 128
#: persistent B_c 160 (the most that fits beside the output tile) measured +4 to +9% at seq 2048-4096
#: on an H100 and +1 to +5% on an H200, about even at 8192, 0-5% slower at 16384 on the H200; shorter
#: and masked sequences run faster with B_c 128, and for d_head 64 every larger block was slower
#: (docs/results/block_160_h100.txt). ``seq`` 0 (unknown) keeps the base block.
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


def tune(cfgs: list[KernelConfig], seqs: list[int], heads: int = 16, rounds: int = 3, finalists: int = 4,
         causal: bool = False) -> dict[str, Any]:
    """Time the configs per (dtype, d_head, sequence bucket) and store the fastest in the cache: one
    timing each, then the ``finalists`` fastest again in ``rounds`` interleaved rounds (medians), so
    a config that was lucky once does not win (:func:`flashgen.bench.pick_fastest`). ``causal``: time
    causal attention and store the winners under the masked buckets."""
    import torch

    from .bench import attention_flops, pick_fastest
    from .build import build_many
    from .runtime import compile as fg_compile

    gpu = torch.cuda.get_device_name()
    log(f"building {len(cfgs)} configs")
    failures = build_many(cfgs, torch.cuda.get_device_capability())
    ok = [c for c in cfgs if c.short_form() not in failures]
    cache = load_cache()
    batch_for = {512: 16, 1024: 16, 2048: 16, 4096: 16, 8192: 8, 16384: 4}  # BENCHMARK.md's (seq, batch)
    found: dict[str, Any] = {}
    for dtype in sorted({c.dtype for c in ok}, key=lambda d: d.value):
        for d_head in sorted({c.d_head for c in ok if c.dtype == dtype}):
            group = [c for c in ok if c.dtype == dtype and c.d_head == d_head]
            for seq in seqs:
                batch = batch_for[seq_bucket(seq)]
                q, k, v = (torch.randn(batch, seq, heads, d_head, device="cuda", dtype=dtype.torch) for _ in range(3))
                out = torch.empty_like(q)
                flops = attention_flops(batch, heads, seq, seq, d_head, causal)
                # every kernel takes any length (a key tail is masked in its last block)
                fns = {cfg.short_form(): (lambda attn=fg_compile(cfg): attn(q, k, v, out=out, causal=causal)) for cfg in group}
                name, medians = pick_fastest(fns, rounds, finalists)
                best_tf = flops / medians[name] / 1e9
                log(f"{dtype.value} d{d_head} seq {seq}{' causal' if causal else ''}: best {best_tf:.0f} TFLOP/s of {len(fns)} (median of {rounds} rounds "
                    f"among {len(medians)} finalists): {name}")
                entry = {"config": name, "tflops": round(best_tf, 1), "candidates": len(fns),
                         "finalists": {n: round(flops / ms / 1e9, 1) for n, ms in medians.items()}, "time": time.strftime("%Y-%m-%d")}
                cache.setdefault(gpu, {}).setdefault(dtype.value, {}).setdefault(str(d_head), {})[bucket_key(seq, causal)] = entry
                found[f"{dtype.value}/d{d_head}/{bucket_key(seq, causal)}"] = entry
    save_cache(cache)
    return found


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("configs", nargs="*",
                   help="config space: YAML files, short forms or named sets (default: the hopper set on "
                        "compute capability 9.0, else tuning-space)")
    p.add_argument("--dtypes", nargs="+", default=["fp16", "bf16"], choices=["fp16", "bf16"],
                   help="element types to tune (default: fp16 bf16)")
    p.add_argument("--seqs", nargs="+", type=int, default=list(BUCKETS),
                   help=f"sequence lengths to tune, one per bucket (buckets: {' '.join(map(str, BUCKETS))}; default: all)")
    p.add_argument("--causal", action="store_true",
                   help="time causal attention; its winners serve compile('auto') calls with a causal or window mask")
    p.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds of the finalists (default: 3)")
    p.add_argument("--finalists", type=int, default=4, help="fastest configs of the first timing that are timed again (default: 4)")


def main(args: argparse.Namespace) -> int:
    import torch

    from .cli import CommandError, resolve_configs

    for flag, value in (("--rounds", args.rounds), ("--finalists", args.finalists)):
        if value < 1:
            raise CommandError(f"{flag} must be at least 1, got {value}")
    if any(s < 1 for s in args.seqs):
        raise CommandError(f"--seqs must be positive, got {' '.join(map(str, args.seqs))}")
    buckets: dict[int, int] = {}
    for seq in args.seqs:
        if seq_bucket(seq) in buckets:
            raise CommandError(f"--seqs {buckets[seq_bucket(seq)]} and {seq} fall into the same bucket ({seq_bucket(seq)}); "
                               "give one length per bucket")
        buckets[seq_bucket(seq)] = seq
    if not torch.cuda.is_available():
        raise CommandError("tune needs a CUDA GPU")
    capability = torch.cuda.get_device_capability()
    space = list(resolve_configs(args.configs).configs) if args.configs else default_space(args.dtypes, capability)
    space = [c for c in space if c.dtype.value in args.dtypes]
    if not space:
        raise CommandError(f"no config of dtype {' or '.join(args.dtypes)} to tune")
    found = tune(space, args.seqs, rounds=args.rounds, finalists=args.finalists, causal=args.causal)
    print(f"tuned {len(found)} bucket(s); cache: {tune_cache_path()}")
    for key, entry in found.items():
        print(f"  {key:24} {entry['tflops']:7.1f} TFLOP/s  {entry['config']}")
    return 0
